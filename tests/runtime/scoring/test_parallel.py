"""Few queries against long pages are scored on worker threads, each with a single-threaded BLAS,
the pages dealt in runs from a shared counter (scoring.PARALLEL_MAX_QUERY_ROWS,
PARALLEL_CHUNK_PAGES; speed in benchmarks/results/scoring/scoring-grid.md). These tests hold that the path
is taken, that a stalled worker's pages are taken by the others, that it gives the serial path's
scores, and that it still names a bad page by its index in the whole list."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import colembed
from colembed import scoring
from colembed.errors import ScoringError

pytestmark = pytest.mark.skipif(
    scoring._page_workers() is None, reason="numpy's BLAS cannot limit one thread's calls here"
)


def _data(pages=40, queries=1, seed=0):
    rng = np.random.default_rng(seed)
    qs = [
        rng.standard_normal((int(n), 128)).astype(np.float32) for n in rng.integers(18, 35, queries)
    ]
    docs = [
        rng.standard_normal((int(n), 128)).astype(np.float32) for n in rng.integers(700, 801, pages)
    ]
    return qs, docs


def _serial(qs, docs, monkeypatch, **kw):
    with monkeypatch.context() as m:
        m.setattr(scoring, "PARALLEL_MAX_QUERY_ROWS", 0)
        return colembed.score(qs, docs, backend="numpy", **kw)


def _recording(monkeypatch):
    """Patch the per-page kernel to record (thread name, first page, pages) of every run."""
    calls, lock = [], threading.Lock()
    original = scoring._page_maxima

    def page_maxima(qt, docs, best, scratch):
        original(qt, docs, best, scratch)
        with lock:
            calls.append((threading.current_thread().name, len(docs)))

    monkeypatch.setattr(scoring, "_page_maxima", page_maxima)
    return calls


def test_a_search_is_dealt_to_the_worker_threads_in_runs(monkeypatch):
    qs, docs = _data()
    calls = _recording(monkeypatch)
    colembed.score(qs, docs, backend="numpy")
    assert sum(n for _, n in calls) == len(docs)
    assert all(name.startswith("colembed-maxsim") for name, _ in calls)
    # several runs per worker (PARALLEL_CHUNK_PAGES, fewer for a short list), not one share each
    assert len(calls) >= 4 * scoring._page_workers()[0]


def test_a_stalled_worker_does_not_hold_back_the_others(monkeypatch):
    """The first run taken stalls (as a worker descheduled by a busy machine does) until the
    other workers have scored every other page: with runs dealt from a shared counter they do;
    with one fixed share per worker (the old split) the stalled worker's share waits for it."""
    qs, docs = _data(pages=96)
    original = scoring._page_maxima
    lock, state = threading.Lock(), {"stalled": None, "others": 0, "run": 0}
    released = threading.Event()

    def page_maxima(qt, pages, best, scratch):
        with lock:
            stall = state["stalled"] is None
            if stall:
                state["stalled"], state["run"] = threading.current_thread().name, len(pages)
        if stall:
            released.wait(timeout=20)
        original(qt, pages, best, scratch)
        if not stall:
            with lock:
                state["others"] += len(pages)
                if state["others"] + state["run"] == len(docs):
                    released.set()

    monkeypatch.setattr(scoring, "_page_maxima", page_maxima)
    got = colembed.score(qs, docs, backend="numpy")
    assert released.is_set(), (
        f"the other workers scored {state['others']} of "
        f"{len(docs) - state['run']} pages while one worker stalled"
    )
    np.testing.assert_allclose(got, _serial(qs, docs, monkeypatch), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("queries", [1, 4])
def test_the_shares_give_the_serial_scores(queries, monkeypatch):
    qs, docs = _data(queries=queries, seed=queries)
    got = colembed.score(qs, docs, backend="numpy")
    want = _serial(qs, docs, monkeypatch)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    ref = _serial(qs, docs, monkeypatch, reference_padding=True)
    np.testing.assert_allclose(
        colembed.score(qs, docs, backend="numpy", reference_padding=True), ref, rtol=1e-5, atol=1e-4
    )


def test_top_k_on_the_shares_matches_a_full_sort():
    qs, docs = _data(pages=33, queries=2, seed=3)
    full = colembed.score(qs, docs, backend="numpy")
    idx, top = colembed.top_k(qs, iter(docs), 5, backend="numpy")
    for a in range(len(qs)):
        expected = sorted(range(len(docs)), key=lambda j: (-float(full[a, j]), j))[:5]
        assert idx[a].tolist() == expected
        np.testing.assert_array_equal(top[a], full[a, expected])


def test_a_bad_page_in_a_later_share_is_named_by_its_index():
    qs, docs = _data()
    docs[37] = docs[37].copy()
    docs[37][5, 3] = np.nan
    with pytest.raises(ScoringError, match="document 37"):
        colembed.score(qs, docs, backend="numpy")


@pytest.mark.parametrize("tokens", [1, 7, 8, 9, 16, 757, 800])
@pytest.mark.parametrize("cols", [1, 3, 22, 831])
def test_the_grouped_column_max_is_numpy_max_bit_for_bit(tokens, cols):
    rng = np.random.default_rng(tokens * 1000 + cols)
    sims = rng.standard_normal((tokens, cols)).astype(np.float32)
    sims[rng.integers(0, tokens), rng.integers(0, cols)] = np.nan  # NaN still propagates
    out = np.empty(cols, np.float32)
    scoring._column_max(sims, out)
    np.testing.assert_array_equal(out, sims.max(axis=0))


def test_one_token_pages_and_queries_on_the_worker_threads():
    """Edge lengths on the parallel path: 1-token queries, 1- to 9-token pages between long ones
    (shorter than a max group, one group, a group and a row), against a float64 brute force."""
    rng = np.random.default_rng(7)
    qs = [rng.standard_normal((n, 128)).astype(np.float32) for n in (1, 1, 2, 19)]
    lengths = [1, 750, 2, 7, 8, 9, 1, 801, 3, 16, 1] * 4
    docs = [rng.standard_normal((n, 128)).astype(np.float32) for n in lengths]
    want = np.array(
        [
            [(q.astype(np.float64) @ d.T.astype(np.float64)).max(axis=1).sum() for d in docs]
            for q in qs
        ]
    )
    got = colembed.score(qs, docs, backend="numpy")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_an_empty_page_among_many_is_named():
    qs, docs = _data()
    docs[23] = np.zeros((0, 128), np.float32)
    with pytest.raises(ScoringError, match="document 23: has no tokens"):
        colembed.score(qs, docs, backend="numpy")


def test_a_batch_of_32_queries_is_scored_on_the_worker_threads_too(monkeypatch):
    """~830 query rows: one multi-threaded BLAS call per page lost to the worker threads under
    load (PARALLEL_MAX_QUERY_ROWS); the scores stay the serial path's."""
    qs, docs = _data(pages=24, queries=32, seed=5)
    calls = _recording(monkeypatch)
    got = colembed.score(qs, docs, backend="numpy")
    assert sum(len(q) for q in qs) > 256
    assert calls and all(name.startswith("colembed-maxsim") for name, _ in calls)
    assert sum(n for _, n in calls) == len(docs)
    np.testing.assert_allclose(got, _serial(qs, docs, monkeypatch), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 14, 15, 30, 31, 32])
def test_query_columns_padded_to_the_kernel_strip_give_the_brute_force(rows):
    """The query columns (rows, + 2 sign rows when `_needs_sign_rows`) are padded with zero
    columns to a multiple of QUERY_COLUMN_MULTIPLE: lengths just under, at and over a multiple,
    against float64."""
    rng = np.random.default_rng(rows)
    qs = [
        rng.standard_normal((rows, 128)).astype(np.float32),
        rng.standard_normal((1, 128)).astype(np.float32),
    ]
    docs = [rng.standard_normal((int(n), 128)).astype(np.float32) for n in rng.integers(1, 801, 24)]
    stacked = np.concatenate(qs)
    qt, real = scoring._query_columns(stacked)
    assert real == rows + 1 + 2 * scoring._needs_sign_rows(stacked)
    assert qt.shape[1] % scoring.QUERY_COLUMN_MULTIPLE == 0 and qt.shape[1] >= real
    want = np.array(
        [
            [(q.astype(np.float64) @ d.T.astype(np.float64)).max(axis=1).sum() for d in docs]
            for q in qs
        ]
    )
    np.testing.assert_allclose(
        colembed.score(qs, docs, backend="numpy"), want, rtol=1e-5, atol=1e-4
    )


def test_sign_rows_join_only_when_a_dim_has_one_strict_sign():
    """`_needs_sign_rows`: a dim where every query row is > 0 (or every one < 0) needs them; a
    zero, or both signs, at every dim does not (a real multi-token query)."""
    rng = np.random.default_rng(5)
    mixed = rng.standard_normal((24, 128)).astype(np.float32)
    mixed[0], mixed[1] = np.abs(mixed[0]), -np.abs(mixed[1])  # both signs at every dim
    assert not scoring._needs_sign_rows(mixed)
    one_sign = mixed.copy()
    one_sign[:, 17] = np.abs(one_sign[:, 17]) + 0.1
    assert scoring._needs_sign_rows(one_sign) and scoring._needs_sign_rows(-one_sign)
    with_zero = one_sign.copy()
    with_zero[3, 17] = 0.0  # 0 * inf is NaN: a zero covers both signs
    assert not scoring._needs_sign_rows(with_zero)
    assert scoring._needs_sign_rows(mixed[:1]) and not scoring._needs_sign_rows(
        np.zeros((1, 128), np.float32)
    )


@pytest.mark.parametrize("query_kind", ["mixed", "one strict sign", "one token"])
@pytest.mark.parametrize("pattern", ["+inf", "-inf", "+inf and -inf", "nan", "-inf in every dim"])
def test_a_non_finite_page_row_is_caught_with_or_without_the_sign_rows(query_kind, pattern):
    """Whatever the query's signs: a page row whose products with every query row would be
    -inf (the -inf at dims where the query rows are all positive) still gives the named error,
    on the per-page path with (one strict sign, one token) and without (mixed) the sign rows."""
    rng = np.random.default_rng(11)
    q = rng.standard_normal((20, 128)).astype(np.float32)
    if query_kind == "one strict sign":
        q[:, :8] = np.abs(q[:, :8]) + 0.1
    elif query_kind == "one token":
        q = np.abs(q[:1]) + 0.1
    else:
        q[0], q[1] = np.abs(q[0]), -np.abs(q[1])
    assert scoring._needs_sign_rows(q) == (query_kind != "mixed")
    docs = [
        rng.standard_normal((int(n), 128)).astype(np.float32) for n in rng.integers(700, 801, 12)
    ]
    row = docs[9][123]
    if pattern == "+inf":
        row[3] = np.inf
    elif pattern == "-inf":
        row[3] = -np.inf  # q[:, 3] > 0 on the one-sign queries: every product is -inf
    elif pattern == "+inf and -inf":
        row[2:4] = [np.inf, -np.inf]
    elif pattern == "nan":
        row[5] = np.nan
    else:
        row[:] = -np.inf
    with pytest.raises(ScoringError, match="document 9: contains NaN or inf"):
        colembed.score(q, docs, backend="numpy")


def test_a_non_finite_page_raises_the_named_error_not_a_warning_from_a_worker():
    """numpy's error state is per thread: the worker threads set their own, so a page row holding
    +inf and -inf (its sum is NaN: 'invalid value') gives the ScoringError, not a RuntimeWarning
    raised inside a worker when warnings are errors."""
    import warnings

    qs, docs = _data()
    docs[29] = docs[29].copy()
    docs[29][4, :2] = [np.inf, -np.inf]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ScoringError, match="document 29: contains NaN or inf"):
            colembed.score(qs, docs, backend="numpy")


def test_a_list_of_pages_is_one_block_and_an_iterable_is_read_in_blocks(monkeypatch):
    """Pages already in memory (a list) go to the worker threads in one pass, not in blocks of
    BLOCK_DOCUMENTS with a barrier each (every worker waits for the last run, then sleeps while
    the next block is validated); an iterable is still read BLOCK_DOCUMENTS at a time."""
    monkeypatch.setattr(scoring, "BLOCK_DOCUMENTS", 16)
    qs, docs = _data(pages=40)
    passes = []
    original = scoring._numpy_per_page_parallel

    def parallel(q, starts, pages, floor, first):
        passes.append(len(pages))
        return original(q, starts, pages, floor, first)

    monkeypatch.setattr(scoring, "_numpy_per_page_parallel", parallel)
    listed = colembed.score(qs, docs, backend="numpy")
    assert passes == [40]
    passes.clear()
    streamed = colembed.score(qs, iter(docs), backend="numpy")
    assert passes == [16, 16, 8]
    np.testing.assert_array_equal(listed, streamed)
    passes.clear()
    colembed.score(qs, docs, backend="numpy", reference_padding=True, reference_batch_size=12)
    assert passes == [40]  # one block of 48 (a whole number of reference batches of 12)


@pytest.mark.parametrize("cols", [8, 40])
def test_page_maxima_is_numpy_max_bit_for_bit_at_every_group_edge(cols):
    """`_page_maxima` pads each page's similarities with -inf rows to a multiple of MAX_GROUP_ROWS:
    page lengths around the multiples, 1 row, all-negative pages and a NaN give `sims.max(0)`."""
    rng = np.random.default_rng(cols)
    g = scoring.MAX_GROUP_ROWS
    lengths = [1, g - 1, g, g + 1, 2 * g - 1, 2 * g, 3, 757, 800, 1]
    docs = [rng.standard_normal((n, 16)).astype(np.float32) for n in lengths]
    docs[2] = -np.abs(docs[2]) - 1  # with a positive query column: every similarity negative
    docs[7] = docs[7].copy()
    docs[7][100, 3] = np.nan
    qt = np.ascontiguousarray(np.abs(rng.standard_normal((16, cols)).astype(np.float32)))
    best = np.empty((len(docs), cols), np.float32)
    scratch = np.full(scoring._group_padded(max(lengths)) * cols, 123.0, np.float32)  # stale
    scoring._page_maxima(qt, docs, best, scratch)
    want = np.stack([(d @ qt).max(axis=0) for d in docs])
    np.testing.assert_array_equal(best, want)
    assert np.isnan(best[7]).all() and (best[2] < 0).all()
