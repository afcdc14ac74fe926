"""Two-stage search's plan (store.py): the `mean` stage, the nested rows / cols stages, the exact
rerank, on both stores; and an index written by schema 1 (no `mean`), made by this code through the
schema-1 constants, which must still open, grow and search, and (Edge) upgrade in place.

The plan's limits are shrunk here (monkeypatch) so a 40-page store exercises the filtering a
10,000-page one does; the scores are checked against numpy MaxSim over the stored (float16) vectors.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import colembed
from colembed.cli import main
from colembed.index import Index, edge, plan as plan_module, server, upgrade_index
from colembed.index.schema import (MEAN_VECTOR, PAGE_VECTOR, SCHEMA_VECTORS, VECTOR_NAMES,
                                   PagePoint, make_point, mean_from_payload, mean_vector)
from colembed.index import OldIndexWarning, open_store
from colembed.index.plan import two_stage_plan
from colembed.model import PageLayout
from index_docs import page

DIM = 16
STORES = ["edge", "client-local"]


def _page(i: int):
    rng = np.random.default_rng(i)
    layout = PageLayout(grid_rows=3, grid_cols=4, image_start=2, num_tokens=17, token_px=28)
    v = rng.standard_normal((layout.num_tokens, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True), layout


def _points(n: int):
    return [make_point(*_page(i), {
        "path": f"/docs/{i}.pdf", "page": 1, "pages": 1, "sha256": f"{i:064x}", "width": 112,
        "height": 84, "model": "m", "variant": "fp32", "manifest_sha256": "h", "schema": 2,
        "model_source": "/m"}) for i in range(n)]


@pytest.fixture
def small_plan(monkeypatch):
    """Limits a 40-page store can feel: mean 3 straight to the rerank, a pool of 8, rows/cols 2."""
    for name, value in (("MEAN_CANDIDATES", 3), ("MEAN_POOL", 8), ("POOLED_CANDIDATES", 2),
                        ("PREFETCH_CANDIDATES", 3)):
        monkeypatch.setattr(plan_module, name, value)


def test_mean_vector_is_the_mean_of_the_image_rows():
    vectors, layout = _page(0)
    np.testing.assert_allclose(mean_vector(vectors, layout), vectors[2:14].mean(0), rtol=1e-6)
    assert set(_points(1)[0].vectors) == set(VECTOR_NAMES)


@pytest.mark.parametrize("kind", STORES)
def test_a_point_without_its_mean_gets_it_from_its_page_vectors(kind, tmp_path):
    point = _points(1)[0]
    carried = PagePoint(point.id, {n: v for n, v in point.vectors.items() if n != MEAN_VECTOR},
                        point.payload)  # as colembed.distributed's Parquet columns carry it
    store = open_store(tmp_path / "db", dim=DIM, local=kind == "client-local")
    store.upsert([carried])
    stored = store.points([point.id])[point.id].vectors[MEAN_VECTOR]
    np.testing.assert_allclose(stored, point.vectors[MEAN_VECTOR], atol=1e-3)  # float16
    store.close()


def test_the_plan_nests_rows_and_cols_in_the_mean_pool_and_honours_k(small_plan):
    mean, rows, cols = two_stage_plan(2, 5)
    assert (mean.using, mean.limit, mean.within) == (MEAN_VECTOR, 5, None)
    assert rows.within == cols.within and rows.within.using == MEAN_VECTOR
    assert (rows.limit, rows.within.limit) == (5, 8)
    assert [s.using for s in two_stage_plan(1, 2)] == ["rows", "cols"]
    assert all(s.within is None for s in two_stage_plan(1, 2))


@pytest.mark.parametrize("kind", STORES)
def test_two_stage_scores_are_exact_and_find_the_planted_page(kind, tmp_path, small_plan):
    store = open_store(tmp_path / "db", dim=DIM, local=kind == "client-local")
    points = _points(40)
    store.upsert(points)
    stored = store.page_vectors([p.id for p in points])
    rng = np.random.default_rng(99)
    for target in (5, 17, 33):  # a query made of noisy tokens of one page: that page is the best
        tokens = points[target].vectors[PAGE_VECTOR][2 + rng.choice(12, 6, replace=False)]
        query = tokens + 0.1 * rng.standard_normal(tokens.shape).astype(np.float32)
        for k in (1, 4, 12):  # 12 > every limit of the shrunk plan: still k pages
            hits, = store.search([query], k, "two-stage")
            assert len(hits) == k and hits[0].id == points[target].id
            scores = [float((query @ stored[h.id].T).max(axis=1).sum()) for h in hits]
            np.testing.assert_allclose([h.score for h in hits], scores, rtol=2e-4)
            assert scores == sorted(scores, reverse=True)
    store.close()


@pytest.mark.parametrize("kind", STORES)
def test_a_schema_1_index_opens_grows_searches_and_upgrades(kind, tmp_path, monkeypatch, capsys,
                                                             exported_tiny):
    model = colembed.load(exported_tiny.folder, max_image_tokens=64)
    for module in (edge, server):  # what colembed 0.1.0 wrote: no `mean` vector, schema 1
        monkeypatch.setattr(module, "SCHEMA_VERSION", 1)
        monkeypatch.setattr(module, "VECTOR_NAMES", SCHEMA_VECTORS[1])
    local = kind == "client-local"
    for name in ("first", "second"):
        page(name).save(tmp_path / f"{name}.png")
    with Index(tmp_path / "db", model=model, local=local) as old:
        assert old.add(tmp_path / "first.png").ok and old.store.schema == 1
    monkeypatch.undo()

    with Index(tmp_path / "db", model=model, local=local) as index:
        assert index.store.schema == 1
        assert index.add(tmp_path / "second.png").ok and len(index) == 2
        hint = "new collection" if local else "colembed upgrade --db"
        with pytest.warns(OldIndexWarning, match=f"schema 1.*{hint}"):
            hits = index.search("second", k=2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # told once
            exact = index.search("second", k=2, mode="exact")
        assert sorted((h.file, h.score) for h in hits) == sorted((h.file, h.score) for h in exact)
        assert {h.payload["schema"] for h in hits} == {1}
        before = {h.id: h.score for h in exact}
    if local:
        return
    capsys.readouterr()
    assert main(["upgrade", "--db", str(tmp_path / "db")]) == 0  # Edge: rewritten in place
    assert "rewrote 2 page(s)" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["db", "first.png", "second.png"]
    with Index(tmp_path / "db", model=model) as index:
        assert index.store.schema == 2 and len(index) == 2
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            hits = index.search("second", k=2)
        assert {h.id: h.score for h in hits} == before
        assert {h.payload["schema"] for h in hits} == {2}
        point = index.store.points([hits[0].id])[hits[0].id]
        np.testing.assert_allclose(point.vectors[MEAN_VECTOR], mean_from_payload(
            point.vectors[PAGE_VECTOR], point.payload), atol=1e-3)
    assert not upgrade_index(tmp_path / "db")
