"""Similarity maps: the MaxSim split is exact, lands on the token whose content matches, and the
overlay paints that token's pixels of the page: checked against places known by construction (a
token's 28-pixel square at the model's own size; a square planted on a page and embedded by the
real model), never against the layout's own `token_box` arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

import colembed
from colembed.index import Index
from colembed.index.maps import explain, overlay
from colembed.model import PageLayout
from tests.fixtures.documents import page, write_pdf

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


def test_overlay_at_the_models_own_size_paints_the_tokens_28_pixel_square():
    """At the resized size (7 x 28 by 5 x 28 px) token (2, 5) saw exactly x 140-168, y 56-84."""
    page, query = _page_and_query(2, 5)
    smap = explain(query, page, LAYOUT)
    assert np.count_nonzero(smap.contribution) == 1  # every query token picked the same row
    painted = np.asarray(overlay(Image.new("RGB", (196, 140), "white"), smap))
    changed = (painted != 255).any(axis=2)
    assert changed[56:84, 140:168].all() and changed.sum() == 28 * 28


# (left, top, right, bottom) of a black square planted on a white 400 x 520 page
PLANTED = [(40, 60, 110, 130), (250, 300, 330, 380), (300, 40, 380, 100)]


@pytest.fixture(scope="module")
def model_64(exported_tiny):
    return colembed.load(exported_tiny.folder, max_image_tokens=64)


@pytest.mark.parametrize("box", PLANTED)
def test_a_map_lands_on_content_planted_on_the_page(model_64, box):
    """Through the real model: the page row that a planted square changes most (against the same
    page without it) is the map's hottest cell, and the overlay paints it over the square.

    The place is known from the drawing, not from the layout's arithmetic, so a wrong token order
    (rows for columns), image-row offset or scaling to the page's size puts the paint elsewhere."""
    size = (400, 520)
    (planted, layout), (blank, _) = model_64.embed_pages([page("", size, box=box), page("", size)])
    change = np.linalg.norm(planted[layout.image_rows] - blank[layout.image_rows], axis=1)
    query = planted[layout.image_rows][[int(change.argmax())]]  # what the square turned into
    smap = explain(query, planted, layout)
    painted = np.argwhere(
        (np.asarray(overlay(Image.new("RGB", size, "white"), smap)) != 255).any(axis=2)
    )
    left, top, right, bottom = box
    y, x = painted.mean(axis=0) + 0.5
    assert left < x < right and top < y < bottom  # the painted cell's centre is on the square
    # and it is one cell: no wider than a token of this page (its share of the page's sides)
    cell_w, cell_h = size[0] / layout.grid_cols, size[1] / layout.grid_rows
    assert np.ptp(painted[:, 1]) < cell_w + 1 and np.ptp(painted[:, 0]) < cell_h + 1


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
    # token 8 = (1, 1), at the model's own size x 28-56, y 28-56, is the strongest
    assert tint[28:56, 28:56].min() == tint.max() > 0
