"""One gate model's runs: peak RSS above the loaded model per run kind, heap vs mapped blocks.

    python -m benchmarks.variants.gate_runs FOLDER \
        [--variant fp32] [--arm heap|mapped]

FOLDER: a model folder with the variant (e.g. the staging folder `variants_fidelity.py
--write-only` leaves). The model is loaded as the exporter's gate loads it (`evaluation.
gate_model`), then three of the gate's runs, each its own peak (VmHWM reset at its start) above
the RSS before it (after gc and malloc_trim): a query at the bound, the full-budget page alone,
and that page beside the smallest (the gate's largest mixed pair). `--arm mapped` first sets
glibc's mmap threshold as the gate does (`evaluation.map_large_blocks`); `heap` leaves glibc's
default, whose threshold grows to the largest block freed. One process per arm: the threshold
is process-wide. Prints one line per run (the lines the results pages quote).

What it models: the part of the gate's peak that its runs add over the weights, and how it
grows with depth (run it on two depths). What it does not: the whole gate (variants_gate_memory.py).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path


def main() -> int:
    from colembed.layout import BASE_VARIANT

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--variant", default=BASE_VARIANT)
    parser.add_argument("--arm", choices=("heap", "mapped"), default="mapped")
    args = parser.parse_args()
    warnings.simplefilter("ignore")

    from colembed_export.variants import gates as E
    from colembed_export.measure import _reset_peak, peak_rss_bytes, release_memory, rss_bytes

    if args.arm == "mapped":
        E.map_large_blocks()
    model = E.gate_model(args.folder, args.variant)
    release_memory()
    label = f"{args.variant} {args.arm}"
    print(f"{label}: loaded {rss_bytes() / 1e9:.2f} GB", flush=True)
    pages, queries = E.gate_pages(model), E.gate_queries(model)
    runs = [
        ("query at the bound", lambda: model.embed_queries([queries[-1][1]])),
        ("full-budget page", lambda: model.embed_images([pages[4][1]], batch_size=1)),
        (
            "pair: full-budget + smallest",
            lambda: model.embed_images([pages[4][1], pages[3][1]], batch_size=2),
        ),
    ]
    for name, run in runs:
        release_memory()
        before = rss_bytes()
        _reset_peak()
        start = time.perf_counter()
        run()
        seconds = time.perf_counter() - start
        peak = peak_rss_bytes()
        print(
            f"{label}: {name}: peak {peak / 1e9:.2f} GB (+{(peak - before) / 1e9:.2f} over "
            f"{before / 1e9:.2f}), {seconds:.1f} s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
