"""`colembed serve` against hostile clients on real sockets: a real uvicorn on loopback, set up as
`colembed serve` sets it up (`run.uvicorn_config`), and the command itself for the process tests.

- 1,100 sockets that send half a request head and stop: /healthz and ordinary clients are
  served while over 1,000 of them are held (the slowest are closed past the connection bound).
- A head that never completes (sent in one piece, trickled, or after a finished request on a
  kept-alive connection) is closed by the head deadline.
- A 401 answers a large unauthenticated body without waiting for it; a foreign Host is 421.
- A SIGKILLed server leaves no render worker (nor any other child) running.

Bounded in count and time; each wait has a deadline that fails the test, no duration is
compared with a bound (benchmarks/serve_slow_clients.py measures)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.fixtures.documents import page
from tests.fixtures.served import index_one_page, start_serve

pytest.importorskip("fastapi")
import httpx  # noqa: E402
import uvicorn  # noqa: E402

from colembed.index import Index  # noqa: E402
from colembed.serve.app import Settings, create_app  # noqa: E402
from colembed.serve.connections import MAX_OPEN  # noqa: E402
from colembed.serve.run import uvicorn_config  # noqa: E402
from tests.runtime.serve.test_serve import AUTH, KEY, small_model  # noqa: E402,F401 (the model fixture)

SLOW = 1100  # more than the connection bound (MAX_OPEN)
WAIT_S = 60  # deadline of every wait below


def enough_files(wanted: int) -> None:
    """This process holds both ends of every socket: raise its open-file limit or skip."""
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        if hard != resource.RLIM_INFINITY and hard < wanted:
            pytest.skip(f"needs {wanted} open files (hard limit {hard})")
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


@contextlib.contextmanager
def live_server(app, head_timeout: float):
    """(url, uvicorn server) on a free loopback port, in a thread of this process."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn_config(app, "127.0.0.1", port, "warning", head_timeout=head_timeout)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(WAIT_S)
        sock.close()


@pytest.fixture(scope="module")
def app(tmp_path_factory, small_model):
    base = tmp_path_factory.mktemp("slow")
    docs = base / "docs"
    docs.mkdir()
    page("one").save(docs / "one.png")
    index = Index(base / "db", model=small_model)
    index.add([docs], progress=False)
    yield create_app(index, Settings(api_key=KEY))
    index.close()


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=WAIT_S)
    return s


def closed_by_server(s: socket.socket) -> bool:
    """Whether the server has closed `s` (EOF or reset), waiting at most WAIT_S."""
    s.settimeout(WAIT_S)
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_healthz_and_clients_are_served_while_slow_sockets_are_held(app):
    enough_files(2 * SLOW + 512)
    # a head deadline far away: what keeps the server answering here is the connection bound
    with live_server(app, head_timeout=600) as (url, server):
        slow = []
        try:
            for _ in range(SLOW):
                s = connect(url)
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and nothing more
                slow.append(s)
            deadline = time.monotonic() + WAIT_S  # all accepted, the oldest closed past the bound
            while len(server.server_state.connections) != MAX_OPEN and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(server.server_state.connections) == MAX_OPEN
            for _ in range(5):
                assert httpx.get(url + "/healthz", timeout=WAIT_S).status_code == 200
                assert (
                    httpx.get(url + "/v1/info", headers=AUTH, timeout=WAIT_S).json()["pages"] == 1
                )
                r = httpx.post(
                    url + "/v1/search", json={"query": "one"}, headers=AUTH, timeout=WAIT_S
                )
                assert r.status_code == 200 and r.json()["results"][0]["hits"]
            held = len(server.server_state.connections)
            assert held >= 1000, held
            # the oldest slow sockets were closed; the newest are still held
            assert closed_by_server(slow[0])
            slow[-1].settimeout(0.5)
            with pytest.raises(TimeoutError):
                slow[-1].recv(1)
        finally:
            for s in slow:
                s.close()


def test_heads_that_never_complete_are_closed(app):
    with live_server(app, head_timeout=1.0) as (url, server):
        silent = connect(url)  # connects and sends nothing
        partial = connect(url)
        partial.sendall(b"POST /v1/search HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        after_a_request = connect(url)  # a finished request, then a next head that stalls
        after_a_request.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert after_a_request.recv(65536).startswith(b"HTTP/1.1 200")
        after_a_request.sendall(b"GET /healthz HTTP/1.1\r\n")
        for s in (silent, partial, after_a_request):
            assert closed_by_server(s)
            s.close()
        # a head trickled in one header at a time, each well inside the keep-alive time
        trickle = connect(url)
        trickle.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        deadline = time.monotonic() + WAIT_S
        closed = False
        while time.monotonic() < deadline and not closed:
            try:
                trickle.sendall(b"X-Slow: 1\r\n")
                trickle.settimeout(0.2)
                closed = trickle.recv(1) == b""
            except TimeoutError:
                continue
            except (ConnectionResetError, BrokenPipeError):
                closed = True
        trickle.close()
        assert closed, "a trickled head was held for the whole wait"
        assert httpx.get(url + "/healthz", timeout=WAIT_S).status_code == 200


def test_a_401_does_not_wait_for_the_body_and_foreign_hosts_are_421(app):
    with live_server(app, head_timeout=30) as (url, _):
        s = connect(url)
        # 50 MB announced (under --max-body-bytes), 1 kB sent: the answer cannot wait for it
        s.sendall(
            b"POST /v1/search HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 50000000\r\n\r\n" + b"x" * 1000
        )
        answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 401"), answer
        assert b"connection: close" in answer.lower()
        assert closed_by_server(s)
        s.close()
        r = httpx.post(
            url + "/v1/search",
            json={"query": "one"},
            timeout=WAIT_S,
            headers={**AUTH, "Host": "attacker.example:8000"},
        )
        assert r.status_code == 421


def children_of(pid: int) -> dict[int, str]:
    """{pid: command line} of the processes whose parent is `pid` (Linux /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found[int(entry.name)] = cmdline
    return found


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited (its new parent has not reaped it yet)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_server_leaves_no_render_workers(tmp_path, small_model):
    index_one_page(tmp_path, small_model)
    children = {}
    proc, url = start_serve(tmp_path / "db", tmp_path / "server.log")
    try:
        hit = httpx.post(url + "/v1/search", json={"query": "one"}, timeout=WAIT_S).json()[
            "results"
        ][0]["hits"][0]
        for _ in range(4):  # page images: renders in the worker processes
            assert httpx.get(url + hit["image_url"], timeout=WAIT_S).status_code == 200
        children = children_of(proc.pid)
        workers = [p for p, cmd in children.items() if "multiprocessing" in cmd]
        assert workers, children
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and any(running(p) for p in children):
            time.sleep(0.1)
        left = {p: cmd for p, cmd in children.items() if running(p)}
        assert not left, f"still running after the server was killed: {left}"
    finally:
        for pid in [proc.pid, *children]:
            with contextlib.suppress(ProcessLookupError):
                if running(pid):
                    os.kill(pid, signal.SIGKILL)
