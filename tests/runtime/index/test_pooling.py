"""Hierarchical token pooling (pooling.py): equal to colpali-engine's `HierarchicalTokenPooler`
where colpali-engine is importable (it needs torch; installed with --no-deps, it is 0.3.13 that
imports beside transformers 4.57), what a pooled page is (the image tokens pooled, the prompt
rows and the rows / cols / mean vectors those of the unpooled page), and the pool factor as part
of an index's identity (a pooled index refuses pages pooled otherwise; an index written before
pooling is an unpooled one). The real tiny model indexes and searches a pooled index through the
CLI, reopening at its own pool factor.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from colembed.cli import main
from colembed.index import Index
from colembed.index.backends import open_store
from colembed.index.embedded import EmbeddedPage
from colembed.index.errors import ModelMismatchError
from colembed.index.maps import explain
from colembed.index.pooling import (
    CLUSTERS_FIELD,
    check_pool_factor,
    decode_clusters,
    encode_clusters,
    pool_tokens,
)
from colembed.index.schema import (
    COLS_VECTOR,
    MEAN_VECTOR,
    PAGE_VECTOR,
    ROWS_VECTOR,
    make_point,
)
from colembed.model import PageLayout
from tests.fixtures.documents import good_folder
from tests.fixtures.stores import IDENTITY, one_page_payload

DIM = 16
ROWS, COLS, START, TAIL = 6, 6, 2, 3


def _unit(x):
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _tokens(n: int, dim: int, seed: int) -> np.ndarray:
    return _unit(np.random.default_rng(seed).standard_normal((n, dim)))


def _local_page(seed: int, topic: np.ndarray | None = None) -> np.ndarray:
    """Prompt rows, a 6 x 6 grid of paper near one shared direction with a 3-token text block of
    `topic` (its own topic when None), then the prompt's closing rows."""
    rng = np.random.default_rng(seed)
    paper = _unit(np.random.default_rng(99).standard_normal(DIM))
    grid = paper + 0.2 * rng.standard_normal((ROWS, COLS, DIM)) / np.sqrt(DIM)
    block = _unit(rng.standard_normal(DIM)) if topic is None else topic
    grid[1, 1:4] = block + 0.05 * rng.standard_normal((3, DIM)) / np.sqrt(DIM)
    prompt = _unit(np.ones((START, DIM)))
    closing = _unit(np.arange(TAIL * DIM, dtype=np.float32).reshape(TAIL, DIM) + 1)
    return np.concatenate([prompt, _unit(grid.reshape(-1, DIM)), closing])


LAYOUT = PageLayout(
    grid_rows=ROWS,
    grid_cols=COLS,
    image_start=START,
    num_tokens=START + ROWS * COLS + TAIL,
    token_px=28,
)


def _payload(i: int, **identity) -> dict:
    return one_page_payload(i, 168, 168, **identity)


# ------------------------------------------------------------------------------- the pooler
@pytest.mark.parametrize(
    "n,dim,factor",
    [(744, 128, 2), (744, 128, 3), (100, 128, 3), (37, 64, 5), (2, 16, 2), (9, 16, 20)],
)
def test_pooling_equals_colpali_engines_hierarchical_token_pooler(n, dim, factor):
    torch = pytest.importorskip("torch")
    token_pooling = pytest.importorskip("colpali_engine.compression.token_pooling")
    x = _tokens(n, dim, seed=n + factor)
    ours, clusters = pool_tokens(x, factor)
    theirs = token_pooling.HierarchicalTokenPooler().pool_embeddings(
        [torch.from_numpy(x)], pool_factor=factor, return_dict=True
    )
    np.testing.assert_allclose(ours, theirs.pooled_embeddings[0].numpy(), atol=1e-6)
    # the same tokens in each cluster, clusters in the same order
    assert [tuple(np.flatnonzero(clusters == c)) for c in range(len(ours))] == [
        tuple(ix[0].tolist()) for ix in theirs.cluster_id_to_indices[0].values() if len(ix[0])
    ]


def test_pooled_rows_are_the_renormalised_means_of_their_tokens():
    x = np.concatenate([_local_page(1)[START : START + ROWS * COLS], _tokens(10, DIM, 2)])
    pooled, clusters = pool_tokens(x, 3)
    assert len(pooled) == len(x) // 3 and len(clusters) == len(x)
    assert set(clusters.tolist()) == set(range(len(pooled)))
    for c, row in enumerate(pooled):
        mean = x[clusters == c].mean(axis=0)
        np.testing.assert_allclose(row, mean / np.linalg.norm(mean), atol=1e-6)
    # the text block is its own cluster: the paper does not swallow it
    block = START + 1 * COLS + np.arange(1, 4) - START
    assert len(set(clusters[block].tolist())) == 1
    assert (clusters == clusters[block[0]]).sum() == 3
    same, ids = pool_tokens(x, 1)
    assert same is not None and np.array_equal(same, x) and np.array_equal(ids, np.arange(len(x)))


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_a_pool_factor_is_an_integer_of_at_least_one(bad):
    with pytest.raises(ValueError, match="pool factor must be an integer >= 1"):
        check_pool_factor(bad)


def test_clusters_survive_their_payload_encoding():
    clusters = np.array([0, 3, 370, 1, 2, 2])
    assert np.array_equal(decode_clusters(encode_clusters(clusters)), clusters)


# ----------------------------------------------------------------------------- a pooled page
def test_a_pooled_point_pools_only_the_image_tokens():
    page = _local_page(3)
    plain = make_point(page, LAYOUT, _payload(3))
    pooled = make_point(page, LAYOUT, _payload(3, pool_factor=2))
    stored = pooled.vectors[PAGE_VECTOR]
    assert CLUSTERS_FIELD not in plain.payload and len(plain.vectors[PAGE_VECTOR]) == len(page)
    assert len(stored) == START + ROWS * COLS // 2 + TAIL
    np.testing.assert_array_equal(stored[:START], page[:START])
    np.testing.assert_array_equal(stored[-TAIL:], page[-TAIL:])
    expected, clusters = pool_tokens(page[LAYOUT.image_rows], 2)
    np.testing.assert_array_equal(stored[START:-TAIL], expected)
    assert np.array_equal(decode_clusters(pooled.payload[CLUSTERS_FIELD]), clusters)
    for name in (ROWS_VECTOR, COLS_VECTOR, MEAN_VECTOR):  # the cheap stages see the full page
        np.testing.assert_array_equal(pooled.vectors[name], plain.vectors[name])
    assert pooled.id == plain.id


def test_the_map_of_a_pooled_page_covers_its_grid_and_sums_to_the_score():
    rng = np.random.default_rng(7)
    topic = _unit(rng.standard_normal(DIM))
    point = make_point(_local_page(4, topic), LAYOUT, _payload(4, pool_factor=3))
    query = _unit(topic + 0.05 * rng.standard_normal((3, DIM)))
    page, clusters = point.vectors[PAGE_VECTOR], decode_clusters(point.payload[CLUSTERS_FIELD])
    smap = explain(query, page, LAYOUT, clusters)
    maxsim = float((query @ page.T).max(axis=1).sum())
    assert smap.contribution.shape == (ROWS, COLS)
    assert smap.score == pytest.approx(maxsim, rel=1e-6)
    assert smap.contribution.sum() + smap.prompt_contribution == pytest.approx(maxsim, rel=1e-5)
    assert smap.hottest_token()[0] == 1 and 1 <= smap.hottest_token()[1] <= 3  # the block


# ---------------------------------------------------------------------------- index identity
def test_the_pool_factor_is_part_of_the_index_identity(tmp_path):
    rng = np.random.default_rng(11)
    topic = _unit(rng.standard_normal(DIM))
    pages = [_local_page(i, topic if i == 5 else None) for i in range(12)]
    given = [
        EmbeddedPage(f"/docs/{i}.pdf", 1, v, (ROWS, COLS), START, sha256=f"{i:064x}", token_px=28)
        for i, v in enumerate(pages)
    ]
    open_store(tmp_path / "db", dim=DIM).close()
    with Index(tmp_path / "db", pool_factor=2) as index:
        assert index.add_embedded(given, identity=IDENTITY) == len(pages)
        query = _unit(topic + 0.05 * rng.standard_normal((2, DIM)))
        [hit] = index.store.search([query], 1, "exact")[0]
        stored = index.store.page_vectors([hit.id])[hit.id]
        assert hit.payload["path"] == "/docs/5.pdf" and hit.payload["pool_factor"] == 2
        assert len(stored) == START + ROWS * COLS // 2 + TAIL
        assert hit.score == pytest.approx(float((query @ stored.T).max(axis=1).sum()), rel=1e-4)
        assert index.store.has_tokens()  # the centroid table holds the pooled pages
        [fast] = index.store.search([query], 1, "two-stage")[0]
        assert fast.id == hit.id and fast.score == pytest.approx(hit.score, rel=1e-5)
    with Index(tmp_path / "db") as reopened:
        assert reopened.pool_factor == 2  # reopened at its own factor
        with pytest.raises(ModelMismatchError, match="pool_factor: the index has 2, these pages 1"):
            reopened.add_embedded(given[:1], identity=dict(IDENTITY, pool_factor=1))
    with pytest.raises(ModelMismatchError, match="pooled with pool factor 2.*not 3"):
        Index(tmp_path / "db", pool_factor=3)
    with Index(tmp_path / "db", pool_factor=2) as same:
        assert len(same) == len(pages)


def test_an_index_written_before_pooling_is_an_unpooled_one(tmp_path):
    store = open_store(tmp_path / "db", dim=DIM)
    old = make_point(_local_page(1), LAYOUT, _payload(1))  # no pool_factor: colembed <= 0.3
    old.payload.pop("pool_factor", None)
    store.upsert([old])
    store.close()
    with Index(tmp_path / "db", pool_factor=1) as index:
        assert index.pool_factor == 1
        page = EmbeddedPage(
            "/docs/2.pdf", 1, _local_page(2), (ROWS, COLS), START, sha256="2" * 64, token_px=28
        )
        assert index.add_embedded([page]) == 1
    with pytest.raises(ModelMismatchError, match="pool factor 1 .*not 2"):
        Index(tmp_path / "db", pool_factor=2)


# ------------------------------------------------------------------------ the real model, CLI
def test_cli_builds_searches_and_reopens_a_pooled_index(tmp_path, exported_tiny, capsys):
    good_folder(tmp_path / "docs")
    common = ["--db", str(tmp_path / "db"), "--max-image-tokens", "64", "--quiet"]
    assert (
        main(
            [
                "index",
                str(tmp_path / "docs"),
                "--model",
                str(exported_tiny.folder),
                "--pool-factor",
                "3",
                *common,
            ]
        )
        == 0
    )
    capsys.readouterr()
    with Index(tmp_path / "db") as index:
        points = index.store.points([pid for pid, _ in index.store.payloads()])
        for p in points.values():
            rows, cols = p.payload["grid"]
            clusters = decode_clusters(p.payload[CLUSTERS_FIELD])
            assert p.payload["pool_factor"] == 3 and len(clusters) == rows * cols
            assert clusters.max() + 1 == (rows * cols) // 3
            assert len(p.vectors[PAGE_VECTOR]) < p.payload["image_start"] + rows * cols
        hits = index.search("the memo", k=2, explain=True)
        assert hits[0].map.contribution.shape == tuple(hits[0].payload["grid"])
        assert hits[0].map.score == pytest.approx(hits[0].score, rel=1e-3)
    assert main(["search", "the memo", "-k", "1", "--json", *common]) == 0
    assert json.loads(capsys.readouterr().out)[0]["hits"][0]["rank"] == 1
    code = main(["index", str(tmp_path / "docs"), "--pool-factor", "2", *common])
    assert code == 1 and "pool factor 3" in capsys.readouterr().err
    assert main(["index", str(tmp_path / "docs"), *common]) == 0  # its own factor: all stored
    assert "added 0 page(s)" in capsys.readouterr().out
