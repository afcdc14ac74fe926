"""The token stage (tokens.py, plan.py) and pages embedded elsewhere (embedded.py).

The local-answer case is built small: 40 pages of background tokens near one shared direction,
each with one text block of its own; the needle page's block is what the query is about, and a
dozen distractor pages lean faintly toward the query with every token, so their mean vectors beat
the needle's. The mean-gated schema-2 plan (shrunk limits) then never lets the needle reach the
rerank; the token plan (shrunk the same way) must.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from colembed.cli import main
from colembed.errors import InputError
from colembed.index import Index
from colembed.index.edge import TOKENS_DIR, upgrade_index
from colembed.index.embedded import EmbeddedPage
from colembed.index.schema import PAGE_VECTOR, make_point
from colembed.index.backends import open_store
from colembed.index.errors import ModelMismatchError, OldIndexWarning, StoreError
from colembed.index.tokens import TokenTable, centroid_scores, page_centroids
from colembed.model import PageLayout
from tests.fixtures.stores import IDENTITY as STORE_IDENTITY, one_page_payload, set_plan_limits

DIM = 16
ROWS, COLS, START = 6, 6, 2
N_PAGES, NEEDLE, DISTRACTORS = 40, 23, range(0, 12)


def _unit(x):
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _world():
    rng = np.random.default_rng(5)
    background, answer = _unit(rng.standard_normal(DIM)), _unit(rng.standard_normal(DIM))
    answer = _unit(answer - (answer @ background) * background)  # the answer is not paper
    return rng, background, answer


def _local_pages():
    rng, background, answer = _world()
    pages = []
    for i in range(N_PAGES):
        grid = background + 0.2 * rng.standard_normal((ROWS, COLS, DIM)) / np.sqrt(DIM)
        topic = answer if i == NEEDLE else _unit(rng.standard_normal(DIM))
        grid[1, 1:4] = topic + 0.1 * rng.standard_normal((3, DIM)) / np.sqrt(DIM)  # 3 of 36
        if i in DISTRACTORS:
            grid = grid + 0.35 * answer  # every token a little toward the query: a high mean
        prompt = _unit(np.ones((START, DIM)))
        pages.append(np.concatenate([prompt, _unit(grid.reshape(-1, DIM))]))
    query = _unit(answer + 0.05 * rng.standard_normal((3, DIM)) / np.sqrt(DIM))
    return pages, query


LAYOUT = PageLayout(
    grid_rows=ROWS, grid_cols=COLS, image_start=START, num_tokens=START + ROWS * COLS, token_px=28
)


def _payload(i: int) -> dict:
    return one_page_payload(i, 168, 168, schema=2)


@pytest.fixture
def small_plans(monkeypatch):
    set_plan_limits(
        monkeypatch,
        MEAN_CANDIDATES=3,
        MEAN_POOL=8,
        POOLED_CANDIDATES=2,
        TOKEN_CANDIDATES=3,
        TOKEN_MEAN_CANDIDATES=2,
    )


def _schema_2_store(path, monkeypatch):
    """A new Edge folder at schema 2 (rows / cols stored: what colembed 0.4 wrote), which the
    mean-gated plan can run on."""
    from colembed.index import edge

    with monkeypatch.context() as m:
        m.setattr(edge, "SCHEMA_VERSION", 2)
        store = open_store(path, dim=DIM)
    assert store.schema == 2
    return store


def test_the_token_plan_finds_a_local_answer_the_mean_gated_plan_misses(
    tmp_path, small_plans, monkeypatch
):
    pages, query = _local_pages()
    store = _schema_2_store(tmp_path / "db", monkeypatch)
    points = [make_point(v, LAYOUT, _payload(i)) for i, v in enumerate(pages)]
    store.upsert(points)
    needle = points[NEEDLE].id
    (exact,) = store.search([query], 3, "exact")
    assert exact[0].id == needle
    assert store.has_tokens()
    (fast,) = store.search([query], 3, "two-stage")
    assert fast[0].id == needle and fast[0].score == pytest.approx(exact[0].score, rel=1e-5)
    store.use_tokens = False  # the schema-2 plan: the mean gates the rows / cols pool
    (gated,) = store.search([query], 3, "two-stage")
    assert needle not in {h.id for h in gated}
    store.close()


def test_centroids_keep_a_small_block_apart_from_the_background():
    pages, query = _local_pages()
    c = page_centroids(pages[NEEDLE][START:], 4)
    assert c.shape == (4, DIM) and np.allclose(np.linalg.norm(c, axis=1), 1, atol=1e-5)
    scores = centroid_scores(np.stack([page_centroids(p[START:], 4) for p in pages]), query)
    assert int(np.argmax(scores)) == NEEDLE


def test_token_table_newest_row_wins_deletes_and_ignores_a_torn_write(tmp_path):
    table = TokenTable(tmp_path, DIM, k=2)
    ids = [f"00000000-0000-0000-0000-00000000000{i}" for i in range(3)]
    rows = [_unit(np.full((2, DIM), i + 1.0) * np.eye(DIM)[i]) for i in range(3)]
    table.append(ids, rows)
    table.append(ids[:1], [rows[2]])  # id 0 now looks like id 2
    table.delete(ids[1:2])
    with open(tmp_path / "tokens.f32", "ab") as f:  # a crash after the table, before the ids
        f.write(np.zeros((2, DIM), np.float32).tobytes())
    again = TokenTable(tmp_path, DIM, k=2)
    assert sorted(again.ids()) == sorted([ids[0], ids[2]])
    assert set(again.top(rows[2][:1], 2)) == {ids[0], ids[2]}
    assert again.top(rows[1][:1], 1) != [ids[1]]


def test_a_schema_2_folder_without_a_token_table_warns_and_upgrade_rewrites_it(
    tmp_path, small_plans, monkeypatch
):
    pages, query = _local_pages()
    store = _schema_2_store(tmp_path / "db", monkeypatch)
    store.upsert([make_point(v, LAYOUT, _payload(i)) for i, v in enumerate(pages)])
    store.close()
    for f in (tmp_path / "db" / TOKENS_DIR).iterdir():  # as a folder of colembed 0.2 has it
        f.unlink()
    store = open_store(tmp_path / "db")
    with pytest.warns(OldIndexWarning, match="token table.*mean-gated.*colembed upgrade"):
        (gated,) = store.search([query], 3, "two-stage")
    assert f"{NEEDLE:064x}" not in {h.payload["sha256"] for h in gated}
    store.close()
    done = upgrade_index(tmp_path / "db")  # schema 3: rows / cols dropped, the table made anew
    assert (done.rewritten, done.old_schema, done.dropped) == (N_PAGES, 2, ("rows", "cols"))
    store = open_store(tmp_path / "db")
    assert store.schema == 3 and store.has_tokens()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (hits,) = store.search([query], 3, "two-stage")
    assert hits[0].payload["sha256"] == f"{NEEDLE:064x}" and store.count() == N_PAGES
    store.close()
    assert not upgrade_index(tmp_path / "db")


def test_a_schema_3_folder_without_its_token_table_searches_by_the_mean_and_warns(
    tmp_path, small_plans
):
    """A schema-3 folder has no rows / cols for the mean-gated plan: with its table gone (or not
    matching after a kill) it searches with the table it has and the `mean` vector, says so, and
    `colembed upgrade` rebuilds the table."""
    query = _folder_without_its_table(tmp_path / "db")
    store = open_store(tmp_path / "db")
    with pytest.warns(OldIndexWarning, match="token table.*mean vector only.*colembed upgrade"):
        (hits,) = store.search([query], 3, "two-stage")
    (every,) = store.search([query], N_PAGES, "exact")
    exact = every[:3]
    assert [h.score for h in hits] == pytest.approx(  # exact scores of the pages the mean found
        [next(e.score for e in every if e.id == h.id) for h in hits], rel=1e-5
    )
    assert f"{NEEDLE:064x}" not in {h.payload["sha256"] for h in hits}  # the mean ranks it low
    assert not store.has_tokens()
    store.close()
    assert upgrade_index(tmp_path / "db").tokens_rebuilt == N_PAGES
    store = open_store(tmp_path / "db")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (hits,) = store.search([query], 3, "two-stage")
    assert hits[0].id == exact[0].id and hits[0].payload["sha256"] == f"{NEEDLE:064x}"
    store.close()


def _folder_without_its_table(db):
    """A new (schema-3) folder of the local pages whose token table files were deleted; the
    query."""
    pages, query = _local_pages()
    store = open_store(db, dim=DIM)
    store.upsert([make_point(v, LAYOUT, _payload(i)) for i, v in enumerate(pages)])
    store.close()
    for f in (db / TOKENS_DIR).iterdir():
        f.unlink()
    return query


def test_upgrade_says_it_rebuilt_the_table_and_not_that_it_rewrote_pages(tmp_path, capsys):
    _folder_without_its_table(tmp_path / "db")
    assert main(["upgrade", "--db", str(tmp_path / "db"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"rebuilt the token table of {N_PAGES} page(s)" in out and "rewrote" not in out
    assert main(["upgrade", "--db", str(tmp_path / "db"), "--quiet"]) == 0
    assert "already at the current schema" in capsys.readouterr().out


def test_a_table_of_the_right_size_but_other_pages_is_not_current(tmp_path):
    pages, query = _local_pages()
    store = open_store(tmp_path / "db", dim=DIM)
    points = [make_point(v, LAYOUT, _payload(i)) for i, v in enumerate(pages)]
    store.upsert(points)
    store.close()
    # a page gone from the table and another's row in it only (as a kill between the shard
    # write and the table write of a replacement can leave it): the counts still agree
    table = TokenTable(tmp_path / "db" / TOKENS_DIR, DIM)
    table.delete([points[NEEDLE].id])
    table.append(["00000000-0000-0000-0000-0000000000aa"], [np.zeros((16, DIM), np.float32)])
    store = open_store(tmp_path / "db")
    assert len(store.tokens) == store.count()
    with pytest.warns(OldIndexWarning, match="token table"):
        assert not store.has_tokens()
    store.close()
    assert upgrade_index(tmp_path / "db").tokens_rebuilt == N_PAGES
    store = open_store(tmp_path / "db")
    assert (
        store.has_tokens() and store.search([query], 1, "two-stage")[0][0].id == points[NEEDLE].id
    )
    store.close()


def test_a_mostly_dead_table_is_compacted_on_open_and_a_killed_compaction_undone(tmp_path):
    from colembed.index.tokens import COMPACTING, SET_ASIDE, TABLE_FILE

    pages, query = _local_pages()
    store = open_store(tmp_path / "db", dim=DIM)
    points = [make_point(v, LAYOUT, _payload(i)) for i, v in enumerate(pages)]
    for _ in range(3):  # the same pages stored again: their older rows are dead
        store.upsert(points)
    store.delete([p.id for p in points[:4]])
    table = tmp_path / "db" / TOKENS_DIR / TABLE_FILE
    row = 16 * DIM * 4
    assert table.stat().st_size == (3 * N_PAGES + 4) * row
    store.close()
    store = open_store(tmp_path / "db")
    assert table.stat().st_size == (N_PAGES - 4) * row  # the live rows only
    assert (
        store.has_tokens() and store.search([query], 1, "two-stage")[0][0].id == points[NEEDLE].id
    )
    store.close()
    # a kill between the compaction's two renames: the old table is aside, the folder missing
    folder = tmp_path / "db" / TOKENS_DIR
    aside = folder.with_name(folder.name + SET_ASIDE)
    folder.rename(aside)
    (folder.with_name(folder.name + COMPACTING)).mkdir()
    store = open_store(tmp_path / "db")
    assert store.has_tokens() and not aside.exists()
    assert not folder.with_name(folder.name + COMPACTING).exists()
    store.close()


IDENTITY = dict(STORE_IDENTITY, schema=2)


def test_add_embedded_stores_pages_as_add_would_and_names_a_bad_one(tmp_path):
    pages, query = _local_pages()
    store = open_store(tmp_path / "db", dim=DIM)
    store.close()
    given = [
        EmbeddedPage(f"/docs/{i}.pdf", 1, v, (ROWS, COLS), START, sha256=f"{i:064x}", token_px=28)
        for i, v in enumerate(pages)
    ]
    with Index(tmp_path / "db") as index:
        bad = EmbeddedPage(
            "/docs/bad.pdf", 2, pages[0][:, :8], (ROWS, COLS), START, pages=3, sha256="0" * 64
        )
        with pytest.raises(InputError, match="bad.pdf page 2.*16-d"):
            index.add_embedded([*given[:3], bad], identity=IDENTITY)
        assert len(index) == 0  # every page is checked before any is stored
        with pytest.raises(InputError, match="does not fit"):
            index.add_embedded(
                [EmbeddedPage("/d.pdf", 1, pages[0], (7, 7), START, sha256="1")], identity=IDENTITY
            )
        assert index.add_embedded(given, identity=IDENTITY) == N_PAGES
        hits = index.store.search([query], 1, "exact")[0]
        assert hits[0].payload["path"] == f"/docs/{NEEDLE}.pdf"
        assert hits[0].payload["grid"] == [ROWS, COLS] and hits[0].payload["model"] == "m"
        other = dict(IDENTITY, manifest_sha256="other")
        with pytest.raises(ModelMismatchError, match="manifest_sha256"):
            index.add_embedded(given[:1], identity=other)
        assert index.add_embedded(given[:2]) == 2  # the stored identity, again: idempotent
        assert len(index) == N_PAGES


def test_table_ids_are_the_canonical_uuid_strings():
    import uuid

    from colembed.index.tokens import _uuid_strings

    ids = [uuid.uuid4() for _ in range(50)] + [uuid.UUID(int=0), uuid.UUID(int=2**128 - 1)]
    raw = np.frombuffer(b"".join(u.bytes for u in ids), np.uint8).reshape(-1, 16)
    assert _uuid_strings(raw) == [str(u) for u in ids]
    assert _uuid_strings(raw[:0]) == []


def test_add_embedded_takes_the_token_size_from_the_model_not_a_constant(tmp_path):
    """A page's rendered size follows its model's patch x merge (ColQwen3: 16 x 2 = 32 px a
    token), which the manifest declares; with neither a size, a token_px nor a model it is
    refused rather than guessed at ColQwen2's 28."""
    from types import SimpleNamespace

    pages, _ = _local_pages()
    open_store(tmp_path / "db", dim=DIM).close()

    def page(i, **kw):
        return EmbeddedPage(
            f"/docs/{i}.pdf", 1, pages[i], (ROWS, COLS), START, sha256=f"{i:064x}", **kw
        )

    with Index(tmp_path / "db") as index:
        with pytest.raises(InputError, match="0.pdf page 1: its rendered size is not known"):
            index.add_embedded([page(0)], identity=IDENTITY)
        index.add_embedded([page(0, token_px=32), page(1, size=(500, 700))], identity=IDENTITY)
        # the index's model declares its token size (a loaded model's preprocessing config)
        index._model = SimpleNamespace(config=SimpleNamespace(resize_factor=32))
        index.add_embedded([page(2)], identity=IDENTITY)
        sizes = {p["path"]: (p["width"], p["height"]) for _, p in index.store.payloads()}
    assert sizes == {
        "/docs/0.pdf": (COLS * 32, ROWS * 32),
        "/docs/1.pdf": (500, 700),
        "/docs/2.pdf": (COLS * 32, ROWS * 32),
    }


def test_from_parquet_loads_what_the_ray_target_writes(tmp_path, capsys):
    pq = pytest.importorskip("pyarrow.parquet")
    from colembed.distributed.targets import _table

    pages, query = _local_pages()
    points = [make_point(v, LAYOUT, _payload(i)) for i, v in enumerate(pages)]
    (tmp_path / "pq").mkdir()
    pq.write_table(_table(points[:25], DIM), tmp_path / "pq" / "part-a.parquet")
    pq.write_table(_table(points[20:], DIM), tmp_path / "pq" / "part-b.parquet")  # overlap
    assert (
        main(
            [
                "index",
                "--from-parquet",
                str(tmp_path / "pq"),
                "--db",
                str(tmp_path / "db"),
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out) == {"added_pages": N_PAGES, "pages": N_PAGES}
    store = open_store(tmp_path / "db")
    (hits,) = store.search([query], 1, "two-stage")
    assert hits[0].id == points[NEEDLE].id
    stored = store.points([points[3].id])[points[3].id]
    np.testing.assert_allclose(
        stored.vectors[PAGE_VECTOR], points[3].vectors[PAGE_VECTOR], atol=2e-3
    )
    assert store.has_tokens()
    store.close()


def test_a_clean_close_lets_the_next_open_skip_listing_ids_and_any_write_takes_that_back(
    tmp_path, monkeypatch
):
    """Listing every page's id to check the table costs seconds at 100,000 pages; a clean close
    that found the table current marks it, and the next open trusts the mark while the folder
    is as the close left it. A write (here a killed run's: no close) removes the mark first."""
    from colembed.index import edge

    pages, query = _local_pages()
    db = tmp_path / "db"
    store = open_store(db, dim=DIM)
    points = [make_point(v, LAYOUT, _payload(i)) for i, v in enumerate(pages)]
    store.upsert(points[:-1])
    store.close()
    assert (db / TOKENS_DIR / edge.VERIFIED_FILE).is_file()

    listed = []
    real_ids = edge.EdgeStore.ids
    monkeypatch.setattr(edge.EdgeStore, "ids", lambda self: listed.append(1) or real_ids(self))
    store = open_store(db)
    assert store.has_tokens() and not listed  # trusted the mark
    store.upsert(points[-1:])  # the first write of this open drops the mark before writing
    assert not (db / TOKENS_DIR / edge.VERIFIED_FILE).exists()
    store._finalizer.detach()  # a kill: nothing closes the shard or writes a mark
    store.lock.release()
    store.shard.close()
    store = open_store(db)
    assert listed and store.has_tokens() and store.count() == N_PAGES  # compared ids again
    assert store.search([query], 1, "two-stage")[0][0].id == points[NEEDLE].id
    store.close()


def test_a_mark_that_no_longer_describes_the_folder_is_not_trusted(tmp_path):
    pages, _ = _local_pages()
    db = tmp_path / "db"
    store = open_store(db, dim=DIM)
    store.upsert([make_point(v, LAYOUT, _payload(i)) for i, v in enumerate(pages)])
    store.close()
    # the table changed behind the mark's back (rows appended): sizes differ, ids are compared
    TokenTable(db / TOKENS_DIR, DIM).append(
        ["00000000-0000-0000-0000-0000000000bb"], [np.zeros((16, DIM), np.float32)]
    )
    store = open_store(db)
    with pytest.warns(OldIndexWarning, match="token table"):
        assert not store.has_tokens()
    store.close()
    from colembed.index.edge import VERIFIED_FILE

    assert not (db / TOKENS_DIR / VERIFIED_FILE).exists()  # not current at close: no mark


def test_a_batch_of_queries_is_scanned_in_one_pass_with_each_querys_own_scores():
    """centroid_scores_many: per query, the sum over its tokens of the best centroid's dot product,
    whatever the batch, the thread count or the chunking (pages past a chunk's and a thread's
    share included)."""
    from colembed.index import tokens

    rng = np.random.default_rng(3)
    table = _unit(rng.standard_normal((2 * tokens.SCAN_MIN_PAGES_PER_THREAD + 37, 4, DIM)))
    queries = [_unit(rng.standard_normal((n, DIM))) for n in (1, 5, 3)]
    want = np.stack([np.einsum("pkd,td->ptk", table, q).max(axis=2).sum(axis=1) for q in queries])
    for threads in (1, 2):
        got = tokens.centroid_scores_many(table, queries, threads=threads)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(centroid_scores(table, queries[1]), want[1], rtol=1e-5, atol=1e-5)
    assert tokens.centroid_scores_many(table, []).shape == (0, len(table))


def test_top_many_gives_each_query_the_pages_top_gives_it(tmp_path):
    rng = np.random.default_rng(4)
    table = TokenTable(tmp_path, DIM, k=2)
    ids = [f"00000000-0000-0000-0000-{i:012x}" for i in range(50)]
    table.append(ids, list(_unit(rng.standard_normal((50, 2, DIM)))))
    table.delete(ids[:5])  # dead rows are scanned but never returned
    queries = [_unit(rng.standard_normal((n, DIM))) for n in (2, 4)]
    many = table.top_many(queries, 7)
    assert many == [table.top(q, 7) for q in queries]
    assert all(len(m) == 7 and not set(m) & set(ids[:5]) for m in many)


def test_new_shards_store_no_rows_or_cols_and_a_folder_holding_them_in_ram_still_opens(
    tmp_path, monkeypatch, small_plans
):
    """New shards (schema 3) store the `page` vectors memory-mapped and the `mean` in RAM, and no
    rows / cols (the token plan never reads them); a schema-2 folder created with `rows` / `cols`
    in RAM (colembed before mapped rows / cols) opens, searches with the token plan, runs the
    mean-gated plan from them and keeps its storage (the open passes Edge no config, so nothing is
    rewritten). The mean-gated plan forced onto a new shard is refused, naming what it lacks."""
    from colembed.index import edge

    def needle_free(hits, needle):  # the fixture's distractors win the rows / cols pool
        return needle not in {h.id for h in hits}

    def vector_on_disk(db):
        config = json.loads((db / edge.SHARD_DIR / "edge_config.json").read_text())
        return {name: bool(v.get("on_disk")) for name, v in config["vectors"].items()}

    pages, query = _local_pages()
    points = [make_point(v, LAYOUT, _payload(i)) for i, v in enumerate(pages)]
    new = open_store(tmp_path / "new", dim=DIM)
    new.upsert(points)
    new.close()
    assert vector_on_disk(tmp_path / "new") == {"page": True, "mean": False}
    with monkeypatch.context() as m:
        m.setattr(edge, "MAPPED_VECTORS", (PAGE_VECTOR,))
        m.setattr(edge, "SCHEMA_VERSION", 2)
        old = open_store(tmp_path / "old", dim=DIM)
        old.upsert(points)
        old.close()
    assert vector_on_disk(tmp_path / "old")["rows"] is False
    for name in ("old", "new"):
        store = open_store(tmp_path / name)
        assert store.has_tokens() and store.schema == {"old": 2, "new": 3}[name]
        (hits,) = store.search([query], 3, "two-stage")
        (exact,) = store.search([query], 3, "exact")
        assert hits[0].id == exact[0].id == points[NEEDLE].id
        store.use_tokens = False  # the mean-gated plan reads rows / cols
        if name == "new":
            with pytest.raises(StoreError, match="reads the cols, rows vector.*schema 3"):
                store.search([query], 3, "two-stage")
        else:
            (gated,) = store.search([query], 3, "two-stage")
            assert len(gated) == 3 and needle_free(gated, points[NEEDLE].id)
        store.close()
    assert vector_on_disk(tmp_path / "old")["rows"] is False


def test_the_centroid_scan_computes_the_exact_scorers_maxsim():
    """The token stage keeps its own kernel (ARCHITECTURE.md, "Two MaxSim kernels"), but not its own
    definition: each page's centroids scored as a page by `colembed.score` give the scan's score."""
    from colembed import score
    from colembed.index import tokens

    rng = np.random.default_rng(5)
    table = _unit(rng.standard_normal((tokens.SCAN_CHUNK_PAGES + 9, tokens.CENTROIDS, DIM)))
    queries = [_unit(rng.standard_normal((n, DIM))) for n in (1, 7, 20)]
    exact = score(queries, list(table), backend="numpy")
    np.testing.assert_allclose(
        tokens.centroid_scores_many(table, queries), exact, rtol=1e-5, atol=1e-5
    )
