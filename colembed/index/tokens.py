"""Token-level candidates: a few centroids per page, scanned in numpy for every query.

Why: a query's answer usually sits in a few percent of a page's tokens (one table cell, one
caption), while most tokens are blank paper that looks alike on every page. A page-level summary
(the `mean` vector, row/column pooling) dilutes those few tokens into the background, so a page
whose mean is ordinary never reaches the exact rerank (docs/search.md: 8 of 40 local-answer queries at
10,000 pages). Clustering a page's image tokens keeps a text block as a centroid of its own, and
the MaxSim of the query against each page's `CENTROIDS` centroids ranks every page (no gate).

Why numpy and not a Qdrant vector: Qdrant's MaxSim over a multivector is a per-pair loop, and
one BLAS matmul over the same matrix is ~20x faster; an HNSW graph over the centroids as points
is too slow to build at 100,000 pages (docs/search.md, "Measured alternatives").

The table lives beside the store (`TokenTable`: two append-only files, memory-mapped); it is
derived data, rebuilt from the stored `page` vectors when it does not match the store (a crash
between the two writes, a folder written by an older colembed). numpy only.
"""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import AbstractSet, Callable, Iterable, Sequence

import numpy as np

from ..blas import one_thread

CENTROIDS = 16  # per page: 3-6 text blocks + background need a few each (bench: 8/16/32)
KMEANS_ROUNDS = 6
# The table's on-disk format: float32 rows. Measured against float16 (half the bytes): numpy
# widens float16 to float32 without SIMD here, so the scan took 1.8x as long for one query at
# 100,000 pages (benchmarks/results/experiments/search-scan-100k.md); int8 with a scale per centroid (a
# quarter) saved ~10% of the scan at 10,000 pages (the product, not the reading, is what costs)
# while moving a score by up to 0.13 (a scratch measurement, docs/search.md). A new format gets
# a new file name beside this one, so that old tables still open.
TABLE_FILE = "tokens.f32"  # (rows, CENTROIDS, dim) float32, appended
IDS_FILE = "tokens.ids"  # 17 bytes a row: uuid bytes + 1 (live) / 0 (deleted), appended
_ID_BYTES = 17
# Replaced and deleted pages leave dead rows (the files only grow). Past this fraction of dead
# rows the table is rewritten with its live rows only (`compact`, on open and by `colembed
# upgrade`): every query scans every row, dead ones included, so the bound is also the most
# the scan is slowed by them (2x), and a rewrite costs one sequential copy of the live rows.
MAX_DEAD_FRACTION = 0.5
COMPACTING, SET_ASIDE = ".compacting", ".replaced"  # sibling folders of a compaction
# The scan: pages per product. 256 pages x 16 centroids x 128 dims is 2 MiB of float32 and its
# similarities (4,096 x the query tokens) stay in the core's L2 cache while they are reduced, so
# the table is read from memory once; the scan's chunks are shared among `SCAN_THREADS` threads,
# each holding its BLAS to one thread (blas.one_thread: numpy releases the GIL in the product).
SCAN_CHUNK_PAGES = 256
SCAN_THREADS = max(1, min(os.cpu_count() or 1, 8))
SCAN_MIN_PAGES_PER_THREAD = 4096  # below this one thread scans alone (too little to share)


def page_centroids(image_tokens: np.ndarray, k: int = CENTROIDS) -> np.ndarray:
    """(k, dim) float32: spherical k-means of a page's image tokens (unit-norm centroids).
    Deterministic: k-means++ seeding from a fixed seed, `KMEANS_ROUNDS` Lloyd rounds. A page with
    fewer than k tokens repeats its tokens."""
    x = np.asarray(image_tokens, dtype=np.float32)
    if len(x) <= k:
        return _unit(x[np.arange(k) % len(x)])
    with one_thread():  # products of (tokens x 128) by (128 x k): too small to share (blas.py)
        return _spherical_kmeans(x, k)


def _spherical_kmeans(x: np.ndarray, k: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    centres = [x[rng.integers(len(x))]]
    gap = 1.0 - x @ centres[0]
    for _ in range(1, k):
        p = np.maximum(gap, 0) ** 2
        centres.append(
            x[rng.choice(len(x), p=p / p.sum()) if p.sum() > 0 else rng.integers(len(x))]
        )
        gap = np.minimum(gap, 1.0 - x @ centres[-1])
    c = np.stack(centres)
    for _ in range(KMEANS_ROUNDS):
        member = (np.argmax(x @ c.T, axis=1)[:, None] == np.arange(k)).astype(np.float32)
        sums = member.T @ x
        filled = member.sum(axis=0) > 0
        c[filled] = _unit(sums[filled])
    return c.astype(np.float32)


def _unit(x: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    return (x / np.where(n == 0, 1, n)).astype(np.float32)


def centroid_scores(table: np.ndarray, query: np.ndarray) -> np.ndarray:
    """Per page row of `table` (pages, k, dim): sum over the query's tokens of the best centroid's
    dot product (MaxSim against the centroids)."""
    return centroid_scores_many(table, [query])[0]


def centroid_scores_many(
    table: np.ndarray,
    queries: Sequence[np.ndarray],
    threads: int | None = None,
    rows: np.ndarray | None = None,
) -> np.ndarray:
    """(queries, pages) float32: `centroid_scores` of each query, in one pass over the table (one
    product per chunk for all the queries' tokens: the table is read once however many queries
    come). `rows`: score only these rows of the table (a filtered search: the pages a filter
    allows), in their order; each chunk is gathered as it is scanned, so the work and the memory
    follow the rows asked for, not the table."""
    qs = [np.asarray(q, dtype=np.float32) for q in queries]
    flat = (
        np.ascontiguousarray(np.concatenate(qs).T)
        if qs
        else np.zeros((table.shape[-1], 0), np.float32)
    )
    starts = np.cumsum([0] + [len(q) for q in qs])[:-1]
    pages = len(table) if rows is None else len(rows)
    out = np.empty((len(qs), pages), dtype=np.float32)
    if not qs or not pages:
        return out
    threads = threads or SCAN_THREADS
    threads = max(1, min(threads, pages // SCAN_MIN_PAGES_PER_THREAD))
    chunks = [(lo, min(lo + SCAN_CHUNK_PAGES, pages)) for lo in range(0, pages, SCAN_CHUNK_PAGES)]

    def scan(part: Sequence[tuple[int, int]]) -> None:
        with one_thread():
            for lo, hi in part:
                block = np.asarray(
                    table[lo:hi] if rows is None else table[rows[lo:hi]], dtype=np.float32
                )
                sims = block.reshape(-1, block.shape[-1]) @ flat  # (pages * k, all query tokens)
                best = sims.reshape(hi - lo, block.shape[1], -1).max(axis=1)
                out[:, lo:hi] = np.add.reduceat(best, starts, axis=1).T

    if threads == 1:
        scan(chunks)
    else:  # contiguous shares: each thread streams its own part of the table
        shares = np.array_split(np.arange(len(chunks)), threads)
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda share: scan([chunks[i] for i in share]), shares))
    return out


def _read_ahead(path: Path) -> None:
    """Ask the kernel to read the table into the page cache, in a daemon thread, so that the first
    query after an open (usually preceded by embedding it: model load, tokenising) does not fault
    the whole table in from disk (820 MB at 100,000 pages; Edge's close drops its own files from
    the cache, not this one, but another process or a reboot may have). Advisory: no effect where
    `posix_fadvise` is missing, and any error is ignored."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return

    def run() -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        try:
            advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)

    threading.Thread(target=run, name="colembed-token-table-readahead", daemon=True).start()


def _uuid_strings(raw: np.ndarray) -> list[str]:
    """The canonical strings (str(uuid.UUID)) of rows of 16 uuid bytes: one hex conversion and
    slices (5x faster than a UUID object a row: 0.25 -> 0.05 s at 100,000 pages, on every open)."""
    h = np.ascontiguousarray(raw).tobytes().hex()
    return [
        f"{h[i : i + 8]}-{h[i + 8 : i + 12]}-{h[i + 12 : i + 16]}-{h[i + 16 : i + 20]}-{h[i + 20 : i + 32]}"
        for i in range(0, len(h), 32)
    ]


class TokenTable:
    """The centroids of every page of one store, in `folder` (append-only; the newest row of an id
    wins; deleting appends a tombstone). `rows()` maps the files again after writes."""

    def __init__(self, folder: Path, dim: int, k: int = CENTROIDS) -> None:
        self.folder, self.dim, self.k = Path(folder), dim, k
        TokenTable.recover(self.folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._table: np.ndarray | None = None
        self._dirty = True
        self._warmed = False

    @property
    def _row_bytes(self) -> int:
        return self.k * self.dim * 4

    def files(self) -> list[str]:
        """The names of the table's two files (what a verified mark records the sizes of)."""
        return [TABLE_FILE, IDS_FILE]

    def append(self, ids: Sequence[str], centroids: Sequence[np.ndarray]) -> None:
        if not ids:
            return
        data = np.ascontiguousarray(np.stack(centroids), dtype=np.float32)
        if data.shape[1:] != (self.k, self.dim):
            raise ValueError(
                f"centroids of shape {data.shape[1:]}, table holds {(self.k, self.dim)}"
            )
        self._write(ids, data, live=True)

    def delete(self, ids: Sequence[str]) -> None:
        if ids:
            self._write(ids, np.zeros((len(ids), self.k, self.dim), np.float32), live=False)

    def _write(self, ids: Sequence[str], data: np.ndarray, live: bool) -> None:
        # the table first, then the ids: a crash leaves table rows without an id (ignored)
        with open(self.folder / TABLE_FILE, "ab") as f:
            f.write(data.tobytes())
            f.flush()
            os.fsync(f.fileno())
        flag = b"\x01" if live else b"\x00"
        with open(self.folder / IDS_FILE, "ab") as f:
            f.write(b"".join(uuid.UUID(i).bytes + flag for i in ids))
            f.flush()
            os.fsync(f.fileno())
        self._dirty = True

    def _load(self) -> None:
        ids_path, table_path = self.folder / IDS_FILE, self.folder / TABLE_FILE
        raw = ids_path.read_bytes() if ids_path.is_file() else b""
        n_table = (table_path.stat().st_size // self._row_bytes) if table_path.is_file() else 0
        n = min(len(raw) // _ID_BYTES, n_table)
        records = np.frombuffer(raw[: n * _ID_BYTES], dtype=np.uint8).reshape(n, _ID_BYTES)
        keys = np.ascontiguousarray(records[:, :16]).view("V16").ravel()
        # the newest row of each id decides: live rows kept only where they are the newest
        order = np.arange(n)[::-1]
        _, first = np.unique(keys[order], return_index=True)
        newest = order[first]
        newest = newest[records[newest, 16] == 1]
        newest.sort()
        self._rows = newest
        self._ids = _uuid_strings(records[newest, :16])
        self._positions: dict[str, int] | None = None  # id -> index in _ids, made when filtered
        # the last filter's pages (a frozenset: the store hands the same one for a filter used
        # again) and their indexes in _ids, so a repeated filter's positions are worked out once
        self._last_allowed: tuple[frozenset[str], np.ndarray] | None = None
        self._table = (
            np.memmap(table_path, dtype=np.float32, mode="r", shape=(n_table, self.k, self.dim))
            if n_table
            else np.zeros((0, self.k, self.dim), np.float32)
        )
        if n_table and not self._warmed:  # once an open: later loads follow writes
            self._warmed = True
            _read_ahead(table_path)
        self._dirty = False

    def ids(self) -> list[str]:
        if self._dirty:
            self._load()
        return self._ids

    def dead_fraction(self) -> float:
        """The share of the table's rows that no live page reads (replaced, deleted, torn)."""
        ids = self.ids()
        return 1.0 - len(ids) / len(self._table) if len(self._table) else 0.0

    def compact(self) -> int:
        """Rewrite the table with its live rows only; returns the rows dropped. The live rows go
        to a sibling folder, which then takes the table folder's place by two renames (the old
        folder set aside first): a kill between them leaves the old folder aside, put back by
        `recover` on the next open (a table's two files are never mixed). Derived data: the
        pages are never touched."""
        ids = self.ids()
        dropped = len(self._table) - len(ids)
        if dropped <= 0:
            return 0
        work, aside = self._sibling(COMPACTING), self._sibling(SET_ASIDE)
        shutil.rmtree(work, ignore_errors=True)
        fresh = TokenTable(work, self.dim, self.k)
        for lo in range(0, len(ids), 4096):
            rows = self._rows[lo : lo + 4096]
            fresh.append(ids[lo : lo + 4096], list(np.asarray(self._table[rows])))
        self._table = None  # the old mapping closes before its folder moves
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(self.folder, aside)
        os.replace(work, self.folder)
        shutil.rmtree(aside, ignore_errors=True)
        self._dirty = True
        return dropped

    def _sibling(self, suffix: str) -> Path:
        return self.folder.with_name(self.folder.name + suffix)

    @staticmethod
    def recover(folder: Path) -> None:
        """Undo a compaction killed midway: the old table set aside comes back when the folder
        is missing; a half-written new one is dropped."""
        folder = Path(folder)
        aside = folder.with_name(folder.name + SET_ASIDE)
        if aside.is_dir() and not folder.exists():
            os.replace(aside, folder)
        for leftover in (aside, folder.with_name(folder.name + COMPACTING)):
            shutil.rmtree(leftover, ignore_errors=True)

    def compact_if_due(self) -> int:
        """`compact` when more than `MAX_DEAD_FRACTION` of the rows are dead; the rows dropped."""
        return self.compact() if self.dead_fraction() > MAX_DEAD_FRACTION else 0

    def __len__(self) -> int:
        return len(self.ids())

    def top(self, query: np.ndarray, limit: int) -> list[str]:
        """The ids of the `limit` pages whose centroids best match the query."""
        return self.top_many([query], limit)[0]

    def top_many(
        self, queries: Sequence[np.ndarray], limit: int, allowed: AbstractSet[str] | None = None
    ) -> list[list[str]]:
        """`top` of each query, the table scanned once for all of them. `allowed`: only these
        pages are scanned and ranked (a filtered search), so a filter that keeps few pages still
        gets `limit` candidates among them, and costs less than a full scan."""
        ids = self.ids()
        if allowed is None:
            positions = np.arange(len(ids))
            every = centroid_scores_many(self._table, queries)[:, self._rows] if ids else None
        else:
            if self._last_allowed is not None and self._last_allowed[0] is allowed:  # a frozenset
                positions = self._last_allowed[1]
            else:
                if self._positions is None:
                    self._positions = {pid: n for n, pid in enumerate(ids)}
                positions = np.array(
                    sorted(self._positions[i] for i in allowed if i in self._positions),
                    dtype=np.int64,
                )
                if isinstance(allowed, frozenset):
                    self._last_allowed = (allowed, positions)
            every = (
                centroid_scores_many(self._table, queries, rows=self._rows[positions])
                if len(positions)
                else None
            )
        if every is None:
            return [[] for _ in queries]
        limit = min(limit, len(positions))
        out = []
        for scores in every:
            best = np.argpartition(-scores, limit - 1)[:limit]
            out.append([ids[positions[i]] for i in best[np.argsort(-scores[best])]])
        return out

    def reset(self) -> None:
        for name in self.files():
            (self.folder / name).unlink(missing_ok=True)
        self._dirty = True

    def rebuild(
        self, pages: Iterable[tuple[str, np.ndarray]], progress: Callable[[int], None] | None = None
    ) -> int:
        """Replace the table by the centroids of `pages` ((id, image tokens) pairs)."""
        self.reset()
        done, ids, cents = 0, [], []
        for pid, tokens in pages:
            ids.append(pid)
            cents.append(page_centroids(tokens, self.k))
            if len(ids) == 256:
                self.append(ids, cents)
                done += len(ids)
                ids, cents = [], []
                if progress:
                    progress(done)
        self.append(ids, cents)
        return done + len(ids)
