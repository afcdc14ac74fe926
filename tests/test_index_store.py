"""The store adapters, one parametrized suite: Qdrant Edge (embedded) and qdrant-client.

No Qdrant server can run here, so the server adapter (`server.ServerStore`, the `url=` path) is
exercised through qdrant-client's local mode (`path=`): the same client calls, collection schema,
point ids and payload a server gets. Scores are checked against numpy MaxSim over the vectors the
store holds (stored as float16).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from colembed.index.schema import PAGE_VECTOR, VECTOR_NAMES, make_point, pooled_vectors
from colembed.index import ModelMismatchError, StoreError, open_store
from colembed.model import PageLayout

DIM = 16
STORES = ["edge", "client-local"]


def _page(i: int, rows: int = 3, cols: int = 4):
    rng = np.random.default_rng(i)
    layout = PageLayout(grid_rows=rows, grid_cols=cols, image_start=2,
                        num_tokens=2 + rows * cols + 3, token_px=28)
    v = rng.standard_normal((layout.num_tokens, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True), layout


def _payload(i: int) -> dict:
    return {"path": f"/docs/{i // 2}.pdf", "page": i % 2 + 1, "pages": 2, "sha256": f"{i // 2:064x}",
            "width": 112, "height": 84, "model": "m", "variant": "fp32", "manifest_sha256": "h",
            "schema": 1, "model_source": "/m"}


def _points(n: int):
    return [make_point(*_page(i), _payload(i)) for i in range(n)]


def _maxsim(q: np.ndarray, page: np.ndarray) -> float:
    return float((q @ page.T).max(axis=1).sum())


@pytest.fixture(params=STORES)
def store_factory(request, tmp_path):
    def make(dim=DIM):
        return open_store(tmp_path / "db", dim=dim, local=request.param == "client-local")
    return make


def test_pooling_is_row_and_column_means_plus_prompt_rows():
    vectors, layout = _page(0)
    rows, cols = pooled_vectors(vectors, layout)
    grid = vectors[2:14].reshape(3, 4, DIM)
    others = np.concatenate([vectors[:2], vectors[14:]])
    np.testing.assert_allclose(rows, np.concatenate([grid.mean(1), others]), rtol=1e-6)
    np.testing.assert_allclose(cols, np.concatenate([grid.mean(0), others]), rtol=1e-6)


def test_point_ids_are_deterministic_and_depend_on_content_page_and_path():
    a = make_point(*_page(0), _payload(0))
    assert a.id == make_point(*_page(0), _payload(0)).id
    assert a.id != make_point(*_page(0), dict(_payload(0), sha256="f" * 64)).id
    assert a.id != make_point(*_page(0), dict(_payload(0), page=2)).id
    assert a.id != make_point(*_page(0), dict(_payload(0), path="/elsewhere.pdf")).id
    with pytest.raises(ValueError, match="lacks"):
        make_point(*_page(0), {"path": "/x"})


def test_store_roundtrip_exact_scores_and_two_stage(store_factory):
    store = store_factory()
    points = _points(12)
    store.upsert(points)
    assert store.count() == 12
    assert sorted(pid for pid, _ in store.payloads()) == sorted(p.id for p in points)
    payload = dict(store.payloads())[points[3].id]
    assert payload == points[3].payload and payload["grid"] == [3, 4]
    stored = store.page_vectors([p.id for p in points])
    for p in points:  # float16 storage
        np.testing.assert_allclose(stored[p.id], p.vectors[PAGE_VECTOR], atol=1e-3)
    queries = [_page(100 + i, 1, 5)[0] for i in range(3)]
    exact = store.search(queries, 5, "exact")
    for q, hits in zip(queries, exact):  # float16 storage: scores move by ~1e-4 of a score
        expected = sorted((_maxsim(q, stored[p.id]) for p in points), reverse=True)[:5]
        np.testing.assert_allclose([h.score for h in hits], expected, rtol=2e-4)
    two = store.search(queries, 5, "two-stage")  # 12 pages < candidates: the same pages
    assert [[h.id for h in r] for r in two] == [[h.id for h in r] for r in exact]
    with pytest.raises(ValueError, match="mode"):
        store.search(queries, 5, "fast")
    store.close()


def test_delete_and_reopen_keep_what_was_stored(store_factory):
    store = store_factory()
    points = _points(6)
    store.upsert(points)
    store.delete([points[0].id, points[1].id])
    store.close()
    reopened = store_factory(dim=None)
    assert reopened.count() == 4
    assert points[0].id not in dict(reopened.payloads())
    assert reopened.any_payload()["model"] == "m"
    reopened.close()


def test_missing_index_without_a_model_is_an_error(store_factory):
    with pytest.raises(StoreError, match="no index here"):
        store_factory(dim=None)


def test_edge_refuses_a_folder_that_is_not_an_index(tmp_path):
    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(StoreError, match="not a colembed index"):
        open_store(tmp_path, dim=DIM)
    assert (tmp_path / "mine.txt").read_text() == "keep me"


def test_both_stores_declare_the_same_schema(tmp_path):
    """Edge's shard config and the client's collection config: same names, size, distance, MaxSim,
    float16, no HNSW graph, page vectors on disk."""
    edge = open_store(tmp_path / "edge", dim=DIM)
    local = open_store(tmp_path / "local", dim=DIM, local=True)
    params = local.client.get_collection(local.collection).config.params.vectors
    assert set(params) == set(VECTOR_NAMES)
    for name in VECTOR_NAMES:
        assert params[name].size == DIM and params[name].distance.name == "DOT"
        assert params[name].datatype.name == "FLOAT16" and params[name].hnsw_config.m == 0
        assert bool(params[name].on_disk) == (name == "page")  # the rerank target stays on disk
        multi = params[name].multivector_config
        assert (multi.comparator.name if multi else None) == (None if name == "mean" else "MAX_SIM")
    vectors = json.loads((tmp_path / "edge" / "shard" / "edge_config.json").read_text())["vectors"]
    assert set(vectors) == set(VECTOR_NAMES)
    for name, v in vectors.items():
        assert (v["size"], v["distance"].lower(), v["datatype"], v["hnsw_config"]["m"]) == (DIM, "dot", "float16", 0)
        comparator = (v.get("multivector_config") or {}).get("comparator")
        assert comparator == (None if name == "mean" else "max_sim")
        assert bool(v.get("on_disk")) == (name == "page")
    edge.close()
    local.close()
    assert issubclass(ModelMismatchError, StoreError)
