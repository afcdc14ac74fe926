"""Similarity maps: the MaxSim split is exact, lands on the token whose content matches, and the
overlay paints exactly that token's pixels of the page (geometry by construction)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

import colembed
from colembed.index import Index
from colembed.index.maps import explain, overlay, token_mask
from colembed.model import PageLayout
from index_docs import write_pdf

LAYOUT = PageLayout(grid_rows=5, grid_cols=7, image_start=3, num_tokens=3 + 35 + 4, token_px=28)


def _unit(x):
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _page_and_query(row: int, col: int):
    """A page whose token (row, col) carries the query's content, every other row unrelated."""
    rng = np.random.default_rng(0)
    page = _unit(rng.standard_normal((LAYOUT.num_tokens, 64)))
    query = _unit(rng.standard_normal((3, 64)))
    target = LAYOUT.image_start + row * LAYOUT.grid_cols + col
    page[target] = _unit(query.sum(axis=0))
    return page, query


@pytest.mark.parametrize("row,col", [(0, 0), (2, 5), (4, 6)])
def test_contribution_peaks_on_the_matching_token_and_sums_to_the_score(row, col):
    page, query = _page_and_query(row, col)
    smap = explain(query, page, LAYOUT)
    assert smap.hottest_token() == (row, col)
    maxsim = float((query @ page.T).max(axis=1).sum())
    assert smap.contribution.sum() + smap.prompt_contribution == pytest.approx(maxsim, rel=1e-6)
    assert smap.score == pytest.approx(maxsim, rel=1e-6)
    assert smap.similarity.shape == (5, 7) and smap.similarity[row, col] == smap.similarity.max()


@pytest.mark.parametrize("size", [(196, 140), (301, 250), (700, 333)])
def test_overlay_paints_exactly_the_tokens_box(size):
    page, query = _page_and_query(2, 5)
    smap = explain(query, page, LAYOUT)
    assert np.count_nonzero(smap.contribution) == 1  # every query token picked the same row
    white = Image.new("RGB", size, "white")
    painted = np.asarray(overlay(white, smap))
    changed = np.argwhere((painted != 255).any(axis=2))
    left, top, right, bottom = LAYOUT.token_box(2, 5, size)
    ys, xs = changed[:, 0] + 0.5, changed[:, 1] + 0.5  # pixel centres
    assert (xs > left).all() and (xs < right).all() and (ys > top).all() and (ys < bottom).all()
    inside = ((np.arange(size[0]) + 0.5 > left) & (np.arange(size[0]) + 0.5 < right)).sum() * \
             ((np.arange(size[1]) + 0.5 > top) & (np.arange(size[1]) + 0.5 < bottom)).sum()
    assert len(changed) == inside  # every pixel whose centre is in the box, and no other


def test_token_mask_assigns_every_pixel_to_the_box_holding_its_centre():
    size = (301, 250)
    mask = token_mask(LAYOUT, size)
    for r in range(LAYOUT.grid_rows):
        for c in range(LAYOUT.grid_cols):
            left, top, right, bottom = LAYOUT.token_box(r, c, size)
            ys, xs = np.nonzero(mask == r * LAYOUT.grid_cols + c)
            assert ((xs + 0.5 >= left) & (xs + 0.5 <= right) & (ys + 0.5 >= top) & (ys + 0.5 <= bottom)).all()


def test_search_explain_and_saved_overlay(tmp_path, exported_tiny):
    model = colembed.load(exported_tiny.folder, max_image_tokens=64)
    pdf = write_pdf(tmp_path / "doc.pdf", ["one", "two"])
    with Index(tmp_path / "db", model=model) as index:
        index.add([pdf])
        hits = index.search("where is page two?", k=2, explain=True)
        for hit in hits:
            grid = tuple(hit.payload["grid"])
            assert hit.map.contribution.shape == grid
            assert hit.map.score == pytest.approx(hit.score, rel=1e-3)  # float16 storage
            saved = Image.open(index.save_map(hit, tmp_path / "maps" / f"{hit.page}.png"))
            assert saved.size == (hit.payload["width"], hit.payload["height"])


def test_overlay_falls_back_to_similarity_when_the_prompt_takes_the_whole_score():
    rng = np.random.default_rng(1)
    page = _unit(rng.standard_normal((LAYOUT.num_tokens, 64)))
    query = _unit(rng.standard_normal((2, 64)))
    page[0] = _unit(query.sum(axis=0)) * 1.0  # a prompt row beats every image token
    page[LAYOUT.image_start + 8] = _unit(query.sum(axis=0) + 0.5 * page[LAYOUT.image_start + 8])
    smap = explain(query, page, LAYOUT)
    assert not smap.contribution.any() and smap.hottest_token() == (0, 0)
    painted = np.asarray(overlay(Image.new("RGB", (196, 140), "white"), smap)).astype(int)
    tint = 255 - painted[..., 1]
    left, top, right, bottom = (int(v) for v in LAYOUT.token_box(1, 1, (196, 140)))
    assert tint[top:bottom, left:right].min() == tint.max() > 0  # token 8 = (1, 1) is strongest
