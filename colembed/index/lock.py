"""One process at a time per index folder, and a refusal that says who holds it.

Qdrant Edge already refuses a second process on a shard (it locks its write-ahead log, readers
included: `EdgeShard.load` takes the same lock), but its error, "failed to open WAL ... Can't init
WAL: Kind(WouldBlock)", names neither the index nor the holder. `FolderLock` takes an OS lock on
`<db>/colembed_index.lock` before Edge opens the shard (fcntl.flock on POSIX, msvcrt.locking on
Windows; the OS drops it when the holder exits, even by SIGKILL) and records there who holds it, so
a second process gets `IndexBusyError` naming the folder, the pid, host and command, and since when.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from .store import StoreError

LOCK_FILE = "colembed_index.lock"
LOCK_BYTE = 1 << 20  # Windows locks a byte range: one byte past the holder record keeps it readable
HOLDER_BYTES = 4096

if sys.platform == "win32":
    import msvcrt

    def _try_lock(fd: int) -> None:
        os.lseek(fd, LOCK_BYTE, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)

    def _unlock(fd: int) -> None:
        os.lseek(fd, LOCK_BYTE, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
else:
    import fcntl

    def _try_lock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def _unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)


class IndexBusyError(StoreError):
    """Another process has this index folder open; `holder` is what it recorded (may be empty)."""

    def __init__(self, folder: Path, holder: dict[str, Any]) -> None:
        self.folder, self.holder = folder, holder
        who = ("this process: close the other Index on it first" if holder.get("pid") == os.getpid()
               else describe(holder))
        super().__init__(f"{folder}: the index is already open ({who}); "
                         "an index folder serves one process at a time (Qdrant Edge locks it): "
                         "wait for that process to finish, or share the index through a Qdrant "
                         "server (--qdrant-url)")


def describe(holder: dict[str, Any]) -> str:
    if not holder.get("pid"):
        return "holder unknown"
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.get("since", 0)))
    return (f"pid {holder['pid']} on {holder.get('host', '?')}, "
            f"`{holder.get('command', '?')}`, since {since}")


def holder_record() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:300] if sys.argv else "",
            "since": time.time()}


class FolderLock:
    """Held from construction to `release()`; raises IndexBusyError when another process has it."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._fd: int | None = os.open(self.folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _try_lock(self._fd)
        except OSError:
            holder = self._read_holder()
            self._close()
            raise IndexBusyError(self.folder, holder) from None
        os.ftruncate(self._fd, 0)
        os.lseek(self._fd, 0, os.SEEK_SET)
        os.write(self._fd, (json.dumps(holder_record()) + "\n").encode())

    def _read_holder(self) -> dict[str, Any]:
        try:
            os.lseek(self._fd, 0, os.SEEK_SET)
            holder = json.loads(os.read(self._fd, HOLDER_BYTES).decode() or "{}")
        except (OSError, ValueError):  # written half-way, or by something else
            return {}
        return holder if isinstance(holder, dict) else {}

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def release(self) -> None:
        if self._fd is not None:
            _unlock(self._fd)
            self._close()
