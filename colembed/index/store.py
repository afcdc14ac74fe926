"""The store interface: what colembed asks of Qdrant, whichever Qdrant it is.

`Store` is the whole surface the rest of colembed uses; `edge.EdgeStore` (Qdrant Edge, embedded in
a folder: the default) and `server.ServerStore` (a Qdrant server through qdrant-client, or
qdrant-client's local mode) implement it with the schema of `schema.py`. No other module imports a
Qdrant client. `backends.open_store` picks the implementation (a module of its own: the
implementations import this interface, so the factory that imports them cannot live here).

Search modes (`SEARCH_MODES`):
- "exact": MaxSim of the query against every page's full multivector (a full scan).
- "two-stage": cheap stages pick candidates, then exact MaxSim reranks their union inside
  Qdrant (`plan.two_stage_plan`: which stages, by what the index holds, and why). The scores of
  returned pages are exact; a page can be missed only if no stage ranks it in its candidates.
- "hybrid" (opt-in): "two-stage"'s ranking fused with a BM25 ranking of the pages' text
  (lexical.py) by reciprocal rank fusion inside Qdrant (plan.HYBRID_CANDIDATES, RRF_K); scores
  are fusion scores, not MaxSim. Needs a collection with the lexical vector (`has_lexical`).
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .errors import BadPointWarning, OldIndexWarning, StoreError
from .plan import TOKENS_STAGE, Stage, two_stage_plan
from .schema import (
    COLS_VECTOR,
    LEXICAL_VECTOR,
    MEAN_VECTOR,
    PAGE_VECTOR,
    ROWS_VECTOR,
    SCHEMA_VECTORS,
    TEXT_FIELD,
    PagePoint,
    decode_text,
    mean_from_payload,
    payload_problems,
    pooled_from_payload,
)
from .where import Where, parse as parse_where

SEARCH_MODES = ("two-stage", "exact", "hybrid")
# Payload indexes every store keeps: `path` (file / folder / glob filters, listing paths) and
# `page` (page ranges). Metadata keys are filtered without one: the exact rerank and the `mean`
# stage scan every allowed page anyway (no HNSW graph), and Qdrant checks a condition on an
# unindexed field page by page.
INDEXED_FIELDS = {"path": "keyword", "page": "integer"}
DEFAULT_SEARCH_MODE = "two-stage"  # the plan and its measured trade-offs: plan.py
SCROLL_PAGE = 256  # payloads per scroll request
UPSERT_BATCH = 16  # points per upsert request


@dataclass(frozen=True)
class StoredHit:
    id: str
    score: float
    payload: dict[str, Any]


class Store(ABC):
    """A collection of page points (`schema.PagePoint`); every method may raise StoreError."""

    location: str
    upgrade_hint: str  # how an older-schema index gets this schema's plan
    lexical_hint: str = "index the files into a new index"  # how one gets the lexical vector
    schema: int  # the schema version of the stored collection (`schema.SCHEMA_VECTORS`)
    plan_schema: int | None = None  # run another schema's plan (benchmarks); None: `schema`'s
    has_lexical: bool = False  # holds the LEXICAL_VECTOR sparse vector (hybrid search)
    use_tokens: bool | None = None  # force the token table on / off (benchmarks); None: if current

    def has_tokens(self) -> bool:
        """Whether this store holds a current centroid table (tokens.py); Edge folders do."""
        return False

    def readable(self, pid: str, payload: Any) -> bool:
        """Whether a stored point's payload fits the schema (`schema.payload_problems`, fields
        a newer colembed added left alone). Every read of payloads, hits and points skips one
        that does not, and says so once per point (BadPointWarning naming it), so one point
        written by something else never stops a search or a run."""
        problems = payload_problems(payload, strict=False)
        if not problems:
            return True
        warned = self.__dict__.setdefault("_warned_points", set())
        if pid not in warned:
            warned.add(pid)
            path = payload.get("path") if isinstance(payload, dict) else None
            warnings.warn(
                f"{self.location}: skipping stored point {pid}"
                + (f" ({str(path)[:200]!r})" if path is not None else "")
                + ": its payload does not fit the index's schema ("
                + "; ".join(problems)
                + "); remove it (Index.remove of its path, or "
                "its id) or index its file again",
                BadPointWarning,
                stacklevel=3,
            )
        return False

    def readable_payloads(self, records) -> list[tuple[str, dict[str, Any]]]:
        """(id, payload) of the records whose payloads fit the schema."""
        return [(pid, p) for pid, p in records if self.readable(pid, p)]

    def searches_with_tokens(self) -> bool:
        """Whether its two-stage plan takes candidates from the centroid table."""
        return self.has_tokens()

    @property
    def vector_names(self) -> tuple[str, ...]:
        """The vectors this collection stores (its schema's)."""
        return SCHEMA_VECTORS[self.schema]

    def plan(self, k: int) -> list[Stage]:
        """This store's two-stage plan; on an old index, says once how to get the faster one. A
        plan forced onto it (`plan_schema`, `use_tokens`) that reads a vector it does not store
        is refused, naming the vector."""
        if MEAN_VECTOR not in self.vector_names and not getattr(self, "_told", False):
            self._told = True
            warnings.warn(
                f"{self.location}: this index has schema {self.schema} (no `mean` "
                "vector), so two-stage search uses the older, slower plan; "
                f"{self.upgrade_hint}.",
                OldIndexWarning,
                stacklevel=3,
            )
        tokens = self.searches_with_tokens() if self.use_tokens is None else self.use_tokens
        stages = two_stage_plan(self.plan_schema or self.schema, k, tokens=tokens)
        missing = sorted(
            {s.using for stage in stages for s in _nested(stage)}
            - {*self.vector_names, TOKENS_STAGE}
        )
        if missing:
            raise StoreError(
                f"{self.location}: this plan reads the {', '.join(missing)} "
                f"vector(s), which this index (schema {self.schema}) does not store"
            )
        return stages

    def stored_vectors(self, point: PagePoint) -> dict[str, np.ndarray]:
        """The point's vectors this collection holds. Made from its `page` vectors and payload
        when the point lacks them: `mean` (a point of a schema-1 index, or carried without it),
        `rows` / `cols` (a point read from a schema-3 index, unpooled pages only: a pooled page's
        rows / cols are those of the page before pooling, which is not stored)."""
        names, vectors = self.vector_names, point.vectors
        if MEAN_VECTOR in names and MEAN_VECTOR not in vectors:
            vectors = dict(
                vectors, **{MEAN_VECTOR: mean_from_payload(vectors[PAGE_VECTOR], point.payload)}
            )
        if any(n in names and n not in vectors for n in (ROWS_VECTOR, COLS_VECTOR)):
            try:
                rows, cols = pooled_from_payload(vectors[PAGE_VECTOR], point.payload)
            except ValueError as e:
                raise StoreError(
                    f"{self.location}: {e} (point {point.id}), and this index "
                    f"(schema {self.schema}) stores them: index the file again "
                    "here"
                ) from e
            vectors = dict(vectors, **{ROWS_VECTOR: rows, COLS_VECTOR: cols})
        return {n: vectors[n] for n in names}

    @abstractmethod
    def upsert(self, points: Sequence[PagePoint]) -> None:
        """Insert or replace points; each point is stored with all its vectors or not at all."""

    @abstractmethod
    def delete(self, ids: Sequence[str]) -> None: ...

    @abstractmethod
    def set_payload(self, ids: Sequence[str], payload: dict[str, Any]) -> None:
        """Set these top-level payload fields of the stored points `ids` (other fields are kept,
        no vector is touched): how metadata changes without embedding a page again."""

    @abstractmethod
    def count(self) -> int: ...

    @abstractmethod
    def payload_page(
        self, offset: Any, limit: int, doing: str
    ) -> tuple[list[tuple[str, dict[str, Any]]], Any]:
        """Up to `limit` (id, payload) in Qdrant's order from `offset` (None: the first), without
        `schema.BULKY_FIELDS`, and the offset of the next (None after the last); a failure
        raises StoreError saying what it was `doing`."""

    def payload_pages(self, limit: int, doing: str, **options: Any):
        """`payload_page` after `payload_page`, from the first point to the last."""
        offset = None
        while True:
            records, offset = self.payload_page(offset, limit, doing, **options)
            yield records
            if offset is None:
                return

    def payloads(self) -> list[tuple[str, dict[str, Any]]]:
        """(id, payload) of every point whose payload fits the schema, without
        `schema.BULKY_FIELDS` (the page text)."""
        return [
            record
            for records in self.payload_pages(SCROLL_PAGE, "list pages")
            for record in self.readable_payloads(records)
        ]

    def any_payload(self) -> dict[str, Any] | None:
        """The payload of one stored point that fits the schema (None when there is none): the
        index's model identity. Nearly always the first point's."""
        for records in self.payload_pages(16, "read a page"):
            good = self.readable_payloads(records)
            if good:
                return good[0][1]
        return None

    def search(
        self,
        queries: Sequence[np.ndarray],
        k: int,
        mode: str,
        where: Any = None,
        texts: Sequence[str] | None = None,
    ) -> list[list[StoredHit]]:
        """Per query (a (tokens, dim) float32 array), the k best pages by MaxSim among those
        `where` (where.py, either form) allows, in every stage of the plan; "hybrid" also needs
        the queries' `texts` (their lexical terms). A hit whose payload does not fit the schema
        is skipped (`readable`)."""
        check_mode(mode)
        self.check_hybrid(mode, texts, len(queries))
        queries = [np.asarray(q, dtype=np.float32) for q in queries]
        where = self.resolve_where(where)
        if where is not None and where.matches_nothing():
            return [[] for _ in queries]
        return [
            [
                StoredHit(pid, score, payload)
                for pid, score, payload in found
                if self.readable(pid, payload)
            ]
            for found in self.search_points(queries, k, mode, where, texts)
        ]

    @abstractmethod
    def search_points(
        self, queries: list[np.ndarray], k: int, mode: str, where: Where | None, texts
    ) -> list[list[tuple[str, float, dict[str, Any]]]]:
        """`search` after its checks (`where` resolved, allowing some pages): per query the
        (id, score, payload) Qdrant returned, best first."""

    def lexical_terms(self, point: PagePoint) -> tuple[list[int], list[float]] | None:
        """The point's BM25 terms (lexical.py) when this collection stores them and the page
        has text with words in it; None otherwise."""
        stored = point.payload.get(TEXT_FIELD)
        if not self.has_lexical or not stored:
            return None
        from .lexical import document_terms

        try:
            terms = document_terms(decode_text(stored))
        except ValueError:
            return None
        return terms if terms[0] else None

    def check_hybrid(self, mode: str, texts: Sequence[str] | None, n: int) -> None:
        """Refuse "hybrid" on a collection without the lexical vector, or without query texts."""
        if mode != "hybrid":
            return
        if not self.has_lexical:
            raise StoreError(
                f"{self.location}: this index holds no lexical (BM25) vector, so "
                f"it cannot search in hybrid mode: {self.lexical_hint}"
            )
        if texts is None or len(texts) != n:
            raise ValueError("hybrid search needs each query's text")

    def file_paths(self) -> list[str]:
        """The distinct stored paths (a `path` glob is matched against them)."""
        return self._cached_paths(lambda: {p["path"] for _, p in self.payloads() if "path" in p})

    def _cached_paths(self, list_them) -> list[str]:
        """`list_them()` sorted, kept until the store's next write where the store counts its
        writes (`_generation`: one writer, an Edge folder); listed each time otherwise."""
        generation = getattr(self, "_generation", None)
        cached = getattr(self, "_paths_cache", None)
        if generation is not None and cached is not None and cached[0] == generation:
            return cached[1]
        paths = sorted(list_them())
        self._paths_cache = (generation, paths)
        return paths

    def resolve_where(self, where: Any) -> Where | None:
        """A filter (either form, or a checked `Where`) with its `path` globs turned into the
        stored paths they match."""
        where = parse_where(where)
        if where is None or not where.has_glob():
            return where
        return where.resolved(self.file_paths())

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


def _nested(stage: Stage) -> list[Stage]:
    """A stage and the stages it is nested in (`within`)."""
    return [stage, *(_nested(stage.within) if stage.within else [])]


def as_point(record: Any) -> PagePoint:
    """A record retrieved with its vectors and payload (either client's: `.id`, `.vector` by
    name, `.payload`) as a PagePoint with float32 vectors. The lexical sparse vector is left
    out: a store makes it again from the payload's text (`lexical_terms`)."""
    return PagePoint(
        str(record.id),
        {
            name: np.asarray(v, dtype=np.float32)
            for name, v in record.vector.items()
            if name != LEXICAL_VECTOR
        },
        dict(record.payload or {}),
    )


def check_mode(mode: str) -> str:
    if mode not in SEARCH_MODES:
        raise ValueError(f"mode must be one of {SEARCH_MODES}, got {mode!r}")
    return mode
