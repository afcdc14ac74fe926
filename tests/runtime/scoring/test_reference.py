"""`reference_padding=True` equals transformers 4.57.1 `ColQwen2Processor.score_retrieval`.

Same ragged float32 lists on both sides (torch tensors share the numpy memory). The sets are built
so that the zero rows of the reference's padding matter (every similarity negative for some query
tokens, pages of unequal length within and across batches of 128), and the exact scorer is shown to
differ from the reference on them, so the equality is not vacuous.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from colembed import scoring  # noqa: E402

KINDS = ["numpy-per-page", "numpy-stacked", "onnx"]


@pytest.fixture(scope="module")
def graph_scorer():
    return scoring.MaxSimScorer.with_built_graph(threads=1)


def colembed_reference(kind, graph_scorer, monkeypatch, queries, pages, **kw):
    if kind == "onnx":
        return graph_scorer.score(queries, pages, backend="onnx", reference_padding=True, **kw)
    stacked = kind == "numpy-stacked"
    monkeypatch.setattr(scoring, "STACKED_MAX_QUERY_TOKENS", 10**9 if stacked else 0)
    monkeypatch.setattr(scoring, "STACKED_MAX_PAGE_TOKENS", 10**9 if stacked else 0)
    return scoring.score(queries, pages, backend="numpy", reference_padding=True, **kw)


def transformers_scores(processor, queries, pages, batch_size=128):
    out = processor.score_retrieval(
        [torch.from_numpy(q) for q in queries],
        [torch.from_numpy(p) for p in pages],
        batch_size=batch_size,
    )
    assert out.dtype == torch.float32
    return out.numpy()


def ragged(rng, count, low, high, dim, sign=0):
    out = []
    for n in rng.integers(low, high + 1, count):
        x = rng.standard_normal((int(n), dim)).astype(np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        out.append(np.abs(x) * np.float32(sign) if sign else x)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_reference_mode_equals_score_retrieval(
    kind, reference_processor, graph_scorer, monkeypatch
):
    """300 pages (three reference batches, the last one partial) and 130 queries (two query
    batches), lengths ragged everywhere; half the pages point away from every query."""
    rng = np.random.default_rng(0)
    dim = 32
    queries = ragged(rng, 130, 1, 12, dim, sign=1)
    pages = [p if i % 2 else -np.abs(p) for i, p in enumerate(ragged(rng, 300, 1, 40, dim))]
    pages[200:256] = ragged(rng, 56, 17, 17, dim, sign=-1)  # a batch part with equal lengths
    want = transformers_scores(reference_processor, queries, pages)
    got = colembed_reference(
        kind, graph_scorer, monkeypatch, queries, pages, memory_budget_bytes=200_000
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    exact = scoring.score(queries, pages)
    assert np.abs(exact - want).max() > 0.1  # the zero rows really changed scores


@pytest.mark.parametrize("kind", KINDS)
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**32 - 1),
    n_pages=st.integers(1, 25),
    batch=st.integers(1, 9),
    block=st.integers(1, 6),
    budget=st.sampled_from([1, 5_000, 1 << 30]),
)
def test_reference_mode_equals_score_retrieval_at_any_batch_size(
    kind, seed, n_pages, batch, block, budget, reference_processor, graph_scorer, monkeypatch
):
    """score_retrieval's `batch_size` decides which pages get zero rows; colembed's own blocks and
    chunks (made tiny here) must not."""
    monkeypatch.setattr(scoring, "BLOCK_DOCUMENTS", block)
    rng = np.random.default_rng(seed)
    queries = ragged(rng, int(rng.integers(1, 5)), 1, 6, 8, sign=int(rng.choice([0, 1])))
    pages = ragged(rng, n_pages, 1, 9, 8, sign=int(rng.choice([0, -1])))
    want = transformers_scores(reference_processor, queries, pages, batch_size=batch)
    got = colembed_reference(
        kind,
        graph_scorer,
        monkeypatch,
        queries,
        pages,
        reference_batch_size=batch,
        memory_budget_bytes=budget,
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_reference_top_k_follows_the_reference_scores(reference_processor):
    rng = np.random.default_rng(3)
    queries = ragged(rng, 4, 2, 6, 16, sign=1)
    pages = ragged(rng, 200, 1, 30, 16, sign=-1)
    want = transformers_scores(reference_processor, queries, pages)
    idx, top = scoring.top_k(queries, iter(pages), 10, reference_padding=True)
    np.testing.assert_allclose(top, np.take_along_axis(want, idx, axis=1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(top, -np.sort(-want, axis=1)[:, :10], rtol=1e-5, atol=1e-5)
