"""The store adapters, one parametrized suite: Qdrant Edge (embedded) and qdrant-client.

No Qdrant server can run here, so the server adapter (`server.ServerStore`, the `url=` path) is
exercised through qdrant-client's local mode (`path=`): the same client calls, collection schema,
point ids and payload a server gets. Scores are checked against numpy MaxSim over the vectors the
store holds (stored as float16).
"""

from __future__ import annotations

import numpy as np
import pytest

from colembed.index.schema import (
    PAGE_VECTOR,
    SCHEMA_VECTORS,
    SERVER_SCHEMA,
    make_point,
    pooled_vectors,
)
from colembed.index import ModelMismatchError, StoreError, open_store
from tests.fixtures.stores import DIM, STORES, unit_page


def _payload(i: int) -> dict:
    return {
        "path": f"/docs/{i // 2}.pdf",
        "page": i % 2 + 1,
        "pages": 2,
        "sha256": f"{i // 2:064x}",
        "width": 112,
        "height": 84,
        "model": "m",
        "variant": "fp32",
        "manifest_sha256": "h",
        "schema": 1,
        "model_source": "/m",
    }


def _points(n: int):
    return [make_point(*unit_page(i), _payload(i)) for i in range(n)]


def _maxsim(q: np.ndarray, page: np.ndarray) -> float:
    return float((q @ page.T).max(axis=1).sum())


@pytest.fixture(params=STORES)
def store_factory(request, tmp_path):
    def make(dim=DIM):
        return open_store(tmp_path / "db", dim=dim, local=request.param == "client-local")

    return make


def test_a_line_of_text_survives_row_pooling_but_not_column_pooling():
    """What the rows / cols stages are for: a line of text (one grid row of like tokens) keeps
    its full match after row pooling and is diluted by column pooling; the prompt tokens,
    which belong to no grid cell, reach both stages unchanged."""
    vectors, layout = unit_page(0, rows=4, cols=6)
    line = np.random.default_rng(7).standard_normal(DIM).astype(np.float32)
    line /= np.linalg.norm(line)
    first = layout.image_start + layout.grid_cols  # grid row 1
    vectors[first : first + layout.grid_cols] = line
    rows, cols = pooled_vectors(vectors, layout)
    assert (rows @ line).max() == pytest.approx(1.0, abs=1e-5)
    assert (cols @ line).max() < 0.8
    prompt = np.concatenate(
        [
            vectors[: layout.image_start],
            vectors[layout.image_start + layout.grid_rows * layout.grid_cols :],
        ]
    )
    for pooled in (rows, cols):
        np.testing.assert_allclose((prompt @ pooled.T).max(axis=1), 1.0, atol=1e-5)


def test_point_ids_are_deterministic_and_depend_on_content_page_and_path():
    a = make_point(*unit_page(0), _payload(0))
    assert a.id == make_point(*unit_page(0), _payload(0)).id
    assert a.id != make_point(*unit_page(0), dict(_payload(0), sha256="f" * 64)).id
    assert a.id != make_point(*unit_page(0), dict(_payload(0), page=2)).id
    assert a.id != make_point(*unit_page(0), dict(_payload(0), path="/elsewhere.pdf")).id
    with pytest.raises(ValueError, match="lacks"):
        make_point(*unit_page(0), {"path": "/x"})


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
    queries = [unit_page(100 + i, 1, 5)[0] for i in range(3)]
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
    """The client's collection config (names, size, distance, MaxSim, float16, no HNSW graph, page
    vectors on disk) and Edge answering the same points and queries with the same hits and scores."""
    edge = open_store(tmp_path / "edge", dim=DIM)
    local = open_store(tmp_path / "local", dim=DIM, local=True)
    params = local.client.get_collection(local.collection).config.params.vectors
    assert set(params) == set(SCHEMA_VECTORS[SERVER_SCHEMA])
    for name in SCHEMA_VECTORS[SERVER_SCHEMA]:
        assert params[name].size == DIM and params[name].distance.name == "DOT"
        assert params[name].datatype.name == "FLOAT16" and params[name].hnsw_config.m == 0
        assert bool(params[name].on_disk) == (name == "page")  # the rerank target stays on disk
        multi = params[name].multivector_config
        assert (multi.comparator.name if multi else None) == (None if name == "mean" else "MAX_SIM")
    points = _points(12)  # Edge's side of the schema, by what it answers: the same as the client's
    queries = [unit_page(200 + i, 1, 5)[0] for i in range(3)]
    for store in (edge, local):
        store.upsert(points)
    for mode in ("exact", "two-stage"):
        answers = [store.search(queries, 5, mode) for store in (edge, local)]
        assert [[h.id for h in r] for r in answers[0]] == [[h.id for h in r] for r in answers[1]]
        np.testing.assert_allclose(
            [[h.score for h in r] for r in answers[0]],
            [[h.score for h in r] for r in answers[1]],
            rtol=2e-4,
        )  # float16 sums
    edge.close()
    local.close()
    assert issubclass(ModelMismatchError, StoreError)
