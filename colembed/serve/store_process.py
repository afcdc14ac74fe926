"""The index folder's store in a child process, so that a search never stops the event loop.

qdrant-edge-py (0.9, the newest release) holds the GIL for the whole of a call into the shard: a
search of a large index (~0.1-1 s) would stop every other thread of the server, the event loop
included, so `/healthz`, refusals and the page would wait behind it (measured:
benchmarks/results/serve/serve.md). Here the child process owns the folder (Qdrant Edge allows one
process per folder: the child is that process, holding the folder's lock) and runs the real
`EdgeStore`; the server's `Index` talks to it through `ChildStore`, a `Store` whose every method
is a call over a local connection. The parent waits on a socket (the GIL is free meanwhile), so
the event loop answers while the child searches; the results are the same store's, exact.

- `open_store_in_child` has `backends.open_store`'s signature (`Index(store_opener=...)`): a
  folder opens in a child, a Qdrant server (`url`) or qdrant-client's local mode in-process as
  before (a server's client waits on the network, which frees the GIL).
- Each calling thread gets a connection of its own, and the child serves each on a thread of its
  own: a job's writes and the searches queue in the child as they did in one process.
- The child ends when told (`close`: flush, close the shard, release the lock) or when the
  server's process is gone (its lifeline connection closes), closing the store first, so a killed
  server never leaves a child holding the folder.
- Errors come back as they were raised (StoreError and its kinds), or as StoreError with the
  original type's name and message when one cannot be pickled.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import threading
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..index.backends import open_store
from ..index.errors import StoreError
from ..index.store import Store
from ..index.schema import PagePoint

# The store's methods the child answers; anything else is refused there.
CALLS = frozenset(
    {
        "upsert",
        "delete",
        "count",
        "payloads",
        "any_payload",
        "payload_page",
        "search_points",
        "points",
        "page_vectors",
        "flush",
        "has_tokens",
        "set_payload",
        "file_paths",
    }
)


def open_store_in_child(location=None, **options: Any) -> Store:
    """`backends.open_store` (the same arguments), with an Edge folder opened in a child process
    (`ChildStore`)."""
    return open_store(location, edge_store=ChildStore, **options)


class ChildStore(Store):
    """A `Store` whose calls run in a child process that owns the index folder.

    The child is `python -m colembed.serve.store_process` (a plain subprocess, not
    multiprocessing's spawn, which would import the caller's main module again). Its stdin and
    stdout are the lifeline: the parent writes what to open (and the connections' key, never on
    the command line) and later `close`; the child answers one line each. Calls go over
    `multiprocessing.connection` on a Unix socket in a private temporary folder."""

    def __init__(self, folder: Path, *, dim: int | None = None) -> None:
        self._authkey = os.urandom(32)
        package_parent = str(Path(__file__).resolve().parents[2])
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(
                [package_parent] + [p for p in [os.environ.get("PYTHONPATH")] if p]
            ),
        )
        self._process = subprocess.Popen(
            [sys.executable, "-m", "colembed.serve.store_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._send_line({"folder": str(folder), "dim": dim, "authkey": self._authkey.hex()})
        value = self._read_line(f"{folder}: opening the index")
        self._address = value["address"]
        self.location, self.schema, self.dim = value["location"], value["schema"], value["dim"]
        self.upgrade_hint = value["upgrade_hint"]
        self.has_lexical = value.get("has_lexical", False)
        self.lexical_hint = value.get("lexical_hint", self.lexical_hint)
        self._free: list[Connection] = []
        self._connections: list[Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    def _send_line(self, message: dict) -> None:
        self._process.stdin.write((json.dumps(message) + "\n").encode())
        self._process.stdin.flush()

    def _read_line(self, doing: str) -> Any:
        """The child's answer (raised if it is an error); StoreError if the child ended."""
        line = self._process.stdout.readline()
        if not line:
            code = self._process.wait(30)
            raise StoreError(
                f"{doing}: the store process ended (exit code {code}; its messages are above)"
            )
        status, value = pickle.loads(base64.b64decode(line))
        if status == "error":
            raise value
        return value

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _call(self, name: str, *args: Any) -> Any:
        with self._lock:
            if self._closed:
                raise StoreError(f"{self.location}: the index is closed")
            conn = self._free.pop() if self._free else None
        if conn is None:
            conn = Client(self._address, authkey=self._authkey)
            with self._lock:
                self._connections.append(conn)
        try:
            conn.send((name, args))
            status, value = conn.recv()
        except (EOFError, OSError) as e:
            with self._lock:
                self._connections.remove(conn)
            raise StoreError(
                f"{self.location}: the store process is gone ({type(e).__name__}: {e})"
            ) from None
        with self._lock:
            self._free.append(conn)
        if status == "error":
            raise value
        return value

    def upsert(self, points: Sequence[PagePoint]) -> None:
        self._call("upsert", list(points))

    def delete(self, ids: Sequence[str]) -> None:
        self._call("delete", list(ids))

    def count(self) -> int:
        return self._call("count")

    def payloads(self) -> list[tuple[str, dict[str, Any]]]:
        return self._call("payloads")

    def any_payload(self) -> dict[str, Any] | None:
        return self._call("any_payload")

    def payload_page(self, offset: Any, limit: int, doing: str):
        return self._call("payload_page", offset, limit, doing)

    def search_points(self, queries: list[np.ndarray], k: int, mode: str, where, texts):
        return self._call("search_points", queries, k, mode, where, texts)

    def set_payload(self, ids: Sequence[str], payload: dict[str, Any]) -> None:
        self._call("set_payload", list(ids), payload)

    def file_paths(self) -> list[str]:
        return self._call("file_paths")

    def points(self, ids: Sequence[str]) -> dict[str, PagePoint]:
        return self._call("points", list(ids))

    def page_vectors(self, ids: Sequence[str]) -> dict[str, np.ndarray]:
        return self._call("page_vectors", list(ids))  # the page vectors only cross the pipe

    def has_tokens(self) -> bool:
        return self._call("has_tokens")

    def flush(self) -> None:
        self._call("flush")

    def close(self) -> None:
        """Close the store in the child (flushed, folder lock released) and wait for it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections, self._connections, self._free = self._connections, [], []
        for conn in connections:
            conn.close()
        try:
            self._send_line({"close": True})
            self._read_line(f"{self.location}: closing the index")
        except (BrokenPipeError, OSError) as e:
            raise StoreError(
                f"{self.location}: the store process ended before closing the index ({e})"
            ) from None
        finally:
            try:
                self._process.wait(60)
            except subprocess.TimeoutExpired:
                self._process.kill()
            for stream in (self._process.stdin, self._process.stdout):
                stream.close()


# ------------------------------------------------------------------------------- the child
def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 (a custom exception whose constructor pickle cannot call)
        return StoreError(f"{type(error).__name__}: {error}")


def _answer(out, status: str, value: Any) -> None:
    out.write(base64.b64encode(pickle.dumps((status, value))) + b"\n")
    out.flush()


def _child_main() -> None:
    """The child: open the store, listen, answer calls until told to close or the parent is gone
    (its stdin ends). stdout carries only the answers; anything else goes to stderr."""
    out = sys.stdout.buffer
    sys.stdout = sys.stderr
    request = json.loads(sys.stdin.readline())
    from ..index.edge import EdgeStore

    try:
        store = EdgeStore(Path(request["folder"]), dim=request["dim"])
    except BaseException as e:  # noqa: BLE001 (reported to the parent, which raises it)
        _answer(out, "error", _picklable(e))
        return
    listener = Listener(authkey=bytes.fromhex(request["authkey"]))  # a Unix socket, private folder
    _answer(
        out,
        "ok",
        {
            "address": listener.address,
            "location": store.location,
            "schema": store.schema,
            "dim": store.dim,
            "upgrade_hint": store.upgrade_hint,
            "has_lexical": store.has_lexical,
            "lexical_hint": store.lexical_hint,
        },
    )
    threading.Thread(
        target=_accept, args=(listener, store), name="colembed-store-accept", daemon=True
    ).start()
    told = bool(sys.stdin.readline())  # a "close" line, or "" once the server's process is gone
    code = 0
    try:
        store.close()
        if told:
            _answer(out, "ok", None)
    except BaseException as e:  # noqa: BLE001
        code = 1
        if told:
            _answer(out, "error", _picklable(e))
        else:
            print(
                f"colembed store process: closing {request['folder']} failed: {e}", file=sys.stderr
            )
    finally:
        listener.close()
    os._exit(code)  # the accept and call threads end with the process


def _accept(listener: Listener, store) -> None:
    while True:
        try:
            conn = listener.accept()
        except (OSError, EOFError):
            return  # closed at exit
        except Exception:  # noqa: BLE001 (a client that failed authentication)
            continue
        threading.Thread(
            target=_serve, args=(conn, store), name="colembed-store-call", daemon=True
        ).start()


def _serve(conn: Connection, store) -> None:
    while True:
        try:
            name, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if name not in CALLS:
                raise StoreError(f"the store process does not answer {name!r}")
            reply = ("ok", getattr(store, name)(*args))
        except BaseException as e:  # noqa: BLE001 (sent back and raised in the caller)
            reply = ("error", _picklable(e))
        try:
            conn.send(reply)
        except (OSError, EOFError):
            return


if __name__ == "__main__":
    _child_main()
