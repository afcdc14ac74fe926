"""What a large query request costs, and whether the process gives the memory back afterwards.

A model with Qwen2-VL widths cut down to fit this check (text 768 wide, 12 heads, 2 layers; the
real vocabulary; random weights) is exported once into a work folder. Then, each mode in a fresh
process: load, embed 16 short queries (baseline RSS), embed a large request (8 queries at the
length bound), then 7 short + 1 at the bound, then 16 short queries again, reading RSS after each
step; and time 16 short queries and the mixed batch. Modes, side by side in one run:

- `shipped`: queries grouped by length within the text attention budget, and the CPU arena handing
  its free chunks back after each run;
- `no-shrink`: the same without the arena's shrinkage run option (what shrinking costs and buys);
- `previous`: every batch padded into one run, no shrinkage (the earlier behaviour).

Writes benchmarks/results/query_memory/query_memory.{md,json}. RSS and times vary with the machine's load;
read ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.shared.machine import machine_info, markdown_header, rss_mib  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "query_memory"
SHORT = "What was the total revenue of the company in 2023?"
LARGE = 8  # queries at the bound in the large request
MODES = ("shipped", "no-shrink", "previous")
REPEATS = 7


def export_model(work: Path) -> Path:
    """The cut-down model's folder, exported on first use (needs the export extra)."""
    folder = work / "model"
    if (folder / "colembed_manifest.json").is_file():
        return folder
    from colembed_export.pipeline.exporter import export_model as export
    from colembed_export.testing.tiny_qwen2 import PRESETS, build_checkpoint

    spec = replace(
        PRESETS["qwen2-vl-2b"],
        name="query-memory",
        vision_depth=1,
        text_layers=2,
        text_hidden=768,
        text_heads=12,
        text_kv_heads=2,
        text_intermediate=2048,
        mrope_section=(8, 12, 12),
    )
    checkpoint = build_checkpoint(work / "checkpoint", spec, seed=0)
    export(checkpoint, folder, check=False)
    return folder


def child(folder: str, mode: str) -> dict:
    """One mode, in this (fresh) process: RSS after each step, and the timings."""
    import warnings

    import colembed

    model = colembed.load(folder, threads=2)
    if mode != "shipped":
        model._run_options = None  # no arena shrinkage
    if mode == "previous":  # and every batch padded into one run
        model._run_queries = lambda ids: model._run_text(ids, [()] * len(ids), None)
    long_query = "revenue " * 4 * model.text_encoder.max_query_tokens  # cut to the bound
    steps: dict[str, float] = {}
    model.embed_queries([SHORT] * 16)
    steps["after 16 short queries"] = rss_mib()["rss"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.embed_queries([long_query] * LARGE)
        steps[f"after {LARGE} queries at the bound"] = rss_mib()["rss"]
        mixed = [SHORT] * 7 + [long_query]
        model.embed_queries(mixed)
        steps["after 7 short + 1 at the bound"] = rss_mib()["rss"]
        model.embed_queries([SHORT] * 16)
        steps["after 16 short queries again"] = rss_mib()["rss"]
        steps["peak"] = rss_mib()["peak"]
        times = timings(model, mixed) if mode == "shipped" else {}
    return {
        "rss_mib": steps,
        "seconds": times,
        "max_query_tokens": model.text_encoder.max_query_tokens,
    }


def timings(model, mixed: list[str]) -> dict[str, dict[str, float]]:
    """Median seconds, the two alternatives interleaved in one process (the machine's load drifts;
    interleaving exposes both to the same drift): shrinkage on/off for 16 short queries, and the
    mixed batch grouped by length / padded into one run."""
    shrink = model._run_options
    ids = model.text_encoder.encode_queries(mixed)
    pairs = {
        "16 short queries: shrink on / off": (
            lambda: _with_options(model, shrink, lambda: model.embed_queries([SHORT] * 16)),
            lambda: _with_options(model, None, lambda: model.embed_queries([SHORT] * 16)),
        ),
        "7 short + 1 at the bound: grouped / one padded run": (
            lambda: model._run_queries(ids),
            lambda: model._run_text(ids, [()] * len(ids), None),
        ),
    }
    out = {}
    for name, (a, b) in pairs.items():
        runs: dict[str, list[float]] = {"a": [], "b": []}
        for i in range(2 * REPEATS):
            key, work = ("a", a) if i % 2 == 0 else ("b", b)
            start = time.perf_counter()
            work()
            runs[key].append(time.perf_counter() - start)
        out[name] = {k: statistics.median(v) for k, v in runs.items()}
    return out


def _with_options(model, options, work):
    model._run_options = options
    try:
        return work()
    finally:
        model._run_options = None


def write(info: dict, runs: dict[str, dict]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "query_memory.json").write_text(
        json.dumps({"machine": info, "runs": runs}, indent=2)
    )
    shipped = runs["shipped"]
    lines = [
        "# Query memory: the length bound, grouping by length, arena shrinkage",
        "",
        markdown_header(info),
        f"- model: Qwen2-VL vocabulary, text 768 wide (12 heads) x 2 layers, random weights; "
        f"query bound {shipped['max_query_tokens']} tokens; threads 2",
        "- modes: shipped = grouped by length within the attention budget + arena shrinkage; "
        "no-shrink = shipped without shrinkage; previous = one padded run per batch, no "
        "shrinkage",
        "",
        "| RSS MiB | " + " | ".join(MODES) + " |",
        "|---" * (len(MODES) + 1) + "|",
    ]
    lines += [
        f"| {k} | " + " | ".join(f"{runs[m]['rss_mib'][k]:.0f}" for m in MODES) + " |"
        for k in shipped["rss_mib"]
    ]
    lines += [
        "",
        f"Times (shipped process, the two alternatives interleaved, median of {REPEATS} each):",
        "",
        "| case: A / B | A ms | B ms | A / B |",
        "|---|---|---|---|",
    ]
    for k, t in shipped["seconds"].items():
        lines.append(f"| {k} | {t['a'] * 1e3:.1f} | {t['b'] * 1e3:.1f} | {t['a'] / t['b']:.2f} |")
    (RESULTS / "query_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--work", type=Path, default=Path(tempfile.gettempdir()) / "colembed-bench-query-memory"
    )
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.folder, args.child)))
        return 0
    info = machine_info()
    from colembed.safe_fs import make_work_folder

    folder = export_model(make_work_folder(args.work, "query-memory benchmark"))
    runs = {}
    for mode in MODES:
        out = subprocess.run(
            [sys.executable, "-m", __spec__.name, "--child", mode, "--folder", str(folder)],
            capture_output=True,
            text=True,
            check=True,
        )
        runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    write(info, runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
