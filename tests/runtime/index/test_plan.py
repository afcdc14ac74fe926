"""Two-stage search's plan (store.py): the `mean` stage, the nested rows / cols stages, the exact
rerank, on both stores; and an index written by schema 1 (no `mean`), made by this code through the
schema-1 constants, which must still open, grow and search, and (Edge) upgrade in place.

The plan's limits are shrunk here (monkeypatch) so a 40-page store exercises the filtering a
10,000-page one does; the scores are checked against numpy MaxSim over the stored (float16) vectors.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

import colembed
from colembed.cli import main
from colembed.index import Index, edge, server, upgrade_index
from colembed.index.schema import (
    ALL_VECTORS,
    MEAN_VECTOR,
    PAGE_VECTOR,
    SCHEMA_VECTORS,
    PagePoint,
    make_point,
    mean_from_payload,
    mean_vector,
)
from colembed.index import OldIndexWarning, open_store
from colembed.index.errors import StoreError
from colembed.index.plan import two_stage_plan
from tests.fixtures.stores import DIM, STORES, one_page_payload, set_plan_limits, unit_page
from tests.fixtures.documents import page


def _points(n: int):
    return [
        make_point(
            *unit_page(i),
            one_page_payload(i, 112, 84, schema=2),
        )
        for i in range(n)
    ]


@pytest.fixture
def small_plan(monkeypatch):
    """Limits a 40-page store can feel: mean 3 straight to the rerank, a pool of 8, rows/cols 2."""
    set_plan_limits(
        monkeypatch, MEAN_CANDIDATES=3, MEAN_POOL=8, POOLED_CANDIDATES=2, PREFETCH_CANDIDATES=3
    )


def test_mean_vector_is_the_mean_of_the_image_rows():
    vectors, layout = unit_page(0)
    np.testing.assert_allclose(mean_vector(vectors, layout), vectors[2:14].mean(0), rtol=1e-6)
    assert set(_points(1)[0].vectors) == set(ALL_VECTORS)


@pytest.mark.parametrize("kind", STORES)
def test_a_point_without_its_mean_gets_it_from_its_page_vectors(kind, tmp_path):
    point = _points(1)[0]
    carried = PagePoint(
        point.id, {n: v for n, v in point.vectors.items() if n != MEAN_VECTOR}, point.payload
    )  # as colembed.distributed's Parquet columns carry it
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
            (hits,) = store.search([query], k, "two-stage")
            assert len(hits) == k and hits[0].id == points[target].id
            scores = [float((query @ stored[h.id].T).max(axis=1).sum()) for h in hits]
            np.testing.assert_allclose([h.score for h in hits], scores, rtol=2e-4)
            assert scores == sorted(scores, reverse=True)
    store.close()


@pytest.mark.parametrize("kind", STORES)
def test_a_schema_1_index_opens_grows_searches_and_upgrades(
    kind, tmp_path, monkeypatch, capsys, exported_tiny
):
    model = colembed.load(exported_tiny.folder, max_image_tokens=64)
    # what colembed 0.1.0 wrote: no `mean` vector, schema 1
    monkeypatch.setattr(edge, "SCHEMA_VERSION", 1)
    monkeypatch.setattr(server, "SERVER_SCHEMA", 1)
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
    assert "rewrote 2 page(s) from schema 1 at the current schema 3" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["db", "first.png", "second.png"]
    with Index(tmp_path / "db", model=model) as index:
        assert index.store.schema == 3 and len(index) == 2
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            hits = index.search("second", k=2)
        assert {h.id: h.score for h in hits} == before
        assert {h.payload["schema"] for h in hits} == {3}
        point = index.store.points([hits[0].id])[hits[0].id]
        assert set(point.vectors) == {PAGE_VECTOR, MEAN_VECTOR}
        np.testing.assert_allclose(
            point.vectors[MEAN_VECTOR],
            mean_from_payload(point.vectors[PAGE_VECTOR], point.payload),
            atol=1e-3,
        )
    assert not upgrade_index(tmp_path / "db")


def test_a_new_edge_folder_stores_no_rows_or_cols_and_a_server_collection_does(tmp_path):
    """Schema 3 on Edge (its plan reads the token table and the mean), schema 2 on a server
    collection (its mean-gated plan reads rows / cols)."""
    points = _points(3)
    for kind, schema in (("edge", 3), ("client-local", 2)):
        store = open_store(tmp_path / kind, dim=DIM, local=kind == "client-local")
        store.upsert(points)
        assert store.schema == schema and set(store.vector_names) == set(SCHEMA_VECTORS[schema])
        assert set(store.points([points[0].id])[points[0].id].vectors) == set(
            SCHEMA_VECTORS[schema]
        )
        store.close()
    assert json.loads((tmp_path / "edge" / edge.META_FILE).read_text())["schema"] == 3


def test_points_read_from_a_schema_3_folder_go_into_a_server_collection(tmp_path):
    """An unpooled page's rows / cols are made from its stored page vectors (what make_point made,
    within float16); a pooled page's cannot be (they were those of the page before pooling): the
    page is refused by name."""
    points = _points(4)
    folder = open_store(tmp_path / "edge", dim=DIM)
    folder.upsert(points)
    read = folder.points([p.id for p in points])
    folder.close()
    server_store = open_store(tmp_path / "local", dim=DIM, local=True)
    server_store.upsert(list(read.values()))
    stored = server_store.points([p.id for p in points])
    for p in points:
        for name in ("rows", "cols"):
            np.testing.assert_allclose(stored[p.id].vectors[name], p.vectors[name], atol=2e-3)
    pooled = _points(1)[0]
    pooled = PagePoint(
        pooled.id,
        {n: pooled.vectors[n] for n in (PAGE_VECTOR, MEAN_VECTOR)},
        dict(pooled.payload, token_clusters="AAAA"),
    )
    with pytest.raises(StoreError, match=r"page 1 of /docs/0.pdf is stored pooled.*schema 2"):
        server_store.upsert([pooled])
    server_store.close()


def _schema_2_folder(path, monkeypatch, points):
    with monkeypatch.context() as m:  # what colembed 0.4 wrote: rows / cols beside page, mean
        m.setattr(edge, "SCHEMA_VERSION", 2)
        store = open_store(path, dim=DIM)
        store.upsert(points)
        store.close()


def test_a_schema_2_folder_opens_grows_searches_and_upgrade_drops_rows_and_cols(
    tmp_path, monkeypatch, capsys, small_plan
):
    """A schema-2 Edge folder keeps working as it was (adds pages at schema 2 with every vector,
    searches with the token plan, no warning: it is fast already, and with `use_tokens = False`
    the mean-gated plan); `colembed upgrade` rewrites it at schema 3: the same pages, ids,
    payloads but `schema`, the same hits and scores, no rows / cols, less disk; nothing else in the
    parent folder is touched."""
    points = _points(30)
    db = tmp_path / "db"
    _schema_2_folder(db, monkeypatch, points[:20])
    queries = [p.vectors[PAGE_VECTOR][3:9] for p in points[::7]]
    store = open_store(db)
    assert store.schema == 2
    store.upsert(points[20:])
    assert set(store.points([points[25].id])[points[25].id].vectors) == set(SCHEMA_VECTORS[2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        before = store.search(queries, 5, "two-stage")
    exact = store.search(queries, 5, "exact")
    assert [[h.id for h in r] for r in before] == [[h.id for h in r] for r in exact]
    store.use_tokens = False
    assert [len(r) for r in store.search(queries, 5, "two-stage")] == [5] * len(queries)
    payloads = dict(store.payloads())
    store.close()
    size = _disk(db / edge.SHARD_DIR)
    capsys.readouterr()
    assert main(["upgrade", "--db", str(db), "--quiet"]) == 0
    assert (
        "rewrote 30 page(s) from schema 2 at the current schema 3 (nothing embedded again; "
        "dropped the rows / cols vectors"
    ) in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["db"]
    store = open_store(db)
    assert store.schema == 3 and store.count() == 30 and store.has_tokens()
    assert {i: dict(p, schema=2) for i, p in store.payloads()} == payloads
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        after = store.search(queries, 5, "two-stage")
    assert [[(h.id, h.score) for h in r] for r in after] == [
        [(h.id, h.score) for h in r] for r in before
    ]
    assert set(store.points([points[0].id])[points[0].id].vectors) == {PAGE_VECTOR, MEAN_VECTOR}
    store.close()
    assert _disk(db / edge.SHARD_DIR) < size
    assert not upgrade_index(db)


def test_upgrade_refuses_a_folder_holding_files_colembed_did_not_write(tmp_path, monkeypatch):
    """The rewrite replaces the whole folder, so a file the user put there would go with it: the
    upgrade stops naming it, and the folder is left as it was (still schema 2, searchable)."""
    points = _points(5)
    db = tmp_path / "db"
    _schema_2_folder(db, monkeypatch, points)
    (db / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match=r"notes\.txt, which colembed did not write"):
        upgrade_index(db)
    assert (db / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["db"]  # no staging left
    store = open_store(db)
    assert store.schema == 2 and store.count() == 5
    assert (
        store.search([points[2].vectors[PAGE_VECTOR][3:9]], 1, "two-stage")[0][0].id == points[2].id
    )
    store.close()
    (db / "notes.txt").unlink()
    assert upgrade_index(db).rewritten == 5


def _disk(folder):
    return sum(f.stat().st_blocks for f in folder.rglob("*") if f.is_file())
