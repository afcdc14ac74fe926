"""Question: Do MUVERA encodings make a better candidate stage than token centroids?
Answer: no: with the mean stage, recall@10 against exact 0.897 for MUVERA, 1.000 for centroids
Note: benchmarks/results/experiments/muvera-candidates-10000.md

MUVERA fixed-dimensional encodings as the candidate stage, beside the token-centroid stage.

    python -m benchmarks.experiments.muvera_candidates --pages 2000

What it compares, on local-answer pages (benchmarks/shared/local_answer.py: the answer in 1-3% of a
page's tokens): which pages each candidate stage hands the exact MaxSim rerank, with the same
budget. Stages:
- tokens + mean (colembed's default on Edge folders, plan.py): the best `CANDIDATES` pages by
  MaxSim against each page's 16 centroids (colembed.index.tokens, the code Edge runs) plus the
  `mean` vector's best `CANDIDATES`.
- muvera + mean: the same with FastEmbed's `Muvera` FDE dot product (`process_document` of the
  page's vectors, `process_query` of the query's; FastEmbed's defaults k_sim=5, dim_proj=16,
  r_reps=20: 10,240-d) in place of the centroid scan (in Qdrant it would be a plain vector in an
  HNSW; here the scan is exact, an upper bound for an HNSW over it).
- tokens alone / muvera alone with twice the budget.
A stage's result is the exact rerank of its candidates, so the needle is in its top 10 exactly
when it is a candidate and exact MaxSim puts it in the top 10: computed in numpy (float32) over the
generator's vectors, no store. Scan time per query is timed interleaved, stage after stage, in
one process (a same-run ratio); storage is bytes per page of what each stage reads.

Writes benchmarks/results/muvera-candidates-<pages>.{md,json}.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parents[1]  # the benchmarks folder
from benchmarks.shared.common import load_line, results_markdown, write_note  # noqa: E402
from benchmarks.shared.machine import load_average, machine_info  # noqa: E402

QUERIES = 40
K = 10
CANDIDATES = 100  # plan.TOKEN_CANDIDATES and TOKEN_MEAN_CANDIDATES


def build(pages: int):
    from fastembed.postprocess import Muvera
    from benchmarks.shared.local_answer import local_page

    from colembed.index.tokens import page_centroids

    muvera = Muvera(dim=128)
    vectors, means, centroids, fdes = [], [], [], []
    t = {"centroids_s": 0.0, "muvera_s": 0.0}
    for i in range(pages):
        v, layout, _ = local_page(i)
        image = v[layout.image_rows]
        vectors.append(v)
        means.append(image.mean(axis=0))
        s = time.perf_counter()
        centroids.append(page_centroids(image))
        t["centroids_s"] += time.perf_counter() - s
        s = time.perf_counter()
        fdes.append(muvera.process_document(v).astype(np.float32))
        t["muvera_s"] += time.perf_counter() - s
    return muvera, vectors, np.stack(means), np.stack(centroids), np.stack(fdes), t


def top(scores: np.ndarray, n: int) -> np.ndarray:
    n = min(n, len(scores))
    return np.argpartition(-scores, n - 1)[:n]


def main() -> None:
    global CANDIDATES
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=2000)
    parser.add_argument("--queries", type=int, default=QUERIES)
    parser.add_argument(
        "--candidates",
        type=int,
        default=CANDIDATES,
        help="pages a stage hands the rerank (default 100, plan.py's; at a "
        "smaller size, the same fraction of the pages keeps the test as hard)",
    )
    args = parser.parse_args()
    CANDIDATES = args.candidates
    from benchmarks.shared.local_answer import local_queries, query_targets

    from colembed.index.tokens import centroid_scores

    load_before = load_average()
    muvera, vectors, means, centroids, fdes, build_t = build(args.pages)
    queries = local_queries(args.pages, args.queries)
    targets = query_targets(args.pages, args.queries)
    stages = {"tokens + mean": [], "muvera + mean": [], "tokens alone": [], "muvera alone": []}
    times = {"tokens": [], "muvera": [], "mean": []}
    exact_tops, needle_exact = [], []
    for q, target in zip(queries, targets):
        exact = np.array([float((q @ v.T).max(axis=1).sum()) for v in vectors])
        exact_top = set(np.argsort(-exact)[:K].tolist())
        exact_tops.append(exact_top)
        needle_exact.append(int(target) in exact_top)
        s = time.perf_counter()
        by_tokens = centroid_scores(centroids, q)
        times["tokens"].append(time.perf_counter() - s)
        s = time.perf_counter()
        by_muvera = fdes @ muvera.process_query(q).astype(np.float32)
        times["muvera"].append(time.perf_counter() - s)
        s = time.perf_counter()
        by_mean = means @ q.sum(axis=0)
        times["mean"].append(time.perf_counter() - s)
        mean_c = set(top(by_mean, CANDIDATES).tolist())
        candidates = {
            "tokens + mean": set(top(by_tokens, CANDIDATES).tolist()) | mean_c,
            "muvera + mean": set(top(by_muvera, CANDIDATES).tolist()) | mean_c,
            "tokens alone": set(top(by_tokens, 2 * CANDIDATES).tolist()),
            "muvera alone": set(top(by_muvera, 2 * CANDIDATES).tolist()),
        }
        for name, c in candidates.items():
            ranked = sorted(c, key=lambda i: -exact[i])[:K]
            stages[name].append(
                {"needle": int(target) in ranked, "recall": len(set(ranked) & exact_top) / K}
            )
    results = {
        "machine": machine_info(),
        "load_before": load_before,
        "load_after": load_average(),
        "pages": args.pages,
        "queries": args.queries,
        "candidates": CANDIDATES,
        "muvera": {
            "k_sim": muvera.k_sim,
            "dim_proj": muvera.dim_proj,
            "r_reps": muvera.r_reps,
            "dims": int(fdes.shape[1]),
        },
        "exact_needle_at_10": float(np.mean(needle_exact)),
        "stages": {
            n: {
                "needle_at_10": float(np.mean([r["needle"] for r in rows])),
                "recall_at_10": float(np.mean([r["recall"] for r in rows])),
            }
            for n, rows in stages.items()
        },
        "scan_ms_p50": {n: 1000 * float(np.median(t)) for n, t in times.items()},
        "bytes_per_page": {
            "tokens": int(centroids[0].nbytes),
            "muvera": int(fdes[0].nbytes),
            "mean": int(means[0].nbytes),
        },
        "build_ms_per_page": {
            k.removesuffix("_s"): 1000 * v / args.pages for k, v in build_t.items()
        },
    }
    out = HERE / "results" / "experiments" / f"muvera-candidates-{args.pages}"
    write_note(out, results, markdown(results))


def markdown(r: dict) -> str:
    base = r["exact_needle_at_10"]
    lines = [
        load_line(r),
        "",
        f"{r['pages']:,} local-answer pages (benchmarks/shared/local_answer.py), {r['queries']} "
        f"queries, {r['candidates']} candidates a stage (twice that alone), exact MaxSim "
        f"rerank in numpy. MUVERA: FastEmbed `Muvera(dim=128)` defaults (k_sim "
        f"{r['muvera']['k_sim']}, dim_proj {r['muvera']['dim_proj']}, r_reps "
        f"{r['muvera']['r_reps']}: {r['muvera']['dims']:,}-d).",
        "",
        "| candidate stage | needle in top 10 | of exact's | recall@10 vs exact |",
        "|---|---:|---:|---:|",
        f"| exact (every page) | {100 * base:.0f}% | 100% | 1.000 |",
    ]
    for name, s in r["stages"].items():
        lines.append(
            f"| {name} | {100 * s['needle_at_10']:.0f}% | "
            f"{100 * s['needle_at_10'] / max(base, 1e-9):.0f}% | "
            f"{s['recall_at_10']:.3f} |"
        )
    b, t, m = r["bytes_per_page"], r["scan_ms_p50"], r["build_ms_per_page"]
    lines += [
        "",
        "| what a stage reads | bytes a page | scan p50 ms a query (all pages) | build ms a page |",
        "|---|---:|---:|---:|",
        f"| token centroids (16 x 128 float32) | {b['tokens']:,} | {t['tokens']:.1f} | "
        f"{m['centroids']:.1f} |",
        f"| MUVERA FDE (float32) | {b['muvera']:,} | {t['muvera']:.1f} | {m['muvera']:.1f} |",
        f"| mean (128 float32) | {b['mean']:,} | {t['mean']:.1f} | - |",
    ]
    return results_markdown("MUVERA vs the token-centroid candidate stage", r["machine"], lines)


if __name__ == "__main__":
    main()
