"""Similarity maps: where on a page a query's MaxSim score comes from.

MaxSim is `score = sum_i max_j q_i . p_j` over query tokens i and page rows j. Each query token's
best row takes that token's term, so the score splits exactly into per-row contributions
`contribution_j = sum over the i whose best row is j of q_i . p_j` (the contributions sum to the
score). `explain` returns that split over the page's image-token grid, the part of the score that
went to non-image rows (the prompt), and a dense view (`similarity`: each token's best match with
any query token). `overlay` paints the contribution grid onto the page image through the model's
geometry (`PageLayout.token_box`: token (r, c) saw a 28-pixel square of the resized page, and the
resize stretches the whole page).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

OVERLAY_COLOR = (255, 40, 0)
OVERLAY_MAX_ALPHA = 0.6


@dataclass(frozen=True)
class SimilarityMap:
    """contribution, similarity: (grid_rows, grid_cols) float32; see the module docstring."""

    score: float
    contribution: np.ndarray
    similarity: np.ndarray
    prompt_contribution: float
    layout: object  # colembed.model.PageLayout

    def hottest_token(self) -> tuple[int, int]:
        r, c = np.unravel_index(int(np.argmax(self.contribution)), self.contribution.shape)
        return int(r), int(c)


def explain(
    query: np.ndarray, page: np.ndarray, layout, clusters: np.ndarray | None = None
) -> SimilarityMap:
    """Split the MaxSim score of `query` (Lq, d) against `page` (Lp, d) over the page's rows.
    A page stored pooled (pooling.py) gives `clusters` (per grid cell, its pooled row): a cell
    then shows its pooled row's similarity, and a pooled row's contribution is shared equally by
    its cells (the map still sums to the score)."""
    sims = query.astype(np.float32) @ page.astype(np.float32).T  # (Lq, Lp)
    best = sims.argmax(axis=1)
    per_row = np.zeros(page.shape[0], dtype=np.float64)
    np.add.at(per_row, best, sims[np.arange(len(best)), best])
    grid = (layout.grid_rows, layout.grid_cols)
    if clusters is None:
        rows = layout.image_rows
        image_part = per_row[rows]
        contribution, similarity = image_part, sims[:, rows].max(axis=0)
    else:
        start = layout.image_start
        pooled = slice(start, start + int(clusters.max()) + 1)
        image_part = per_row[pooled]
        share = np.bincount(clusters, minlength=pooled.stop - start)
        contribution = (image_part / share)[clusters]
        similarity = sims[:, pooled].max(axis=0)[clusters]
    return SimilarityMap(
        score=float(per_row.sum()),
        contribution=contribution.reshape(grid).astype(np.float32),
        similarity=similarity.reshape(grid).astype(np.float32),
        prompt_contribution=float(per_row.sum() - image_part.sum()),
        layout=layout,
    )


def token_mask(layout, image_size: tuple[int, int]) -> np.ndarray:
    """(height, width) int array: the index r * grid_cols + c of the token that saw each pixel
    (pixel centres assigned by `token_box`)."""
    width, height = image_size
    rw, rh = layout.resized_size
    cols = np.minimum(
        ((np.arange(width) + 0.5) * rw / width) // layout.token_px, layout.grid_cols - 1
    ).astype(np.int64)
    rows = np.minimum(
        ((np.arange(height) + 0.5) * rh / height) // layout.token_px, layout.grid_rows - 1
    ).astype(np.int64)
    return rows[:, None] * layout.grid_cols + cols[None, :]


def overlay(image: Image.Image, smap: SimilarityMap) -> Image.Image:
    """The page with each token's box tinted in proportion to its share of the score.

    When no query token's best match is an image token (the whole score comes from the prompt
    rows, as with random weights), the dense `similarity` map is painted instead, rescaled to
    its own range, so the overlay still shows which regions came closest."""
    values = np.clip(smap.contribution.ravel(), 0, None).astype(np.float64)
    if not values.any():
        values = smap.similarity.ravel().astype(np.float64)
        values = values - values.min()
    peak = float(values.max())
    if peak > 0:
        values = values / peak
    alpha = values[token_mask(smap.layout, image.size)] * OVERLAY_MAX_ALPHA
    base = np.asarray(image.convert("RGB"), dtype=np.float32)
    tint = np.array(OVERLAY_COLOR, dtype=np.float32)
    mixed = base * (1 - alpha[..., None]) + tint * alpha[..., None]
    return Image.fromarray(np.rint(mixed).astype(np.uint8))
