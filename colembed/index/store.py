"""The store interface: what colembed asks of Qdrant, whichever Qdrant it is.

`Store` is the whole surface the rest of colembed uses; `edge.EdgeStore` (Qdrant Edge, embedded in
a folder: the default) and `server.ServerStore` (a Qdrant server through qdrant-client, or
qdrant-client's local mode) implement it with the schema of `schema.py`. No other module imports a
Qdrant client. `open_store` picks the implementation.

Search modes (`SEARCH_MODES`):
- "exact": MaxSim of the query against every page's full multivector (a full scan).
- "two-stage": MaxSim against the row- and column-pooled multivectors picks `PREFETCH_CANDIDATES`
  pages each, then exact MaxSim reranks their union inside Qdrant. The scores of returned pages are
  exact; a page can be missed only if neither pooled stage ranks it in its candidates.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import ColembedError
from .schema import PAGE_VECTOR, PagePoint

SEARCH_MODES = ("two-stage", "exact")
DEFAULT_SEARCH_MODE = "two-stage"  # 10,000 pages: ~8x faster than exact, recall@10 ~0.9 (benchmarks/)
PREFETCH_CANDIDATES = 100  # per pooled stage; the rerank sees at most twice this many pages
SCROLL_PAGE = 256  # payloads per scroll request
UPSERT_BATCH = 16  # points per upsert request


class StoreError(ColembedError, RuntimeError):
    """The index's store cannot be opened, written or read, or holds something else."""


class ModelMismatchError(StoreError, ValueError):
    """The index holds vectors of another model, variant or export than the one given."""


@dataclass(frozen=True)
class StoredHit:
    id: str
    score: float
    payload: dict[str, Any]


class Store(ABC):
    """A collection of page points (`schema.PagePoint`); every method may raise StoreError."""

    location: str

    @abstractmethod
    def upsert(self, points: Sequence[PagePoint]) -> None:
        """Insert or replace points; each point is stored with all its vectors or not at all."""

    @abstractmethod
    def delete(self, ids: Sequence[str]) -> None: ...

    @abstractmethod
    def count(self) -> int: ...

    @abstractmethod
    def payloads(self) -> list[tuple[str, dict[str, Any]]]:
        """(id, payload) of every point."""

    @abstractmethod
    def any_payload(self) -> dict[str, Any] | None:
        """The payload of one stored point (None when empty): the index's model identity."""

    @abstractmethod
    def search(self, queries: Sequence[np.ndarray], k: int, mode: str) -> list[list[StoredHit]]:
        """Per query (a (tokens, dim) float32 array), the k best pages by MaxSim."""

    @abstractmethod
    def points(self, ids: Sequence[str]) -> dict[str, PagePoint]:
        """The stored points (all vectors as float32, payload) of the ids that are stored: a
        moved or duplicated file's pages are copied from them instead of embedded again."""

    def page_vectors(self, ids: Sequence[str]) -> dict[str, np.ndarray]:
        """The full `page` multivector (float32) of each id that is stored."""
        return {pid: point.vectors[PAGE_VECTOR] for pid, point in self.points(ids).items()}

    def flush(self) -> None:
        """Make every finished write durable."""

    def close(self) -> None:
        """Release the store (flushes)."""


def as_point(record: Any) -> PagePoint:
    """A record retrieved with its vectors and payload (either client's: `.id`, `.vector` by
    name, `.payload`) as a PagePoint with float32 vectors."""
    return PagePoint(str(record.id), {name: np.asarray(v, dtype=np.float32)
                                      for name, v in record.vector.items()},
                     dict(record.payload or {}))


def check_mode(mode: str) -> str:
    if mode not in SEARCH_MODES:
        raise ValueError(f"mode must be one of {SEARCH_MODES}, got {mode!r}")
    return mode


def open_store(location: str | os.PathLike | None = None, *, url: str | None = None,
               api_key: str | None = None, dim: int | None = None,
               collection: str | None = None, local: bool = False) -> Store:
    """An embedded Qdrant Edge store in the folder `location` (default), a Qdrant server at `url`,
    or qdrant-client's local mode in the folder `location` (`local=True`: slow, for checks).
    `dim` is needed only to create a new collection."""
    if url is not None:
        from .server import ServerStore

        return ServerStore(url=url, api_key=api_key, dim=dim, collection=collection)
    if location is None:
        raise ValueError("give a folder for the index or a Qdrant server url")
    if local:
        from .server import ServerStore

        return ServerStore(path=Path(location), dim=dim, collection=collection)
    from .edge import EdgeStore

    return EdgeStore(Path(location), dim=dim)
