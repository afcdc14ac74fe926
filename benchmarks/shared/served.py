"""A `colembed serve` process on loopback, started as users run it, for the serve benchmarks."""

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


def start_server(
    db: Path, model: Path, port: int, log: Path, extra: tuple[str, ...] = ()
) -> subprocess.Popen:
    """`python -m colembed.cli serve` on `db` with `model` and `extra` flags, returned once
    /healthz answers 200. Its output goes to `log` (a file, not a pipe: uvicorn writes an access
    line per request, and a pipe nobody reads would block the server)."""
    import httpx

    command = [
        sys.executable,
        "-m",
        "colembed.cli",
        "serve",
        "--db",
        str(db),
        "--model",
        str(model),
        "--port",
        str(port),
        *extra,
    ]
    with open(log, "w") as stream:
        proc = subprocess.Popen(command, stdout=stream, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise SystemExit("server did not start")
