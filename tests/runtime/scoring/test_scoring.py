"""colembed.scoring and the MaxSim graph against a plain-Python brute force.

Every backend (numpy one-GEMM-per-page, numpy stacked chunks, the onnx graph) at several memory
budgets (one page per chunk, a few pages, everything) must equal the brute force to 1e-5 of the
magnitude of the summed terms, including sets where every similarity of a query token is negative
(where zero padding would win a max).
"""

from __future__ import annotations

import sys
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import colembed
from colembed import maxsim_graph, scoring
from colembed.errors import ModelFolderError, ScoringError

RTOL = 1e-5
BUDGETS = {"one-page": 1, "few-pages": 6_000, "all": 1 << 30}
PROPERTY = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


# ------------------------------------------------------------------------------ brute force
def brute_terms(queries, documents, floor=None):
    """Per (query, page): the exact score and the sum of |terms| (the scale for the tolerance),
    with Python floats and loops only."""
    exact = np.zeros((len(queries), len(documents)))
    scale = np.zeros_like(exact)
    for a, q in enumerate(queries):
        for b, d in enumerate(documents):
            total, magnitude = 0.0, 0.0
            for qi in q.tolist():
                best, size = None, 0.0
                for dj in d.tolist():
                    dot = sum(x * y for x, y in zip(qi, dj))
                    best = dot if best is None or dot > best else best
                    size = max(size, sum(abs(x * y) for x, y in zip(qi, dj)))
                if floor is not None and floor[b]:
                    best = max(best, 0.0)
                total += best
                magnitude += size
            exact[a, b], scale[a, b] = total, magnitude
    return exact, scale


def assert_exact(got, queries, documents, floor=None):
    exact, scale = brute_terms(queries, documents, floor)
    assert got.shape == exact.shape and got.dtype == np.float32
    err = np.abs(got.astype(np.float64) - exact)
    assert (err <= RTOL * np.maximum(scale, 1e-30) + 1e-30).all(), float((err / scale).max())


# ------------------------------------------------------------------------------- backends
@pytest.fixture(scope="module")
def graph_scorer():
    return scoring.MaxSimScorer.with_built_graph(threads=1)


BACKENDS = ["numpy-per-page", "numpy-stacked", "onnx"]


def run_score(kind, graph_scorer, monkeypatch, queries, documents, **kw):
    """Score with one backend; the two numpy kernels are forced by moving their threshold."""
    if kind == "onnx":
        return graph_scorer.score(queries, documents, backend="onnx", **kw)
    stacked = kind == "numpy-stacked"
    monkeypatch.setattr(scoring, "STACKED_MAX_QUERY_TOKENS", 10**9 if stacked else 0)
    monkeypatch.setattr(scoring, "STACKED_MAX_PAGE_TOKENS", 10**9 if stacked else 0)
    return scoring.score(queries, documents, backend="numpy", **kw)


# ----------------------------------------------------------------------------- strategies
@st.composite
def ragged_sets(draw, max_queries=4, max_docs=9):
    """Random ragged queries and pages. Modes: mixed signs; every similarity negative (queries
    positive, pages negative); small integers (exact ties)."""
    dim = draw(st.integers(1, 6))
    mode = draw(st.sampled_from(["mixed", "all-negative", "integers"]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    q_lens = draw(st.lists(st.integers(1, 6), min_size=1, max_size=max_queries))
    d_lens = draw(st.lists(st.integers(1, 7), min_size=1, max_size=max_docs))

    def make(n, sign):
        if mode == "integers":
            return rng.integers(-2, 3, size=(n, dim)).astype(np.float32)
        x = rng.standard_normal((n, dim)).astype(np.float32) * np.float32(rng.uniform(0.1, 3))
        return (np.abs(x) + np.float32(0.05)) * np.float32(sign) if mode == "all-negative" else x

    return [make(n, 1) for n in q_lens], [make(n, -1) for n in d_lens]


# ------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("budget", BUDGETS.values(), ids=BUDGETS.keys())
@pytest.mark.parametrize("kind", BACKENDS)
@PROPERTY
@given(data=ragged_sets())
def test_score_equals_brute_force(kind, budget, data, graph_scorer, monkeypatch):
    queries, documents = data
    got = run_score(kind, graph_scorer, monkeypatch, queries, documents, memory_budget_bytes=budget)
    assert_exact(got, queries, documents)


@pytest.mark.parametrize("kind", BACKENDS)
def test_all_negative_similarities_are_not_lifted_to_zero(kind, graph_scorer, monkeypatch):
    """The reference's failure mode: every real similarity negative, pages of unequal length."""
    q = [np.ones((3, 4), np.float32)]
    docs = [-np.ones((2, 4), np.float32), -2 * np.ones((5, 4), np.float32)]
    got = run_score(kind, graph_scorer, monkeypatch, q, docs, memory_budget_bytes=1 << 20)
    np.testing.assert_array_equal(got, [[-12.0, -24.0]])


@pytest.mark.parametrize("kind", BACKENDS)
@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=ragged_sets(max_docs=12), perm_seed=st.integers(0, 1000))
def test_independent_of_order_subset_and_chunking(kind, data, perm_seed, graph_scorer, monkeypatch):
    queries, documents = data
    full = run_score(kind, graph_scorer, monkeypatch, queries, documents)
    rng = np.random.default_rng(perm_seed)
    perm = rng.permutation(len(documents))
    subset = np.sort(rng.choice(len(documents), size=max(1, len(documents) // 2), replace=False))
    for budget in BUDGETS.values():
        for picked in (perm, subset):  # the documents shuffled, then half of them
            got = run_score(
                kind,
                graph_scorer,
                monkeypatch,
                queries,
                [documents[i] for i in picked],
                memory_budget_bytes=budget,
            )
            np.testing.assert_allclose(got, full[:, picked], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", BACKENDS)
@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=ragged_sets())
def test_float16_pages_are_scored_in_fp32(kind, data, graph_scorer, monkeypatch):
    queries, documents = data
    half = [d.astype(np.float16) for d in documents]
    got = run_score(kind, graph_scorer, monkeypatch, queries, half)
    assert_exact(got, queries, [h.astype(np.float64) for h in half])


@pytest.mark.parametrize("kind", BACKENDS)
@PROPERTY
@given(data=ragged_sets(max_docs=14), batch=st.integers(1, 5))
def test_reference_padding_equals_brute_force_with_zero_rows(
    kind, data, batch, graph_scorer, monkeypatch
):
    """Zero rows exist exactly for pages shorter than the longest of their batch; several blocks
    (BLOCK_DOCUMENTS made tiny) must keep the batches aligned to the whole list."""
    queries, documents = data
    monkeypatch.setattr(scoring, "BLOCK_DOCUMENTS", 3)
    lengths = [len(d) for d in documents]
    floor = [
        lengths[i] < max(lengths[i - i % batch : i - i % batch + batch])
        for i in range(len(documents))
    ]
    got = run_score(
        kind,
        graph_scorer,
        monkeypatch,
        queries,
        documents,
        reference_padding=True,
        reference_batch_size=batch,
        memory_budget_bytes=1,
    )
    assert_exact(got, queries, documents, floor)


def test_auto_backend_and_the_free_functions_agree(graph_scorer):
    rng = np.random.default_rng(0)
    queries = [rng.standard_normal((n, 16)).astype(np.float32) for n in (30, 40, 50)]
    docs = [rng.standard_normal((n, 16)).astype(np.float32) for n in rng.integers(1, 90, 40)]
    auto = graph_scorer.score(queries, docs)
    free = colembed.score(queries, docs)
    np.testing.assert_allclose(auto, free, rtol=1e-6, atol=1e-5)
    # one 2-D array is one query; a 3-D array is a batch of equal-length items
    np.testing.assert_allclose(colembed.score(queries[0], docs), free[:1], rtol=1e-6, atol=1e-5)
    stacked = np.stack([d[:1] for d in docs])
    np.testing.assert_allclose(
        colembed.score(queries, stacked), colembed.score(queries, [d[:1] for d in docs]), rtol=1e-6
    )


def test_auto_uses_the_graph_only_for_many_query_tokens(graph_scorer):
    many = [np.ones((scoring.ONNX_MIN_QUERY_TOKENS, 4), np.float32)]
    few = [np.ones((scoring.ONNX_MIN_QUERY_TOKENS - 1, 4), np.float32)]
    assert graph_scorer.backend_for(many) == "onnx"
    assert graph_scorer.backend_for(few) == "numpy"
    assert scoring.default_scorer().backend_for(many) == "numpy"  # no graph
    assert graph_scorer.backend_for(few, "onnx") == "onnx"


# -------------------------------------------------------------------------------- top_k
@pytest.mark.parametrize("kind", ["numpy", "onnx"])
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=ragged_sets(max_docs=12), k=st.integers(1, 14), budget=st.sampled_from([1, 1 << 30]))
def test_top_k_streams_and_matches_a_full_sort(kind, data, k, budget, graph_scorer, monkeypatch):
    queries, documents = data
    monkeypatch.setattr(scoring, "BLOCK_DOCUMENTS", 4)  # several blocks -> several merges
    scorer = graph_scorer if kind == "onnx" else scoring.default_scorer()
    # same blocks and budget as top_k: the same GEMM shapes, so bitwise the same scores (a GEMM
    # of another shape may round differently in the last ulp and swap near-ties)
    full = scorer.score(queries, documents, backend=kind, memory_budget_bytes=budget)
    idx, top = scorer.top_k(
        queries, (d for d in documents), k, backend=kind, memory_budget_bytes=budget
    )
    kk = min(k, len(documents))
    assert idx.shape == top.shape == (len(queries), kk)
    assert idx.dtype == np.int64 and top.dtype == np.float32
    for a in range(len(queries)):
        # best score first, ties to the lower index
        expected = sorted(range(len(documents)), key=lambda j: (-float(full[a, j]), j))[:kk]
        assert idx[a].tolist() == expected
        np.testing.assert_array_equal(top[a], full[a, expected])


def test_top_k_ties_go_to_the_lower_index():
    q = [np.ones((2, 3), np.float32)]
    page = np.ones((4, 3), np.float32)
    idx, top = colembed.top_k(q, [page * 0.5, page, page, page * 0.5, page], 4)
    assert idx.tolist() == [[1, 2, 4, 0]]
    np.testing.assert_array_equal(top, [[6.0, 6.0, 6.0, 3.0]])


def test_top_k_handles_negative_and_zero_scores():
    q = [np.array([[1.0, 0.0]], np.float32)]
    pages = [np.array([[x, 0.0]], np.float32) for x in (-3.0, 0.0, -0.0, 2.0, -1e-30, 1e-30)]
    idx, top = colembed.top_k(q, pages, 6)
    assert idx.tolist() == [[3, 5, 1, 2, 4, 0]]
    assert top[0].tolist() == pytest.approx([2.0, 1e-30, 0.0, 0.0, -1e-30, -3.0])


# ------------------------------------------------------------------------------ memory bound
@pytest.mark.parametrize("per_page", [True, False])
def test_memory_follows_the_budget(per_page, monkeypatch):
    """A (Q, N, Lq, Ld) tensor here would be 25.6 MB; the budget keeps numpy's scratch near 1 MB."""
    monkeypatch.setattr(scoring, "STACKED_MAX_QUERY_TOKENS", 0 if per_page else 10**9)
    monkeypatch.setattr(scoring, "STACKED_MAX_PAGE_TOKENS", 0 if per_page else 10**9)
    rng = np.random.default_rng(0)
    queries = [rng.standard_normal((20, 32)).astype(np.float32) for _ in range(8)]
    docs = [rng.standard_normal((100, 32)).astype(np.float32) for _ in range(400)]
    scoring.score(queries, docs[:2], memory_budget_bytes=1 << 20)  # warm caches and imports
    tracemalloc.start()
    try:
        idx, _ = scoring.top_k(queries, iter(docs), 3, memory_budget_bytes=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 << 20, peak
    assert idx.shape == (8, 3)


# ---------------------------------------------------------------------------------- errors
def _q(n=2, dim=4):
    return [np.ones((n, dim), np.float32)]


@pytest.mark.parametrize(
    "queries, documents, match",
    [
        (_q(), [np.ones((3, 4), np.float32), np.ones((3, 5), np.float32)], "document 1: has dim 5"),
        (
            [np.ones((2, 4), np.float32), np.ones((2, 3), np.float32)],
            [np.ones((3, 4))],
            "query 1: has dim 3",
        ),
        ([], [np.ones((3, 4), np.float32)], "no queries"),
        (_q(), [], "no documents"),
        (_q(), iter([]), "no documents"),
        (
            _q(),
            [np.ones((3, 4), np.float32), np.ones((0, 4), np.float32)],
            "document 1: has no tokens",
        ),
        (_q(), [np.ones((3, 4), np.int64)], "document 0: dtype int64 is not floating point"),
        (
            [np.ones((2, 4), np.int32)],
            [np.ones((3, 4))],
            "query 0: dtype int32 is not floating point",
        ),
        (_q(), [np.ones(4, np.float32)], "document 0: expected a 2-D"),
        (_q(), [np.ones((1, 3, 4), np.float32)], "document 0: expected a 2-D"),
        (_q(), np.ones(4, np.float32), "array of shape"),
        ("query", [np.ones((3, 4))], "got str"),
        ([np.array([[1.0, np.nan, 0, 0]], np.float32)], [np.ones((3, 4))], "query 0: contains NaN"),
    ],
)
def test_malformed_inputs_are_named(queries, documents, match):
    with pytest.raises(ScoringError, match=match):
        colembed.score(queries, documents)


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_or_inf_in_a_page_is_named(kind, bad, graph_scorer, monkeypatch):
    docs = [np.ones((3, 4), np.float32) for _ in range(5)]
    docs[3] = docs[3].copy()
    docs[3][1, 2] = bad
    with pytest.raises(ScoringError, match="document 3: contains NaN or inf"):
        run_score(kind, graph_scorer, monkeypatch, _q(), docs)


def test_huge_but_finite_pages_are_not_rejected():
    """Row sums overflow fp32 (the cheap check fires) but the exact check lets the page through."""
    page = np.full((2, 4), 3e38, np.float32)
    got = colembed.score([np.full((1, 4), 1e-38, np.float32)], [page])
    assert np.isfinite(got).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"backend": "gpu"}, "backend must be one of"),
        ({"backend": "onnx"}, "needs a scorer graph"),
        ({"memory_budget_bytes": 0}, "memory_budget_bytes"),
        ({"reference_padding": True, "reference_batch_size": 0}, "reference_batch_size"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ScoringError, match=match):
        colembed.score(_q(), [np.ones((3, 4), np.float32)], **kwargs)


@pytest.mark.parametrize("k", [0, -1, 1.5, True, None])
def test_bad_k(k):
    with pytest.raises(ScoringError, match="k must be a positive int"):
        colembed.top_k(_q(), [np.ones((3, 4), np.float32)], k)


# ----------------------------------------------------------------------------------- graph
def test_graph_file_matches_its_contract_and_loads_from_a_folder(tmp_path):
    import onnxruntime as ort

    path = maxsim_graph.write_maxsim_graph(tmp_path)
    assert path == tmp_path / maxsim_graph.MAXSIM_FILE
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert maxsim_graph.MAXSIM_CONTRACT.mismatches(session) == []
    scorer = scoring.MaxSimScorer(tmp_path)
    assert scorer.has_graph and scorer.graph_path == path
    q, docs = _q(), [np.ones((3, 4), np.float32)]
    np.testing.assert_array_equal(scorer.score(q, docs, backend="onnx"), [[8.0]])
    # an existing session is accepted as well
    np.testing.assert_array_equal(
        scoring.MaxSimScorer(session=session).score(q, docs, backend="onnx"), [[8.0]]
    )


@pytest.mark.parametrize("query_rows", [3, 40])  # both formulations: bias added / bias in GEMM
@pytest.mark.parametrize("doc_dtype", ["float32", "float16"])
def test_graph_ignores_whatever_padding_holds(doc_dtype, query_rows):
    """Large finite garbage in padded rows never wins a max; a padded query row adds 0 even when
    it holds garbage; every similarity negative so a zero row would show."""
    import onnxruntime as ort

    session = ort.InferenceSession(
        maxsim_graph.maxsim_model_bytes(doc_dtype=doc_dtype), providers=["CPUExecutionProvider"]
    )
    assert maxsim_graph.maxsim_contract(doc_dtype).mismatches(session) == []
    rng = np.random.default_rng(0)
    dim = 5
    qv = np.abs(rng.standard_normal((2, query_rows, dim))).astype(np.float32)
    qm = np.zeros((2, query_rows), np.int64)
    qm[0, : query_rows - 1], qm[1, :1] = 1, 1
    qv[0, -1], qv[1, 1:] = 1e4, -1e4
    dv = -np.abs(rng.standard_normal((3, 4, dim))).astype(doc_dtype)
    dm = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], np.int64)
    dv[0, 3], dv[1, 1:] = 1e4, -1e4
    got = session.run(
        None, {"query_vectors": qv, "query_mask": qm, "doc_vectors": dv, "doc_mask": dm}
    )[0]
    queries = [qv[0, : query_rows - 1], qv[1, :1]]
    pages = [dv[0, :3].astype(np.float32), dv[1, :1].astype(np.float32), dv[2].astype(np.float32)]
    assert_exact(got, queries, pages)
    assert (got < 0).all()


def test_a_float16_document_graph_is_fed_float16_pages():
    scorer = scoring.MaxSimScorer(maxsim_graph.maxsim_model_bytes(doc_dtype="float16"))
    rng = np.random.default_rng(0)
    queries = [rng.standard_normal((n, 8)).astype(np.float32) for n in (3, 5)]
    pages = [rng.standard_normal((n, 8)).astype(np.float16) for n in (1, 4, 9)]
    got = scorer.score(queries, pages, backend="onnx")
    assert_exact(got, queries, [p.astype(np.float64) for p in pages])
    # float32 pages are rounded to float16 by the padding copy of such a graph
    single = scorer.score(queries, [p.astype(np.float32) for p in pages], backend="onnx")
    np.testing.assert_array_equal(single, got)


def test_a_graph_with_another_contract_is_refused(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])
    model = helper.make_model(
        helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y]),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    model.ir_version = 8
    path = tmp_path / "maxsim.onnx"
    onnx.save(model, str(path))
    with pytest.raises(ModelFolderError, match="MaxSim scorer contract"):
        scoring.MaxSimScorer(path)
    with pytest.raises(ModelFolderError, match="no MaxSim scorer graph"):
        scoring.MaxSimScorer(tmp_path / "missing.onnx")


def test_building_without_onnx_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)
    with pytest.raises(ImportError, match="pip install onnx"):
        maxsim_graph.build_maxsim_model()
