"""A `colembed serve` process on loopback, started as users run it: for the serve benchmarks,
and for the tests of the command (tests/fixtures/served.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

START_TIMEOUT_S = 300


def free_port() -> int:
    """A loopback port free at the time of asking (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(db: Path, port: int, *flags: str) -> list[str]:
    """The argv of `python -m colembed.cli serve` on `db` and loopback `port`, then `flags`."""
    return [
        sys.executable,
        "-m",
        "colembed.cli",
        "serve",
        "--db",
        str(db),
        "--port",
        str(port),
        *flags,
    ]


def wait_until_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> bool:
    """Poll `url`/healthz until it answers 200 (True), or `proc` exits or `timeout_s` pass
    (False)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


def start_server(
    db: Path, model: Path, port: int, log: Path, extra: tuple[str, ...] = ()
) -> subprocess.Popen:
    """`colembed serve` on `db` with `model` and `extra` flags, returned once /healthz answers
    200. Its output goes to `log` (a file, not a pipe: uvicorn writes an access line per request,
    and a pipe nobody reads would block the server)."""
    command = serve_command(db, port, "--model", str(model), *extra)
    with open(log, "w") as stream:
        proc = subprocess.Popen(command, stdout=stream, stderr=subprocess.STDOUT)
    if wait_until_healthy(proc, f"http://127.0.0.1:{port}", START_TIMEOUT_S):
        return proc
    if proc.poll() is not None:
        raise SystemExit(f"server exited: {log.read_text()[-2000:]}")
    proc.kill()
    raise SystemExit("server did not start")
