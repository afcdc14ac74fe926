"""The page-wide-topic set: synthetic page embeddings of real shape whose topic spans the page.

What it models: a 26-30 x 25-29 image-token grid (~750 tokens) of dim 128 between 15 prompt rows
every page shares (4 before the grid, 11 after, as ColQwen2 lays a page out), L2-normalised as the
model's output is. Each page has a topic vector and 6 regions whose directions blend smoothly over
the grid, plus noise (real pages have this spatial coherence; i.i.d. random tokens would make
row/column pooling meaningless). A query is 12 tokens drawn (with noise) from one target page's
grid plus the 10 augmentation rows every query carries.

What it does not model: a trained model's score distribution (random structure: two-stage
recall@10 measured on it is a floor, not the trained figure), an answer confined to a small part
of the page (that is `local_answer.py`'s set), the language side of a query.

Shared by bench_index.py, bench_serve.py and local_answer.py (which reuses the prompt and
augmentation rows, so both sets lay a page out alike).
"""

from __future__ import annotations

import numpy as np

DIM = 128
PROMPT_ROWS = 15
QUERY_TOKENS = 12
AUGMENTATION_ROWS = 10
REGIONS = 6
PROMPT_HEAD = 4  # prompt rows before the grid (the rest of PROMPT_ROWS follow it)


def unit(x: np.ndarray) -> np.ndarray:
    """Rows L2-normalised, float32 (as the model's output tokens are)."""
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def shared_rows(seed: int = 12345) -> tuple[np.ndarray, np.ndarray]:
    """(prompt rows every page carries, augmentation rows every query carries), fixed."""
    rng = np.random.default_rng(seed)
    return unit(rng.standard_normal((PROMPT_ROWS, DIM))), unit(
        rng.standard_normal((AUGMENTATION_ROWS, DIM))
    )


def framed_page(grid: np.ndarray, rng: np.random.Generator):
    """(vectors, layout) of a page whose image tokens are `grid` (rows, cols, DIM): the prompt
    rows every page carries (shared_rows, each jittered by `rng`) before and after it, as the
    model lays out a page; every row L2-normalised."""
    from colembed.model import PageLayout

    rows, cols = grid.shape[:2]
    prompt, _ = shared_rows()
    head = prompt[:PROMPT_HEAD] + 0.05 * rng.standard_normal((PROMPT_HEAD, DIM))
    tail = prompt[PROMPT_HEAD:] + 0.05 * rng.standard_normal((PROMPT_ROWS - PROMPT_HEAD, DIM))
    vectors = np.concatenate([unit(head), unit(grid.reshape(-1, DIM)), unit(tail)])
    layout = PageLayout(
        grid_rows=rows,
        grid_cols=cols,
        image_start=PROMPT_HEAD,
        num_tokens=len(vectors),
        token_px=28,
    )
    return vectors, layout


def synthetic_page(i: int):
    """(vectors (rows, 128) float32, layout) of page i: deterministic in i."""
    rng = np.random.default_rng(1_000_003 + i)
    rows, cols = int(rng.integers(26, 31)), int(rng.integers(25, 30))
    topic = rng.standard_normal(DIM)
    anchors = rng.standard_normal((REGIONS, DIM)) * 1.5
    centres = rng.uniform(0, 1, (REGIONS, 2)) * (rows, cols)
    rr, cc = np.mgrid[0:rows, 0:cols]
    dist = (rr[..., None] - centres[:, 0]) ** 2 + (cc[..., None] - centres[:, 1]) ** 2
    weights = np.exp(-dist / (2 * (0.15 * max(rows, cols)) ** 2))
    grid = 0.5 * topic + weights @ anchors + 0.5 * rng.standard_normal((rows, cols, DIM))
    return framed_page(grid, rng)


def query_targets(n_pages: int, count: int, seed: int = 7) -> np.ndarray:
    """The page each of `count` queries is drawn from (the needle), deterministic."""
    return np.random.default_rng(seed).integers(0, n_pages, count)


def synthetic_queries(n_pages: int, count: int, seed: int = 7) -> list[np.ndarray]:
    """`count` queries, query j drawn from page query_targets(...)[j]."""
    rng = np.random.default_rng(seed + 1)
    _, augmentation = shared_rows()
    out = []
    for target in query_targets(n_pages, count, seed):
        vectors, layout = synthetic_page(int(target))
        image = vectors[layout.image_rows]
        picked = image[rng.choice(len(image), QUERY_TOKENS, replace=False)]
        noise = 0.3 * rng.standard_normal(picked.shape) / np.sqrt(DIM)  # 0.3 of a unit token
        out.append(np.concatenate([unit(picked + noise), augmentation]))
    return out
