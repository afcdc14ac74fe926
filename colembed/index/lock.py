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
import weakref
from pathlib import Path
from typing import Any

from .errors import IndexBusyError, StoreError

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


def holder_record() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:300] if sys.argv else "",
        "since": time.time(),
    }


class FolderLock:
    """Held from construction to `release()`, or until the lock object is garbage collected (a
    finaliser closes the descriptor, which drops the OS lock: a forgotten `Index` does not keep
    its folder locked for the life of the process). Raises IndexBusyError when another process
    has it, StoreError naming the folder when the lock file cannot be made (a read-only folder)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        try:
            self._fd: int | None = os.open(self.folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StoreError(
                f"{self.folder}: cannot open the index's lock file "
                f"({e.strerror or e}); the folder must be writable, readers "
                "included (Qdrant Edge writes beside its data)"
            ) from e
        try:
            _try_lock(self._fd)
        except OSError:
            holder = self._read_holder()
            self._close()
            raise IndexBusyError(self.folder, holder) from None
        self._finalizer = weakref.finalize(self, os.close, self._fd)
        try:
            os.ftruncate(self._fd, 0)
            os.lseek(self._fd, 0, os.SEEK_SET)
            os.write(self._fd, (json.dumps(holder_record()) + "\n").encode())
        except OSError:  # a full disk: the OS lock is what counts, the record is a courtesy
            pass

    def _read_holder(self) -> dict[str, Any]:
        try:
            os.lseek(self._fd, 0, os.SEEK_SET)
            holder = json.loads(os.read(self._fd, HOLDER_BYTES).decode() or "{}")
        except (OSError, ValueError):  # written half-way, or by something else
            return {}
        return holder if isinstance(holder, dict) else {}

    def _close(self) -> None:
        if self._fd is not None:
            finalizer = getattr(self, "_finalizer", None)
            if finalizer is not None:
                finalizer.detach()
            os.close(self._fd)
            self._fd = None

    def release(self) -> None:
        if self._fd is not None:
            _unlock(self._fd)
            self._close()
