"""Few queries against long pages are scored in page shares on worker threads, each with a
single-threaded BLAS (scoring.PARALLEL_MAX_QUERY_ROWS; speed in benchmarks/results/scoring*.md).
These tests hold that the path is taken, gives the serial path's scores, and still names a bad
page by its index in the whole list."""

from __future__ import annotations

import numpy as np
import pytest

import colembed
from colembed import scoring
from colembed.errors import ScoringError

pytestmark = pytest.mark.skipif(scoring._page_workers() is None,
                                reason="numpy's BLAS cannot limit one thread's calls here")


def _data(pages=40, queries=1, seed=0):
    rng = np.random.default_rng(seed)
    qs = [rng.standard_normal((int(n), 128)).astype(np.float32) for n in rng.integers(18, 35, queries)]
    docs = [rng.standard_normal((int(n), 128)).astype(np.float32) for n in rng.integers(700, 801, pages)]
    return qs, docs


def _serial(qs, docs, monkeypatch, **kw):
    with monkeypatch.context() as m:
        m.setattr(scoring, "PARALLEL_MAX_QUERY_ROWS", 0)
        return colembed.score(qs, docs, backend="numpy", **kw)


def test_a_search_is_split_between_the_worker_threads(monkeypatch):
    qs, docs = _data()
    calls = []
    original = scoring._numpy_per_page
    monkeypatch.setattr(scoring, "_numpy_per_page",
                        lambda q, s, d, f, first: calls.append((first, len(d))) or original(q, s, d, f, first))
    colembed.score(qs, docs, backend="numpy")
    workers = scoring._page_workers()[0]
    assert len(calls) == workers and sum(n for _, n in calls) == len(docs)
    assert [first for first, _ in calls] == sorted(first for first, _ in calls)


@pytest.mark.parametrize("queries", [1, 4])
def test_the_shares_give_the_serial_scores(queries, monkeypatch):
    qs, docs = _data(queries=queries, seed=queries)
    got = colembed.score(qs, docs, backend="numpy")
    want = _serial(qs, docs, monkeypatch)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    ref = _serial(qs, docs, monkeypatch, reference_padding=True)
    np.testing.assert_allclose(colembed.score(qs, docs, backend="numpy", reference_padding=True),
                               ref, rtol=1e-5, atol=1e-4)


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
