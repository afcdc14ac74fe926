"""Every error and warning the index raises, in one place (all importable from `colembed.index`).

Standard library only, so that the lock, the stores, the sources and the two indexers (single
process and Ray) all import them from here and from nowhere else: no module has to import a store
or a decoder to name an error.

    StoreError            the store cannot be opened, written or read, or holds something else
      ModelMismatchError  the index holds vectors of another model, variant, image budget or render
      IndexBusyError      another process (or another `Index` in this one) has the folder open
      IndexNotFoundError  there is no index at that place (search and reopen never create one)
      DiskFullError       the index's disk is full: names the folder and the space it needs
    SourceError           one file (or page) cannot be indexed: names it and why
    OldIndexWarning       an index of an older schema: it works, with a slower search plan
    BadPointWarning       a stored point whose payload does not fit the schema: skipped, named
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ..errors import ColembedError


class StoreError(ColembedError, RuntimeError):
    """The index's store cannot be opened, written or read, or holds something else."""


class ModelMismatchError(StoreError, ValueError):
    """The index holds vectors made another way (model, variant, export, image budget, render
    policy) than the one given: mixing them would bias MaxSim, so it is refused."""


class IndexNotFoundError(StoreError, FileNotFoundError):
    """No index at this place; only `colembed index` / `Index.add` with a model creates one."""


class DiskFullError(StoreError, OSError):
    """The disk holding the index ran out of space; every page stored before it is kept."""

    def __init__(
        self, folder: Path | str, free: int, needed: int, cause: BaseException | None = None
    ) -> None:
        self.folder, self.free, self.needed = folder, free, needed
        detail = f" ({cause})" if cause is not None else ""
        super().__init__(
            f"{folder}: the disk is full: {_mb(free)} free, about {_mb(needed)} more are needed to "
            f"go on{detail}; the pages stored so far are kept: free some space (or move the index) "
            "and run the same command again to resume"
        )


class IndexBusyError(StoreError):
    """Another process has this index folder open; `holder` is what it recorded (may be empty)."""

    def __init__(self, folder: Path, holder: dict[str, Any]) -> None:
        self.folder, self.holder = folder, holder
        who = (
            "this process: close the other Index on it first"
            if holder.get("pid") == os.getpid()
            else describe_holder(holder)
        )
        super().__init__(
            f"{folder}: the index is already open ({who}); "
            "an index folder serves one process at a time (Qdrant Edge locks it): "
            "wait for that process to finish, or share the index through a Qdrant "
            "server (--qdrant-url)"
        )


class SourceError(ColembedError, ValueError):
    """A file cannot be indexed; `path` and `reason` say which and why."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(f"{path}: {reason}")


class OldIndexWarning(UserWarning):
    """The index was written by an older schema: it works, with a slower search plan."""


class BadPointWarning(UserWarning):
    """A stored point's payload does not fit the schema (written by hand, or by something other
    than colembed): every read skips it and says so once, naming it, so one bad point never stops
    a search or an indexing run. `Index.remove` of its path, or deleting its id, drops it."""


def describe_holder(holder: dict[str, Any]) -> str:
    """The lock holder's record (lock.py writes it) in words."""
    if not holder.get("pid"):
        return "holder unknown"
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.get("since", 0)))
    return (
        f"pid {holder['pid']} on {holder.get('host', '?')}, "
        f"`{holder.get('command', '?')}`, since {since}"
    )


def _mb(n: int) -> str:
    return f"{n / 2**20:,.0f} MB"
