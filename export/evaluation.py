"""Judging a variant against fp32: per-token cosine and top-1 agreement on clear winners.

Both halves of a gate run through the colembed runtime on the staged folder, exactly as users
would load the variant:
- cosine: the exporter's sample pages and queries (verify.py), every token of every item, mean
  and min (a NaN or an overflow anywhere fails it);
- ranking: `RANKING_PAGES` generated pages and, as queries, a perturbed copy of each page (noise,
  brightness), embedded by the same graphs. The set is built so that fp32 has clear winners:
  each query's own page must beat the runner-up by `CLEAR_MARGIN` (relative) under fp32, and
  only such queries count. A variant agrees on a query when its top-1 page is fp32's. A real
  page-to-query set (text queries) needs trained weights to have winners at all; this one does
  not, and it runs both graphs (pages go through the text graph too).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from colembed.errors import ExportError

RANKING_PAGES = 24
RANKING_SIZE = (112, 140)  # width, height: 4 x 5 image tokens, one grid, fast at any width
CLEAR_MARGIN = 0.005  # fp32's winner beats the runner-up by 0.5% of its score (page prompt
# tokens, shared by all pages, are part of every score: measured margins are ~1% on the fixtures)
MIN_CLEAR_QUERIES = 16


def token_cosines(got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> np.ndarray:
    """Per-token cosine similarity between two lists of (tokens, dim) arrays (all tokens, flat)."""
    values = []
    for i, (a, b) in enumerate(zip(got, want)):
        if a.shape != b.shape:
            raise ExportError(f"item {i}: variant gives shape {a.shape}, fp32 {b.shape}")
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        norms = np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1)
        values.append(np.sum(a64 * b64, axis=1) / np.maximum(norms, 1e-30))
    return np.concatenate(values) if values else np.zeros(0)


def cosine_figures(got_pages, want_pages, got_queries, want_queries) -> dict[str, Any]:
    pages = token_cosines(got_pages, want_pages)
    queries = token_cosines(got_queries, want_queries)
    both = np.concatenate([pages, queries])
    broken = sum(int((~np.isfinite(a).all(axis=1)).sum()) for a in [*got_pages, *got_queries])
    return {
        "non_finite_tokens": broken,
        "mean_cosine": float(both.mean()),
        "min_cosine": float(both.min()),
        "pages_mean_cosine": float(pages.mean()),
        "pages_min_cosine": float(pages.min()),
        "queries_mean_cosine": float(queries.mean()),
        "queries_min_cosine": float(queries.min()),
        "finite": bool(np.isfinite(both).all()),
        "tokens": int(both.size),
    }


def ranking_set(pages: int = RANKING_PAGES, seed: int = 0) -> tuple[list[Any], list[Any]]:
    """(pages, queries): smooth random colour fields with shapes, and a perturbed copy of each."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    width, height = RANKING_SIZE
    out_pages, out_queries = [], []
    for _ in range(pages):
        coarse = rng.integers(0, 256, (height // 14, width // 14, 3), dtype=np.uint8)
        page = Image.fromarray(coarse).resize((width, height), Image.BILINEAR)
        draw = ImageDraw.Draw(page)
        for _ in range(3):
            x, y = int(rng.integers(0, width - 30)), int(rng.integers(0, height - 30))
            draw.rectangle([x, y, x + 28, y + 28], fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
        noisy = np.asarray(page, np.float32) * rng.uniform(0.9, 1.1) + rng.normal(0, 6, (height, width, 3))
        out_pages.append(page)
        out_queries.append(Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)))
    return out_pages, out_queries


def maxsim(queries: Sequence[np.ndarray], pages: Sequence[np.ndarray]) -> np.ndarray:
    """(queries, pages) exact MaxSim scores, by colembed's own scorer."""
    from colembed.scoring import score

    return np.asarray(score(list(queries), list(pages)))


def clear_winners(scores: np.ndarray, margin: float = CLEAR_MARGIN) -> np.ndarray:
    """Indices of the queries whose own page (the diagonal) wins by `margin` under these scores."""
    own = np.diag(scores)
    others = scores.copy()
    np.fill_diagonal(others, -np.inf)
    return np.flatnonzero(own - others.max(axis=1) >= margin * np.abs(own))


def top1_agreement(scores: np.ndarray, fp32_scores: np.ndarray, queries: np.ndarray) -> dict[str, Any]:
    agree = scores[queries].argmax(axis=1) == fp32_scores[queries].argmax(axis=1)
    return {"top1_agreement": float(agree.mean()) if agree.size else 0.0,
            "queries": int(agree.size), "margin": CLEAR_MARGIN}


def embed_ranking_set(model: Any, pages: Sequence[Any], queries: Sequence[Any]) -> np.ndarray:
    """MaxSim scores of the perturbed copies (as queries) against the pages, by `model`."""
    batch = len(pages)
    return maxsim(model.embed_images(queries, batch_size=batch), model.embed_images(pages, batch_size=batch))


def evaluate_variants(folder: Any, names: Sequence[str], gates: dict[str, Any],
                      measured: dict[str, dict[str, Any]] | None = None
                      ) -> tuple[dict[str, Any], list[str]]:
    """Load fp32 and each variant from `folder`; returns ({variant: figures}, gate misses).
    `measured` adds what each variant's recipes measured while writing it (gated too)."""
    import colembed

    from .verify import SAMPLE_QUERIES, sample_pages

    pages, queries = sample_pages(), list(SAMPLE_QUERIES)
    rank_pages, rank_queries = ranking_set()
    reference = colembed.load(folder, verify=False)
    want_pages = reference.embed_images(pages, batch_size=len(pages))
    want_queries = reference.embed_queries(queries)
    fp32_scores = embed_ranking_set(reference, rank_pages, rank_queries)
    del reference
    clear = clear_winners(fp32_scores)
    if clear.size < MIN_CLEAR_QUERIES:
        raise ExportError(f"the ranking set has {clear.size} clear-winner queries under fp32 "
                          f"(< {MIN_CLEAR_QUERIES}); the fp32 graphs cannot tell pages apart")
    results: dict[str, Any] = {}
    failures: list[str] = []
    for name in names:
        model = colembed.load(folder, variant=name, verify=False)
        figures = cosine_figures(model.embed_images(pages, batch_size=len(pages)), want_pages,
                                 model.embed_queries(queries), want_queries)
        figures["ranking"] = top1_agreement(embed_ranking_set(model, rank_pages, rank_queries),
                                            fp32_scores, clear)
        del model
        figures.update({**(measured or {}).get(name, {}), "gate": gates[name].to_dict(),
                        "pages": len(pages), "queries": len(queries)})
        results[name] = figures
        failures += [f"{name}: {miss} (mean {figures['mean_cosine']:.5f}, min "
                     f"{figures['min_cosine']:.5f} over {figures['tokens']} tokens)"
                     for miss in gates[name].misses(figures)]
    return results, failures


def calibration_feeds(folder: Any) -> dict[str, list[dict[str, np.ndarray]]]:
    """The fp32 graphs' feeds for the sample pages and queries, per role (for smoothing)."""
    import colembed

    from .verify import SAMPLE_QUERIES, sample_pages

    runtime = colembed.load(folder, verify=False)
    recorded: dict[str, list[dict[str, np.ndarray]]] = {}
    # The runtime builds feeds from its contracts; record them at the session boundary.
    for role, session in runtime._sessions.items():
        recorded[role] = []

        def run(feeds, run_options=None, _run=session.run, _into=recorded[role]):
            _into.append(dict(feeds))
            return _run(feeds, run_options)

        session.run = run
    runtime.embed_images(sample_pages() + ranking_set(4, seed=1)[0])
    runtime.embed_queries(list(SAMPLE_QUERIES))
    return recorded
