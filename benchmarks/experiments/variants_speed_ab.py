"""Question: How fast is one int8 recipe against another, interleaved on one machine?
Answer: two codes per weight cost 1.6x one code's page time and 1.9x its query time
Note: benchmarks/results/experiments/variants-speed-ab-passes.md

Page and query time of two int8 recipes, interleaved, on folders exported from one checkpoint.

    python -m benchmarks.experiments.variants_speed_ab \
        A=FOLDER_A B=FOLDER_B [C=FOLDER@fp32] [--variant int8] [--rounds 7] \
        [--results benchmarks/results/NAME]

Each FOLDER holds the same fp32 graphs and a variant written by another recipe (e.g. the staging
folders `benchmarks/variants/fidelity.py` leaves under its work directory, one per
`--int8-weight-passes` / `--int8-levels` arm). Both models are loaded once, then every round times,
for each arm in turn (the order reversed every other round, so load drift hits both alike): one
page at a 256-token budget (a 448x448 page: the vision graph and the text graph's page prompt),
and one query of ~20 tokens at batch 1 (the text graph alone; what a search waits on). Reported:
each arm's median and spread (min-max) per item, and the ratio of medians to the first arm.

What it models: one user's page and query latency with the variant, same threads, same machine,
same moment. What it does not: batches, long pages, other instruction sets (the integer kernels
differ between AVX2, AVX-512 and VNNI: record the machine's, as the header does).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # the benchmarks folder

QUERY = "What was the quarterly revenue growth reported for the northern region in 2024?"


def page_image(side: int = 448):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = (rng.random((side, side, 3)) * 255).astype(np.uint8)
    return Image.fromarray(pixels)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arms", nargs="+", help="NAME=FOLDER, the first is the baseline")
    parser.add_argument("--variant", default="int8")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--results", help="path without extension")
    args = parser.parse_args()

    import colembed
    from benchmarks.shared.common import machine_info, report_results

    info = machine_info()
    arms = dict(a.split("=", 1) for a in args.arms)
    # FOLDER@VARIANT: that arm's variant instead of --variant (e.g. fp32 beside two int8 recipes)
    chosen = {n: (f.rsplit("@", 1) if "@" in f else (f, args.variant)) for n, f in arms.items()}
    models = {
        n: colembed.load(
            Path(f), variant=v, verify=False, threads=args.threads, max_image_tokens=256
        )
        for n, (f, v) in chosen.items()
    }
    page = page_image()
    for model in models.values():  # warm-up: first-run allocations out of the timings
        model.embed_images([page], batch_size=1)
        model.embed_queries([QUERY], batch_size=1)
    times = {n: {"page": [], "query": []} for n in models}
    order = list(models)
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            models[name].embed_images([page], batch_size=1)
            times[name]["page"].append(time.perf_counter() - start)
            start = time.perf_counter()
            models[name].embed_queries([QUERY], batch_size=1)
            times[name]["query"].append(time.perf_counter() - start)
        print(
            f"round {r + 1}: "
            + ", ".join(
                f"{n} page {t['page'][-1] * 1e3:.0f} ms query {t['query'][-1] * 1e3:.1f} ms"
                for n, t in times.items()
            ),
            file=sys.stderr,
            flush=True,
        )
    base = order[0]
    lines = [
        "| arm | folder | page 448x448 (256 tokens) ms, median (min-max) | x first | "
        "query batch 1 ms, median (min-max) | x first |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name in order:
        cells = []
        for item in ("page", "query"):
            t = times[name][item]
            med = statistics.median(t)
            cells += [
                f"{med * 1e3:.1f} ({min(t) * 1e3:.1f}-{max(t) * 1e3:.1f})",
                f"{med / statistics.median(times[base][item]):.2f}x",
            ]
        lines.append(f"| {name} | `{arms[name]}` | " + " | ".join(cells) + " |")
    body = [
        f"Variant `{args.variant}` (unless an arm names its own: FOLDER@VARIANT), {args.rounds} interleaved rounds (order reversed every "
        "other round), one warm-up each.",
        "",
    ] + lines
    title = "int8 recipes side by side: page and query time"
    report_results(title, info, body, args.results, {"times": times, "arms": arms})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
