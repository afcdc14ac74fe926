"""Synthetic pages whose answer is local: mostly shared background plus a few text blocks.

What it models (the shape of a trained ColQwen2 page embedding, not its values):
- A page is a 26-30 x 25-29 grid of image tokens (~750) of dim 128 between the 15 prompt rows
  every page shares (synthetic_pages.shared_rows), L2-normalised as the model's output is.
- Most of the grid is background (blank paper, margins, layout): tokens near one direction shared
  by every page (cosine ~0.9 with it), with a small per-page offset and per-token noise, so the
  background of any two pages looks alike, as white paper does to a trained model.
- 3-6 text blocks per page, laid out on the grid without overlapping (2-6 rows x 6-16 columns:
  a paragraph, a table, a caption). A block has a topic drawn from a shared vocabulary of
  `TOPICS` (so many pages talk about the same thing) and each of its rows (a text line) has a
  direction of its own: token = topic + line + noise, with a little background mixed in.
- A query is about 1-2 rows of one block of one page (1-3% of the page's image tokens): its
  tokens are those rows' tokens with noise, plus the 10 query-independent augmentation rows every
  query carries (synthetic_pages.shared_rows). The page it was drawn from is the needle.

What it does not model: the language side of a real query (a trained query token is not a noisy
copy of a page token; exact MaxSim finds the needle here for every query, a trained model not
always); reading order, fonts, figures; pages with no text; near-duplicate pages (versions of one
report); how often a topic recurs in a real corpus (here each of the `TOPICS` topics is equally
likely, so at 100,000 pages a topic sits on ~200 pages). Rankings measured on it say which
search plans can find a local answer at all and at what cost; they are not a trained model's nDCG.
The page-wide-topic set (synthetic_pages.py) stays beside it: there the mean vector alone
finds the page, here it cannot.
"""

from __future__ import annotations

import numpy as np

from benchmarks.shared.synthetic_pages import DIM, framed_page, shared_rows, unit

TOPICS = 2000  # shared topic vocabulary
BLOCKS = (3, 7)  # blocks per page: 3..6
BACKGROUND_NOISE = (
    0.45  # per-token noise of a background token, relative to the direction (~0.9 cos)
)
PAGE_OFFSET = 0.15  # per-page shift of the background (scanner, paper, layout)
LINE_WEIGHT = 1.0  # a text line's own direction against its block's topic (1.0)
TOKEN_NOISE = 0.6  # per-token noise of a text token
QUERY_NOISE = 0.3  # noise added to the page tokens a query is made of (relative to a unit token)


def _globals(seed: int = 424242) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return unit(rng.standard_normal(DIM)), unit(rng.standard_normal((TOPICS, DIM)))


_BACKGROUND, _TOPIC_VECTORS = _globals()


def _blocks(rng, rows: int, cols: int) -> list[tuple[int, int, int, int]]:
    """Non-overlapping (r0, c0, height, width) rectangles with a one-token gap around each."""
    taken = np.zeros((rows, cols), bool)
    out: list[tuple[int, int, int, int]] = []
    want = int(rng.integers(*BLOCKS))
    for _ in range(200):
        if len(out) == want:
            break
        h, w = int(rng.integers(2, 7)), int(rng.integers(6, 17))
        r0, c0 = int(rng.integers(1, rows - h)), int(rng.integers(1, cols - w))
        if taken[max(r0 - 1, 0) : r0 + h + 1, max(c0 - 1, 0) : c0 + w + 1].any():
            continue
        taken[r0 : r0 + h, c0 : c0 + w] = True
        out.append((r0, c0, h, w))
    return out


def local_page(i: int):
    """(vectors (tokens, 128) float32, layout, blocks) of page i, deterministic in i; `blocks` is
    a list of (r0, c0, height, width, topic)."""
    rng = np.random.default_rng(9_000_011 + i)
    rows, cols = int(rng.integers(26, 31)), int(rng.integers(25, 30))
    offset = PAGE_OFFSET * rng.standard_normal(DIM) / np.sqrt(DIM)
    grid = (
        _BACKGROUND
        + offset
        + BACKGROUND_NOISE * rng.standard_normal((rows, cols, DIM)) / np.sqrt(DIM)
    )
    blocks = []
    for r0, c0, h, w in _blocks(rng, rows, cols):
        topic = int(rng.integers(TOPICS))
        lines = rng.standard_normal((h, DIM)) / np.sqrt(DIM)
        text = (
            _TOPIC_VECTORS[topic]
            + LINE_WEIGHT * lines[:, None, :]
            + 0.3 * _BACKGROUND
            + TOKEN_NOISE * rng.standard_normal((h, w, DIM)) / np.sqrt(DIM)
        )
        grid[r0 : r0 + h, c0 : c0 + w] = text
        blocks.append((r0, c0, h, w, topic))
    vectors, layout = framed_page(grid, rng)
    return vectors, layout, blocks


def query_targets(n_pages: int, count: int, seed: int = 17) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_pages, count)


def local_queries(
    n_pages: int, count: int, seed: int = 17, targets: np.ndarray | None = None
) -> list[np.ndarray]:
    """`count` queries, query j about 1-2 rows of one block of page query_targets(...)[j] (or of
    page `targets[j]` when given: queries about chosen pages, e.g. those a filter allows)."""
    rng = np.random.default_rng(seed + 1)
    _, augmentation = shared_rows()
    out = []
    for target in query_targets(n_pages, count, seed) if targets is None else targets[:count]:
        vectors, layout, blocks = local_page(int(target))
        r0, c0, h, w, _ = blocks[int(rng.integers(len(blocks)))]
        span = min(int(rng.integers(1, 3)), h)
        first = r0 + int(rng.integers(0, h - span + 1))
        grid = vectors[layout.image_rows].reshape(layout.grid_rows, layout.grid_cols, DIM)
        picked = grid[first : first + span, c0 : c0 + w].reshape(-1, DIM)
        budget = int(
            np.clip(len(picked), 0.01 * layout.num_image_tokens, 0.03 * layout.num_image_tokens)
        )
        picked = picked[rng.choice(len(picked), min(budget, len(picked)), replace=False)]
        noise = QUERY_NOISE * rng.standard_normal(picked.shape) / np.sqrt(DIM)
        out.append(np.concatenate([unit(picked + noise), augmentation]))
    return out
