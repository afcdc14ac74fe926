"""Exact MaxSim scoring of ragged multi-vector queries against ragged pages, in bounded memory.

    score(q, d) = sum over the real tokens of q of  max over the real tokens of d of  q_i . d_j

Inputs are what the runtime (or colpali-engine, or transformers) gives: one (tokens, dim) array per
query and per page, float32 (float16 pages and float64 arrays are accepted; products and sums are
always fp32). Outputs: a (queries, documents) float32 matrix from `score`, and per query the indices
and scores of the best `k` documents from `top_k`, which streams any iterable of pages.

Exactness. The reference `ColQwen2Processor.score_retrieval` (transformers 4.57.1) zero-pads each
batch of 128 pages to its longest page, so a zero row wins a max whenever all of a query token's
real similarities are negative, and a page's score then depends on its neighbours in the list.
colembed never pads: padding cannot win a max and a score depends only on its own query and page,
not on the chunk size, the order, or which other pages are present. `reference_padding=True`
reproduces the reference instead (same 128-page batches, same zero rows), for comparing numbers
with colpali-engine or transformers.

Backends (`backend=`):
- "numpy": no graph needed. One sgemm per page on the caller's own array against all query
  tokens (no copy of the pages; the page's similarities stay in cache for the max), then a
  segmented sum over each query's rows. For few query tokens against short pages, where a call per
  page would cost more than its GEMM, the pages of a chunk are stacked instead and met in one
  sgemm, followed by a segmented max over each page's columns. numpy's BLAS uses every core.
- "onnx": the scorer graph of `maxsim_graph` (`maxsim.onnx` in a model folder, or built in memory
  when the `onnx` package is installed) on onnxruntime's CPU provider, fed padded chunks of pages
  sorted by length, every query token as a one-token query (no padding of ragged queries).
- "auto": the graph when there is one and there are many query tokens (`ONNX_MIN_QUERY_TOKENS`),
  else numpy. Both give bitwise-equal scores on the machines measured.
Memory: pages are processed in chunks whose scratch (stacked or padded copies, the similarity
matrix, onnxruntime's intermediates) stays under `memory_budget_bytes`; a chunk always holds at
least one page, and queries are split into groups when one page against all queries would not fit.
So 100,000 pages never materialise a (Q, N, Lq, Ld) tensor.

NaN/inf: every query is checked up front. Pages are checked without an extra pass over them: on
the numpy path inside the GEMM (a NaN/inf page row makes some query row's maximum NaN or +inf
when every dim has a query value >= 0 and one <= 0; otherwise two extra query rows of +1 and -1
give each page row's sum and its negation, both finite iff the row is: `_needs_sign_rows`), on
the onnx path by a sum of squares taken while the page is
in cache after padding it. A suspect page is confirmed with `np.isfinite` before an error names it
(a finite page whose sums overflow fp32 passes).

Imports numpy, and onnxruntime only when a graph is used; never torch or transformers.
"""

from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from .errors import ModelFolderError, ScoringError

DEFAULT_MEMORY_BUDGET_BYTES = 32 << 20
# transformers' ColQwen2Processor.score_retrieval(batch_size=128): its zero-padding unit.
REFERENCE_BATCH_SIZE = 128
BACKENDS = ("auto", "numpy", "onnx")
# Pages read (and validated) from an iterable at a time; the onnx path sorts each block by length.
BLOCK_DOCUMENTS = 512
# A list or tuple of pages is already in memory, so it is taken in blocks of up to this many
# pages: each block ends on a barrier, and on a busy machine fewer barriers are faster.
BLOCK_DOCUMENTS_IN_MEMORY = 1 << 16
# numpy kernel choice: one GEMM per page on the caller's array (no copy, similarities in cache)
# wins for real page lengths; stacking a chunk's pages wins only for few query tokens against
# short pages, where a call per page costs more than its GEMM.
STACKED_MAX_QUERY_TOKENS = 128
STACKED_MAX_PAGE_TOKENS = 384  # mean over the block
# backend="auto" uses the graph (when there is one) from this many query tokens: the measured
# crossover, below which numpy's no-copy path wins (docs/scoring.md, "The kernels").
ONNX_MIN_QUERY_TOKENS = 640
# Pages are dealt to `_page_workers()` threads, each calling a single-threaded BLAS, instead of
# one multi-threaded BLAS call per page, whose per-page thread hand-off waits for descheduled
# threads on a busy machine (docs/scoring.md). Every query count takes this path (only tests
# lower the limit); it needs OpenBLAS's `openblas_set_num_threads_local` (>= 0.3.27), and
# without it the one-call-per-page path runs.
PARALLEL_MAX_QUERY_ROWS = 1 << 30
# Pages a worker takes at a time: small enough that a block's last run costs little waiting,
# large enough that taking one costs nothing beside its GEMMs.
PARALLEL_CHUNK_PAGES = 8
# The per-page kernels pad the query columns (`_query_columns`) to a multiple of this: OpenBLAS's
# sgemm runs the query dimension in strips of 8 (or 16 with 8-wide tails), and a partial strip
# costs about a whole one (docs/scoring.md, "The query columns").
QUERY_COLUMN_MULTIPLE = 8
# `_column_max` views this many similarity rows as one row (see there).
MAX_GROUP_ROWS = 8
_F32 = np.dtype(np.float32)
_ACCEPTED_DTYPES = (np.dtype(np.float16), _F32, np.dtype(np.float64))


# ----------------------------------------------------------------------------------- inputs
def _as_matrix(x: Any, what: str, index: int, dim: int | None) -> np.ndarray:
    """One query or page as a 2-D float array (not copied), or a ScoringError naming it."""
    try:
        a = np.asarray(x)
    except Exception as e:  # e.g. a bfloat16 torch tensor numpy cannot represent
        raise ScoringError(f"{what} {index}: cannot be read as a numpy array ({e})") from e
    if a.dtype not in _ACCEPTED_DTYPES:
        kind = "is not floating point" if a.dtype.kind != "f" else "is not supported"
        raise ScoringError(
            f"{what} {index}: dtype {a.dtype} {kind}; expected float32 "
            "(float16 and float64 are accepted and scored in fp32)"
        )
    if a.ndim != 2:
        raise ScoringError(
            f"{what} {index}: expected a 2-D (tokens, dim) array, got shape {a.shape}"
        )
    if a.shape[0] == 0:
        raise ScoringError(f"{what} {index}: has no tokens")
    if dim is not None and a.shape[1] != dim:
        raise ScoringError(
            f"{what} {index}: has dim {a.shape[1]}, expected {dim} (the dim of query 0)"
        )
    return a


def _as_list(items: Any, what: str) -> Iterable[Any]:
    """A single 2-D array means one item; a 3-D array is a batch of equal-length items."""
    if isinstance(items, (str, bytes)):
        raise ScoringError(
            f"expected {what}s as a list of (tokens, dim) arrays, got {type(items).__name__}"
        )
    if isinstance(items, np.ndarray):
        if items.ndim == 2:
            return [items]
        if items.ndim == 3:
            return list(items)
        raise ScoringError(
            f"expected {what}s as a list of (tokens, dim) arrays or one 2-D array, "
            f"got an array of shape {items.shape}"
        )
    if hasattr(items, "__iter__"):
        return items
    raise ScoringError(
        f"expected {what}s as a list of (tokens, dim) arrays, got {type(items).__name__}"
    )


@dataclass(frozen=True)
class _Queries:
    vectors: np.ndarray  # (rows, dim) float32, every query's tokens stacked
    starts: np.ndarray  # (Q,) first row of each query
    lengths: np.ndarray  # (Q,)

    @property
    def count(self) -> int:
        return len(self.lengths)

    @property
    def dim(self) -> int:
        return self.vectors.shape[1]

    def groups(self, max_rows: int) -> list[tuple[int, int]]:
        """Consecutive query ranges [a, b) of at most `max_rows` rows (at least one query each)."""
        out, a = [], 0
        ends = np.cumsum(self.lengths)
        while a < self.count:
            base = ends[a - 1] if a else 0
            b = max(a + 1, int(np.searchsorted(ends, base + max_rows, side="right")))
            out.append((a, b))
            a = b
        return out


def _prepare_queries(queries: Any) -> _Queries:
    items = list(_as_list(queries, "query"))
    if not items:
        raise ScoringError("no queries were given")
    mats: list[np.ndarray] = []
    for i, q in enumerate(items):
        a = _as_matrix(q, "query", i, mats[0].shape[1] if mats else None)
        if not np.isfinite(a).all():
            raise ScoringError(f"query {i}: contains NaN or inf")
        mats.append(a)
    lengths = np.array([len(a) for a in mats], dtype=np.int64)
    vectors = (
        np.concatenate(mats, axis=0, dtype=np.float32)
        if len(mats) > 1
        else np.ascontiguousarray(mats[0], dtype=np.float32)
    )
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return _Queries(vectors, starts, lengths)


def _iter_blocks(documents: Any, dim: int, block: int) -> Iterator[tuple[int, list[np.ndarray]]]:
    """(index of the first page, validated pages) for consecutive blocks, read lazily."""
    iterator = iter(_as_list(documents, "document"))
    start = 0
    while True:
        raw = list(itertools.islice(iterator, block))
        if not raw:
            if start == 0:
                raise ScoringError("no documents were given")
            return
        yield start, [_as_matrix(d, "document", start + i, dim) for i, d in enumerate(raw)]
        start += len(raw)


def _reference_floor(lengths: np.ndarray, batch: int) -> np.ndarray:
    """Which pages the reference zero-pads: shorter than the longest page of their batch of `batch`
    consecutive pages. `lengths` starts at a multiple of `batch` in the whole list."""
    floor = np.zeros(len(lengths), dtype=bool)
    for a in range(0, len(lengths), batch):
        seg = lengths[a : a + batch]
        floor[a : a + batch] = seg < seg.max()
    return floor


def _check_rows_finite(signs: np.ndarray, docs: list[np.ndarray], start: int) -> None:
    """`signs` holds, per page, maxima of products with its rows that are all finite iff every
    row of the page is finite (the +1/-1 sign rows' max and -min of each row's sum, or the
    per-page kernels' column maxima: `_query_columns`), except for a product that overflows fp32;
    the exact check then decides."""
    bad = np.flatnonzero(~np.isfinite(signs).all(axis=-1))
    for j in bad:
        if not np.isfinite(docs[j]).all():
            raise ScoringError(f"document {start + int(j)}: contains NaN or inf")


def _check_pages_finite(
    sums: np.ndarray, docs: list[np.ndarray], idx: np.ndarray, first: int
) -> None:
    """`sums[i]` is a sum over page `idx[i]`: finite unless the page holds NaN/inf (or the sum
    overflows fp32, which the exact check then clears)."""
    for i in np.flatnonzero(~np.isfinite(sums)):
        if not np.isfinite(docs[idx[i]]).all():
            raise ScoringError(f"document {first + int(idx[i])}: contains NaN or inf")


# ----------------------------------------------------------------------------- numpy kernels
def _page_maxima(
    qt: np.ndarray, docs: list[np.ndarray], best: np.ndarray, scratch: np.ndarray
) -> None:
    """`best[j]` = max over the rows of page `j` of its similarities to every column of `qt`
    (dim, cols): one sgemm per page on the caller's array (no copy of the page), its (tokens,
    cols) similarities kept in `scratch` (in cache) for the max. `scratch` holds at least
    `_group_padded(longest page) * cols` floats.

    The max is `_column_max`'s grouping without its leftover rows: a page's similarities are
    followed by -inf rows up to a multiple of MAX_GROUP_ROWS, so every page takes one grouped max
    (MAX_GROUP_ROWS rows viewed as one long row) into `partial`, and one call finishes the
    partial maxima of all the pages. Each numpy call holds the GIL while it starts, and the
    worker threads run this loop side by side: on a busy machine a worker descheduled while it
    holds the GIL stops the others at their next call (plausible, not measured apart), so the
    calls per page are kept few (3, was 6-7 with the leftover rows). Max is exact and -inf never wins, so the result is bit for
    bit `sims.max(0)` (NaN propagates)."""
    cols, group = qt.shape[1], MAX_GROUP_ROWS
    partial = np.empty((len(docs), group * cols), dtype=np.float32)
    for j, d in enumerate(docs):
        tokens = len(d)
        padded = _group_padded(tokens)
        sims = scratch[: padded * cols].reshape(padded, cols)
        np.matmul(d, qt, out=sims[:tokens], dtype=np.float32)
        if padded > tokens:
            sims[tokens:] = -np.inf
        np.max(sims.reshape(padded // group, group * cols), axis=0, out=partial[j])
    np.max(partial.reshape(len(docs), group, cols), axis=1, out=best)


def _group_padded(tokens: int) -> int:
    """`tokens` rounded up to a multiple of MAX_GROUP_ROWS (`_page_maxima`'s scratch rows)."""
    return -(-tokens // MAX_GROUP_ROWS) * MAX_GROUP_ROWS


def _column_max(sims: np.ndarray, out: np.ndarray) -> None:
    """`out` = the max over the rows of C-contiguous `sims` (tokens, cols), bitwise `sims.max(0)`.

    numpy's axis-0 reduction runs one short inner loop per row (`cols` elements: ~28 for one
    query), so its per-row overhead costs as much as a sixth of the page's GEMM. Viewing
    `MAX_GROUP_ROWS` rows as one long row makes the inner loop that many times longer; the max of
    the group's `MAX_GROUP_ROWS` partial results, and of the leftover rows, finishes it (max is
    exact, so the grouping changes no bit). Measured: benchmarks/results/scoring/scoring-grid.md."""
    tokens, cols = sims.shape
    whole = tokens - tokens % MAX_GROUP_ROWS
    if whole == 0:
        np.max(sims, axis=0, out=out)
        return
    grouped = sims.reshape(-1)[: whole * cols].reshape(
        whole // MAX_GROUP_ROWS, MAX_GROUP_ROWS * cols
    )
    np.max(np.max(grouped, axis=0).reshape(MAX_GROUP_ROWS, cols), axis=0, out=out)
    if whole < tokens:
        np.maximum(out, np.max(sims[whole:], axis=0), out=out)


def _finish_per_page(
    best: np.ndarray,
    rows: int,
    starts: np.ndarray,
    docs: list[np.ndarray],
    floor: np.ndarray | None,
    first: int,
) -> np.ndarray:
    """(Q, pages) scores from the per-page maxima `best` (pages, real columns of
    `_query_columns`): the pages checked for NaN/inf (every real column's maximum is finite on a
    finite page, and on a page with a NaN/inf row at least one is not: see `_query_columns`),
    the reference's zero rows, the sum over each query's rows."""
    _check_rows_finite(best, docs, first)
    maxima = best[:, :rows]
    if floor is not None and floor.any():
        np.maximum(maxima, 0.0, out=maxima, where=floor[:, None])
    return np.add.reduceat(maxima, starts, axis=1).T


def _numpy_per_page(
    q: np.ndarray, starts: np.ndarray, docs: list[np.ndarray], floor: np.ndarray | None, first: int
) -> np.ndarray:
    """One GEMM per page against all query rows (BLAS on every core within each call); no copy
    of the pages. Returns (Q, pages)."""
    rows = q.shape[0]
    qt, real = _query_columns(q)
    best = np.empty((len(docs), qt.shape[1]), dtype=np.float32)
    scratch = np.empty(_group_padded(max(len(d) for d in docs)) * qt.shape[1], dtype=np.float32)
    _page_maxima(qt, docs, best, scratch)
    return _finish_per_page(best[:, :real], rows, starts, docs, floor, first)


def _numpy_per_page_parallel(
    q: np.ndarray, starts: np.ndarray, docs: list[np.ndarray], floor: np.ndarray | None, first: int
) -> np.ndarray:
    """`_numpy_per_page` with the pages dealt out to one worker thread per core, each calling a
    single-threaded BLAS (PARALLEL_MAX_QUERY_ROWS): the same per-page products, so the same scores.

    The pages are dealt in runs of `PARALLEL_CHUNK_PAGES` that each worker takes from a shared
    counter when it is free, not in one fixed share per worker: on a shared machine a worker that
    the OS deschedules for a while then simply takes fewer runs, while with fixed shares the others
    finished theirs and waited (every block of pages ended on the slowest worker)."""
    workers = _page_workers()
    if workers is None or len(docs) < 2 * workers[0]:
        return _numpy_per_page(q, starts, docs, floor, first)
    count, pool, limit = workers
    rows = q.shape[0]
    qt, real = _query_columns(q)  # read by every worker
    cols = qt.shape[1]
    best = np.empty((len(docs), cols), dtype=np.float32)
    run = max(1, min(PARALLEL_CHUNK_PAGES, len(docs) // (4 * count)))
    runs = itertools.count()  # next() is atomic under the GIL: each run is taken once
    longest = _group_padded(max(len(d) for d in docs))

    def work() -> None:
        previous = limit(1)
        # numpy's error state is per thread: the caller's (`_iter_scores`) does not reach here
        try:
            scratch = np.empty(longest * cols, dtype=np.float32)
            with np.errstate(over="ignore", invalid="ignore"):
                while (a := next(runs) * run) < len(docs):
                    _page_maxima(qt, docs[a : a + run], best[a : a + run], scratch)
        finally:
            limit(previous)

    futures = [pool.submit(work) for _ in range(count)]
    for f in futures:
        f.result()
    return _finish_per_page(best[:, :real], rows, starts, docs, floor, first)


_WORKERS: Any = False  # not looked up yet


def _page_workers() -> tuple[int, ThreadPoolExecutor, Any] | None:
    """(threads, a persistent pool of them, OpenBLAS's per-thread `set_num_threads_local`), or None
    when this numpy's BLAS cannot limit one thread's calls or there is one core. Looked up once."""
    global _WORKERS
    if _WORKERS is False:
        _WORKERS = None
        from .sessions import physical_cores

        from .blas import local_thread_limit

        limit = local_thread_limit()
        cores = physical_cores()
        if limit is not None and cores > 1:
            _WORKERS = (
                cores,
                ThreadPoolExecutor(cores, thread_name_prefix="colembed-maxsim"),
                limit,
            )
    return _WORKERS


def _numpy_stacked(
    qx: np.ndarray,
    starts: np.ndarray,
    docs: list[np.ndarray],
    floor: np.ndarray | None,
    first: int,
    buffers: dict[str, np.ndarray],
) -> np.ndarray:
    """All pages of a chunk stacked: one sgemm (rows+2, dim) x (dim, tokens), a max over each
    page's column range, a sum over each query's row range. `qx` is the query rows followed by a
    row of +1 and a row of -1 (`_with_sign_rows`). Returns (Q, pages)."""
    rows, dim = qx.shape[0] - 2, qx.shape[1]
    lengths = [len(d) for d in docs]
    tokens = sum(lengths)
    stacked = _scratch(buffers, "stacked", tokens * dim).reshape(tokens, dim)
    np.concatenate(docs, axis=0, out=stacked, casting="same_kind")
    sims = _scratch(buffers, "sims", (rows + 2) * tokens).reshape(rows + 2, tokens)
    np.matmul(qx, stacked.T, out=sims)
    page_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    best = np.maximum.reduceat(sims, page_starts, axis=1)  # (rows+2, pages)
    _check_rows_finite(best[rows:].T, docs, first)
    maxima = best[:rows]
    if floor is not None and floor.any():
        np.maximum(maxima, 0.0, out=maxima, where=floor[None, :])
    return np.add.reduceat(maxima, starts, axis=0)


def _query_columns(q: np.ndarray) -> tuple[np.ndarray, int]:
    """((dim, cols) C-contiguous, real columns): the query rows as columns, the two sign rows
    (`_with_sign_rows`) after them only when `_needs_sign_rows(q)`, then zero columns up to a
    multiple of QUERY_COLUMN_MULTIPLE (see there). A zero column's similarities are 0 (NaN on a
    non-finite page row); they are never read. On a page row holding NaN/inf at least one real
    column's product is NaN or +inf, so its maximum over the page is not finite."""
    rows, dim = q.shape
    real = rows + 2 if _needs_sign_rows(q) else rows
    cols = -(-real // QUERY_COLUMN_MULTIPLE) * QUERY_COLUMN_MULTIPLE
    qt = np.zeros((dim, cols), dtype=np.float32)
    qt[:, :real] = (_with_sign_rows(q) if real > rows else q).T
    return qt, real


def _needs_sign_rows(q: np.ndarray) -> bool:
    """Whether the query rows alone may miss a NaN/inf page row, so the +1/-1 sign rows must join.

    A product q . d over a page row d holding NaN is NaN. One holding +-inf at dims S (and no
    NaN) is -inf only if, at every dim k in S, q_k is nonzero with the sign opposite to d_k
    (a zero q_k gives 0 * inf = NaN, a same-sign one +inf, and +inf beside -inf is NaN). So if at
    every dim some query row is >= 0 and some is <= 0, some row's product with any NaN/inf page
    row is NaN or +inf, and that row's maximum over the page shows it: the sign rows (two more
    columns in every page's GEMM) are needed only when some dim has one strict sign across all
    the rows (a one-token query, almost never a real multi-token one)."""
    return not (bool((q.min(axis=0) <= 0).all()) and bool((q.max(axis=0) >= 0).all()))


def _with_sign_rows(q: np.ndarray) -> np.ndarray:
    """(rows+2, dim): the query rows, then +1 and -1 rows whose products are each page row's sum
    and its negation (max of both finite <=> every page row finite)."""
    qx = np.empty((q.shape[0] + 2, q.shape[1]), dtype=np.float32)
    qx[:-2] = q
    qx[-2] = 1.0
    qx[-1] = -1.0
    return qx


def _scratch(buffers: dict[str, np.ndarray], name: str, size: int) -> np.ndarray:
    """A reusable flat float32 buffer of at least `size` (fresh pages per chunk cost page faults)."""
    buf = buffers.get(name)
    if buf is None or buf.size < size:
        buf = np.empty(size, dtype=np.float32)
        buffers[name] = buf
    return buf[:size]


# ------------------------------------------------------------------------------------ scorer
class MaxSimScorer:
    """Exact MaxSim scores over ragged lists, with an optional onnxruntime scorer graph.

    `graph`: a path to `maxsim.onnx` (or a folder holding one), the serialised graph as bytes, or
    None for numpy only. `session`: an existing onnxruntime session over such a graph instead.
    `threads`: onnxruntime intra-op threads (default: physical cores). Use
    `MaxSimScorer.with_built_graph()` to build the graph in memory (needs the `onnx` package).
    A graph built with `doc_dtype="float16"` is accepted too; pages are then padded into float16
    (float32 pages rounded), while the numpy backend always scores pages as given, in fp32.
    """

    def __init__(
        self,
        graph: str | os.PathLike[str] | bytes | None = None,
        *,
        session: Any = None,
        threads: int | None = None,
    ) -> None:
        self._session = None
        self._doc_dtype = _F32
        self.graph_path: Path | None = None
        if graph is not None and session is not None:
            raise ValueError("give either graph or session, not both")
        if graph is not None:
            session = self._open(graph, threads)
        if session is not None:
            self._attach(session)

    @classmethod
    def with_built_graph(cls, *, threads: int | None = None) -> "MaxSimScorer":
        """A scorer whose graph is built in memory by `maxsim_graph` (needs `pip install onnx`)."""
        from .maxsim_graph import maxsim_model_bytes

        return cls(maxsim_model_bytes(), threads=threads)

    def _open(self, graph: str | os.PathLike[str] | bytes, threads: int | None) -> Any:
        from .layout import MAXSIM_FILE
        from .sessions import Session

        if not isinstance(graph, (bytes, bytearray)):
            path = Path(graph)
            if path.is_dir():
                path = path / MAXSIM_FILE
            if not path.is_file():
                raise ModelFolderError("no MaxSim scorer graph here", path=path)
            self.graph_path = path
            graph = str(path)
        return Session(graph, threads=threads).session

    def _attach(self, session: Any) -> None:
        from .maxsim_graph import MAXSIM_CONTRACT, MAXSIM_FP16_CONTRACT

        self._contract = MAXSIM_CONTRACT
        problems = MAXSIM_CONTRACT.mismatches(session)
        if problems and not MAXSIM_FP16_CONTRACT.mismatches(session):
            self._doc_dtype, problems = np.dtype(np.float16), []
            self._contract = MAXSIM_FP16_CONTRACT
        if problems:
            raise ModelFolderError(
                "graph does not match the MaxSim scorer contract: " + "; ".join(problems),
                path=self.graph_path,
            )
        self._session = session

    @property
    def has_graph(self) -> bool:
        return self._session is not None

    def __repr__(self) -> str:
        graph = (
            (f"graph='{self.graph_path}'" if self.graph_path else "graph=<in memory>")
            if self._session is not None
            else "graph=None"
        )
        return f"MaxSimScorer({graph})"

    # ----------------------------------------------------------------------------- public API
    def score(
        self,
        queries: Any,
        documents: Any,
        *,
        reference_padding: bool = False,
        reference_batch_size: int = REFERENCE_BATCH_SIZE,
        memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
        backend: str = "auto",
    ) -> np.ndarray:
        """(queries, documents) float32 MaxSim scores.

        `queries`: a list of (tokens, dim) arrays, or one 2-D array for a single query.
        `documents`: a list (or any iterable) of (tokens, dim) arrays, same dim.
        `reference_padding=True` reproduces transformers' / colpali-engine's `score_retrieval`,
        zero rows included (pages shorter than the longest page of their batch of
        `reference_batch_size` consecutive pages get max(., 0) per query token); only for comparing
        numbers with them. `backend`: "auto", "numpy" or "onnx".
        """
        q = _prepare_queries(queries)
        columns = [
            s
            for _, s in self._iter_scores(
                q, documents, reference_padding, reference_batch_size, memory_budget_bytes, backend
            )
        ]
        return columns[0] if len(columns) == 1 else np.concatenate(columns, axis=1)

    def top_k(
        self,
        queries: Any,
        documents: Any,
        k: int,
        *,
        reference_padding: bool = False,
        reference_batch_size: int = REFERENCE_BATCH_SIZE,
        memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
        backend: str = "auto",
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per query, the `k` best documents: (indices (Q, k) int64, scores (Q, k) float32), best
        first; ties go to the lower index. With fewer than k documents, all of them (Q, N).

        `documents` may be any iterable (a generator reading pages from disk): it is consumed once,
        in blocks, and only a running top-k per query is kept.
        """
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ScoringError(f"k must be a positive int, got {k!r}")
        q = _prepare_queries(queries)
        best: np.ndarray | None = None
        for first, block in self._iter_scores(
            q, documents, reference_padding, reference_batch_size, memory_budget_bytes, backend
        ):
            keys = _rank_keys(block, first)
            best = keys if best is None else np.concatenate([best, keys], axis=1)
            if best.shape[1] > k:
                cut = best.shape[1] - int(k)
                best = np.take_along_axis(best, np.argpartition(best, cut, axis=1)[:, cut:], axis=1)
        assert best is not None  # _iter_blocks raises on no documents
        best = np.sort(best, axis=1)[:, ::-1]
        return _decode_keys(best)

    # ------------------------------------------------------------------------------- plumbing
    def _iter_scores(
        self,
        q: _Queries,
        documents: Any,
        reference_padding: bool,
        reference_batch_size: int,
        budget: int,
        backend: str,
    ) -> Iterator[tuple[int, np.ndarray]]:
        """(index of the first page, (Q, pages) scores) per block of pages, in input order."""
        if backend not in BACKENDS:
            raise ScoringError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "onnx" and self._session is None:
            raise ScoringError(
                "backend='onnx' needs a scorer graph: MaxSimScorer(path to "
                "maxsim.onnx) or MaxSimScorer.with_built_graph()"
            )
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 1:
            raise ScoringError(f"memory_budget_bytes must be a positive int, got {budget!r}")
        if reference_padding and (
            isinstance(reference_batch_size, bool)
            or not isinstance(reference_batch_size, (int, np.integer))
            or reference_batch_size < 1
        ):
            raise ScoringError(
                f"reference_batch_size must be a positive int, got {reference_batch_size!r}"
            )
        use_onnx = self._choose_backend(backend, q) == "onnx"
        block = BLOCK_DOCUMENTS
        if isinstance(documents, (list, tuple)):
            block = max(block, min(len(documents), BLOCK_DOCUMENTS_IN_MEMORY))
        # A block is a whole number of reference batches, so the zero rows are the reference's.
        if reference_padding:
            block = reference_batch_size * max(1, -(-block // reference_batch_size))
        buffers: dict[str, np.ndarray] = {}
        for first, docs in _iter_blocks(documents, q.dim, block):
            lengths = np.array([len(d) for d in docs], dtype=np.int64)
            floor = _reference_floor(lengths, reference_batch_size) if reference_padding else None
            pages = _Block(docs, lengths, floor, first, budget, buffers)
            # NaN/inf in a page is detected and named by the kernels; an fp32 overflow of a row
            # sum only triggers the exact check. numpy's warnings would be noise.
            with np.errstate(over="ignore", invalid="ignore"):
                if use_onnx:
                    out = self._onnx_block(q, pages)
                else:
                    out = _numpy_block(q, pages)
            yield first, out

    def backend_for(self, queries: Any, backend: str = "auto") -> str:
        """Which backend `score`/`top_k` would use for these queries ("numpy" or "onnx")."""
        if backend not in BACKENDS:
            raise ScoringError(f"backend must be one of {BACKENDS}, got {backend!r}")
        return self._choose_backend(backend, _prepare_queries(queries))

    def _choose_backend(self, backend: str, q: _Queries) -> str:
        if backend != "auto":
            return backend
        if self._session is not None and len(q.vectors) >= ONNX_MIN_QUERY_TOKENS:
            return "onnx"
        return "numpy"

    def _onnx_block(self, q: _Queries, pages: _Block) -> np.ndarray:
        """Pages sorted by length (little padding), padded in chunks under the budget, one graph
        run per chunk and query group. The reference's zero rows become one extra real zero row
        per floored page."""
        docs, lengths, floor = pages.docs, pages.lengths, pages.floor
        first, budget = pages.first, pages.budget
        out = np.empty((q.count, len(docs)), dtype=np.float32)
        dim, itemsize = q.dim, self._doc_dtype.itemsize
        need = lengths + floor if floor is not None else lengths  # rows fed per page
        order = np.argsort(need, kind="stable")
        # Bytes per padded page row: our two padded copies (double-buffered) and the mask, the
        # graph's augmented fp32 copy (dim+1 wide) with room for one more, and (below) one
        # similarity per query row.
        page_row = 2 * dim * itemsize + 8 + 8 * (dim + 1)
        for a, b in q.groups(_max_group_rows(budget, int(need.max()), page_row)):
            # Every query token is fed as a one-token query and the host sums each query's
            # rows: MaxSim is a sum over query tokens, and padding ragged queries to the longest
            # would waste (longest / mean) of the GEMM (30% for 18-34-token queries).
            start = int(q.starts[a])
            rows = q.vectors[start : start + int(q.lengths[a:b].sum())]
            rel = q.starts[a:b] - start
            token_queries = rows[:, None, :]
            token_mask = np.ones((len(rows), 1), dtype=np.int64)
            per_row = page_row + 4 * len(rows)
            chunks = [order[c] for c in _chunks_by_rows(need[order], budget, per_row, padded=True)]

            # Pad chunk k+1 on a helper thread while onnxruntime scores chunk k (both release
            # the GIL); the copy is memory-bound, the graph mostly GEMM. Two buffers alternate.
            def pad_chunk(k: int):
                return _pad_chunk(
                    docs,
                    chunks[k],
                    lengths,
                    need,
                    dim,
                    self._doc_dtype,
                    pages.buffers,
                    f"pad{k % 2}",
                )

            with ThreadPoolExecutor(max_workers=1) as helper:
                pending = helper.submit(pad_chunk, 0)
                for k, idx in enumerate(chunks):
                    pad, mask, sums = pending.result()
                    if k + 1 < len(chunks):
                        pending = helper.submit(pad_chunk, k + 1)
                    _check_pages_finite(sums, docs, idx, first)
                    maxima = self._session.run(
                        None, self._contract.feeds(token_queries, token_mask, pad, mask)
                    )[0]  # (rows, pages)
                    out[a:b, idx] = np.add.reduceat(maxima, rel, axis=0)
        return out


def _pad_chunk(
    docs: list[np.ndarray],
    idx: np.ndarray,
    lengths: np.ndarray,
    need: np.ndarray,
    dim: int,
    dtype: np.dtype,
    buffers: dict[str, np.ndarray],
    name: str,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pages `idx` zero-padded to (pages, width, dim) in the reusable buffer `name`, their mask
    (1 for `need[j]` rows: the real rows, plus the reference's zero row when floored) and a
    finiteness probe per page (a sum of squares: NaN/inf, or an overflow, make it non-finite)."""
    width = int(need[idx].max())
    size = len(idx) * width * dim
    flat = buffers.get(name)
    if flat is None or flat.size < size:
        flat = buffers[name] = np.empty(size, dtype)
    pad = flat[:size].reshape(len(idx), width, dim)
    mask = np.zeros((len(idx), width), dtype=np.int64)
    probes = np.empty(len(idx), dtype=np.float32)
    for i, j in enumerate(idx):
        page = pad[i, : lengths[j]]
        page[...] = docs[j]
        pad[i, lengths[j] :] = 0.0
        mask[i, : need[j]] = 1
        values = page.reshape(-1)  # still in cache: the probe costs little
        probes[i] = np.dot(values, values) if dtype == _F32 else values.sum(dtype=np.float32)
    return pad, mask, probes


@dataclass(frozen=True)
class _Block:
    """A block of pages as the kernels score it: the pages, their lengths, the reference's
    floored row counts (or None), the index of the first page, the memory budget in bytes and
    the scratch buffers kept from block to block."""

    docs: list[np.ndarray]
    lengths: np.ndarray
    floor: np.ndarray | None
    first: int
    budget: int
    buffers: dict[str, np.ndarray]


def _numpy_block(q: _Queries, pages: _Block) -> np.ndarray:
    docs, lengths, floor = pages.docs, pages.lengths, pages.floor
    first, budget = pages.first, pages.budget
    out = np.empty((q.count, len(docs)), dtype=np.float32)
    page_row = 4 * q.dim  # the stacked copy of a page row
    workers = _page_workers()
    # on the worker threads every worker holds its own similarity scratch: a share of the budget
    share = budget // workers[0] if workers is not None else budget
    for a, b in q.groups(_max_group_rows(share, int(lengths.max()), page_row)):
        start = int(q.starts[a])
        group = q.vectors[start : start + int(q.lengths[a:b].sum())]
        rel = q.starts[a:b] - start
        if len(group) > STACKED_MAX_QUERY_TOKENS or lengths.mean() > STACKED_MAX_PAGE_TOKENS:
            per_page = (
                _numpy_per_page_parallel
                if len(group) <= PARALLEL_MAX_QUERY_ROWS
                else _numpy_per_page
            )
            out[a:b] = per_page(group, rel, docs, floor, first)
            continue
        qx = _with_sign_rows(group)
        per_row = page_row + 4 * len(qx)
        for chunk in _chunks_by_rows(lengths, budget, per_row, padded=False):
            out[a:b, chunk] = _numpy_stacked(
                qx,
                rel,
                docs[chunk],
                floor[chunk] if floor is not None else None,
                first + chunk.start,
                pages.buffers,
            )
    return out


def _max_group_rows(budget: int, longest_page: int, page_row_bytes: int) -> int:
    """Query rows per group such that the longest page against them fits the budget (each page row
    costs `page_row_bytes` plus 4 bytes per query row)."""
    return max(1, (budget // longest_page - page_row_bytes) // 4)


def _chunks_by_rows(
    lengths: np.ndarray, budget: int, per_row: int, *, padded: bool
) -> Iterator[slice]:
    """Consecutive slices of pages whose scratch (rows x per_row bytes) fits the budget; a padded
    chunk costs (pages x longest page) rows. Always at least one page per chunk."""
    n = len(lengths)
    a = 0
    while a < n:
        b, rows, width = a + 1, int(lengths[a]), int(lengths[a])
        while b < n:
            width_b = max(width, int(lengths[b]))
            rows_b = (b + 1 - a) * width_b if padded else rows + int(lengths[b])
            if rows_b * per_row > budget:
                break
            rows, width, b = rows_b, width_b, b + 1
        yield slice(a, b)
        a = b


# ---------------------------------------------------------------------------------- ranking
# A float32 score and a document index packed into one int64 that sorts like (score desc, index
# asc): every key is distinct, so argpartition's choice never depends on how pages were chunked.
_LOW = np.int64(0xFFFFFFFF)


def _rank_keys(scores: np.ndarray, first: int) -> np.ndarray:
    bits = (scores + np.float32(0.0)).view(np.int32).astype(np.int64)  # -0.0 -> +0.0
    ordered = np.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    index = np.arange(first, first + scores.shape[1], dtype=np.int64)
    return (ordered << 32) | (_LOW - index)


def _decode_keys(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ordered = keys >> 32
    bits = np.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).astype(np.int32)
    index = _LOW - (keys & _LOW)
    return np.ascontiguousarray(index), np.ascontiguousarray(bits.view(np.float32))


# --------------------------------------------------------------------------- free functions
_DEFAULT: MaxSimScorer | None = None


def default_scorer() -> MaxSimScorer:
    """The numpy-only scorer behind `colembed.score` / `colembed.top_k`."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = MaxSimScorer()
    return _DEFAULT


def score(
    queries: Any,
    documents: Any,
    *,
    reference_padding: bool = False,
    reference_batch_size: int = REFERENCE_BATCH_SIZE,
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
    backend: str = "auto",
    scorer: MaxSimScorer | None = None,
) -> np.ndarray:
    """MaxSim scores (queries, documents) float32 over ragged lists of (tokens, dim) arrays.

    Exact: padding never takes part. `reference_padding=True` reproduces transformers'
    `ColQwen2Processor.score_retrieval` / colpali-engine's zero-padded scores instead (only for
    comparing numbers with them). numpy unless `scorer` (a `MaxSimScorer` with a graph) is given.
    """
    return (scorer or default_scorer()).score(
        queries,
        documents,
        reference_padding=reference_padding,
        reference_batch_size=reference_batch_size,
        memory_budget_bytes=memory_budget_bytes,
        backend=backend,
    )


def top_k(
    queries: Any,
    documents: Any,
    k: int,
    *,
    reference_padding: bool = False,
    reference_batch_size: int = REFERENCE_BATCH_SIZE,
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
    backend: str = "auto",
    scorer: MaxSimScorer | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per query the k best documents: (indices (Q, k) int64, scores (Q, k) float32), best first.

    `documents` may be any iterable, consumed once in bounded memory. See `score`.
    """
    return (scorer or default_scorer()).top_k(
        queries,
        documents,
        k,
        reference_padding=reference_padding,
        reference_batch_size=reference_batch_size,
        memory_budget_bytes=memory_budget_bytes,
        backend=backend,
    )


__all__ = [
    "MaxSimScorer",
    "score",
    "top_k",
    "default_scorer",
    "DEFAULT_MEMORY_BUDGET_BYTES",
    "REFERENCE_BATCH_SIZE",
]
