"""The variant gate's memory and time per model and part, by how the gate loads its models.

    python -m benchmarks.variants.gate_memory STAGING \
        [--variants int8,fp16] [--arms before,kept,kept-arena-2] [--results benchmarks/results/NAME]

STAGING is a model folder with the fp32 graphs and the variants in its manifest: the staging
folder `benchmarks/variants/fidelity.py` leaves at `WORK/staging` (e.g. `--configs
2b-2+2-random`, Qwen2-VL-2B widths), or an export made with `--variant`. Each arm runs the
exporter's own gate (`evaluation.evaluate_variants`: fp32, then each variant, each loaded and
run through the colembed runtime) in a fresh process, measured by the exporter's own StepMeter:
per model its load and its run, each part's own peak RSS (the kernel's high-water mark reset at
its start) and the RSS it left after gc and glibc's malloc_trim. Arms:

- `before`: the gate as it loaded models before `evaluation.GATE_SESSION_CONFIG` (an fp16
  session folds its weights into fp32 copies at load);
- `kept`: the committed gate (fp16 weights stay fp16 in the session, cast per MatMul run);
- `kept-arena-2`: the same with `MALLOC_ARENA_MAX=2` (glibc's per-thread malloc arenas capped);
- `mapped`: fp16 kept, and every block of 1 MB or more its own mapping, returned when freed
  (`evaluation.map_large_blocks`), instead of glibc's threshold that grows to 32 MB (an earlier
  gate);
- `gate`: the committed gate: `mapped`, and fp16 sessions in onnxruntime's priority-based node
  order (`evaluation.GATE_EXECUTION_ORDER`: each weight's fp32 cast made next to its MatMul).

fp16's peak check (`Gate.fp16_peak`, what its recipe measured while writing the graph) is not
part of a gate-only run and not judged here; every other check is. The arms must reach the same verdicts with the same figures: the report lists each variant's
mean and min per arm and the largest difference of any bucket's figure to the first arm's.

What it models: the variant step's gate at the staging folder's size; the graph-writing parts
of the variant step are not run (`variants_fidelity.py` and `bench_export.py --variants` measure
them). What it does not: other folder sizes (project with two depths: docs/variants.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # the benchmarks folder

# arm -> (environment, fp16 weights kept fp16 (GATE_SESSION_CONFIG), large blocks mapped
# (evaluation.map_large_blocks), fp16 in the priority-based node order (GATE_EXECUTION_ORDER))
ARMS = {
    "before": ({}, False, False, False),
    "kept": ({}, True, False, False),
    "kept-arena-2": ({"MALLOC_ARENA_MAX": "2"}, True, False, False),
    "mapped": ({}, True, True, False),
    "gate": ({}, True, True, True),
}


def child(arm: str, folder: Path, variants: list[str], out: Path) -> None:
    """One arm's gate run in this process; writes its steps and figures to `out`."""
    from colembed_export.variants import gates as evaluation
    from colembed_export.measure import StepMeter, peak_rss_bytes, rss_bytes
    from colembed_export.variants.recipes import VARIANTS

    _, kept, mapped, ordered = ARMS[arm]
    if not kept:
        evaluation.GATE_SESSION_CONFIG = {}
    if not mapped:
        evaluation.map_large_blocks = lambda *a, **k: False
    if not ordered:
        evaluation.GATE_EXECUTION_ORDER = {}
    meter = StepMeter(lambda m: print(f"[{arm}] {m}", file=sys.stderr, flush=True))
    start_rss = rss_bytes()
    start = time.perf_counter()
    results, failures = evaluation.evaluate_variants(
        folder, variants, {n: VARIANTS[n].gate for n in variants}, step=meter.step
    )
    # fp16's peak gate reads what its recipe measured on the calibration feeds while writing the
    # graph (Gate.fp16_peak); a gate-only run has no such figure, so that one check is not judged
    failures = [f for f in failures if "fp16 GEMM reaches None" not in f]
    out.write_text(
        json.dumps(
            {
                "arm": arm,
                "env": ARMS[arm][0],
                "session_config": evaluation.GATE_SESSION_CONFIG,
                "large_blocks_mapped": mapped,
                "execution_order": evaluation.GATE_EXECUTION_ORDER,
                "seconds": round(time.perf_counter() - start, 1),
                "rss_at_start_gb": round(start_rss / 1e9, 3),
                "peak_rss_gb": round(max(meter.peak_rss_gb, peak_rss_bytes() / 1e9), 3),
                "steps": meter.as_dicts(),
                "failures": failures,
                "figures": {
                    n: {
                        "mean": r["mean_cosine"],
                        "min": r["min_cosine"],
                        "buckets": r["buckets"],
                        "top1": r["ranking"]["top1_agreement"],
                        "worst_item": r["worst_item"],
                    }
                    for n, r in results.items()
                },
            },
            indent=2,
        )
        + "\n"
    )


def largest_difference(a: dict, b: dict) -> float:
    """The largest |difference| of any figure (overall and per bucket, mean and min)."""
    worst = 0.0
    for name, fa in a.items():
        fb = b[name]
        worst = max(worst, abs(fa["mean"] - fb["mean"]), abs(fa["min"] - fb["min"]))
        for bucket, row in fa["buckets"].items():
            worst = max(
                worst,
                abs(row["mean"] - fb["buckets"][bucket]["mean"]),
                abs(row["min"] - fb["buckets"][bucket]["min"]),
            )
    return worst


def markdown(info: dict, folder: Path, weights: int, runs: list[dict]) -> list[str]:
    lines = [
        f"Folder: `{folder}`, {weights / 1e9:.2f} GB of fp32 graph weights. Each arm in a "
        "fresh process, one after another; per part its own peak RSS (VmHWM reset at its "
        "start) and the RSS it left (after gc and malloc_trim).",
        "",
    ]
    first = runs[0]
    for run in runs:
        env = " ".join(f"{k}={v}" for k, v in run["env"].items()) or "(none)"
        mapped = {True: "; blocks >= 1 MB mapped (mallopt)", False: "", None: ""}[
            run.get("large_blocks_mapped")
        ] + (
            "; execution order " + ", ".join(f"{k} {v}" for k, v in run["execution_order"].items())
            if run.get("execution_order")
            else ""
        )
        lines += [
            f"## {run['arm']}",
            "",
            f"Environment {env}; session config {run['session_config'] or '(none)'}{mapped}. "
            f"Gate {run['seconds']:.0f} s; RSS at start {run['rss_at_start_gb']:.2f} GB; "
            f"**peak {run['peak_rss_gb']:.2f} GB = {run['peak_rss_gb'] / (weights / 1e9):.2f}x "
            "the fp32 graph weights**.",
            "",
            "| part | seconds | peak RSS GB | RSS after GB |",
            "|---|---:|---:|---:|",
        ]
        for s in run["steps"]:
            indent = "&nbsp;&nbsp;" if s["step"].count(":") > 1 else ""
            lines.append(
                f"| {indent}{s['step'].removeprefix('variants: ')} | {s['seconds']:.1f} | "
                f"{s['peak_rss_gb']:.2f} | {s['rss_after_gb']:.2f} |"
            )
        lines += [
            "",
            "| variant | mean | min | top-1 | worst item | verdict |",
            "|---|---:|---:|---:|---|---|",
        ]
        for name, f in run["figures"].items():
            misses = [m for m in run["failures"] if m.startswith(name + ":")]
            lines.append(
                f"| {name} | {f['mean']:.6f} | {f['min']:.6f} | {f['top1']:.3f} | "
                f"{f['worst_item']} | {'refused: ' + str(len(misses)) + ' miss(es)' if misses else 'passes'} |"
            )
        if run is not first:
            same = run["failures"] == first["failures"]
            lines += [
                "",
                f"Against `{first['arm']}`: verdicts {'identical' if same else 'DIFFERENT'}; "
                f"largest difference of any figure (overall and per bucket, mean and min) "
                f"{largest_difference(first['figures'], run['figures']):.1e}.",
            ]
        lines.append("")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--variants", default="int8,fp16")
    parser.add_argument("--arms", default="before,kept,kept-arena-2")
    parser.add_argument("--results", help="path without extension")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    if args.child:
        child(args.child, args.folder, variants, args.out)
        return 0

    from benchmarks.shared.common import machine_info, report_results

    info = machine_info()
    weights = sum(
        p.stat().st_size
        for p in args.folder.iterdir()
        if p.name in ("vision.onnx", "vision.onnx_data", "text.onnx", "text.onnx_data")
    )
    runs = []
    for arm in args.arms.split(","):
        if arm not in ARMS:
            parser.error(f"unknown arm {arm!r}; known: {sorted(ARMS)}")
        out = args.folder.parent / f"gate-memory-{arm}.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                __spec__.name,
                str(args.folder),
                "--variants",
                args.variants,
                "--child",
                arm,
                "--out",
                str(out),
            ],
            check=True,
            env={**os.environ, **ARMS[arm][0]},
        )
        runs.append(json.loads(out.read_text()))
    report_results(
        "The variant gate's memory per model and part, by arm",
        info,
        markdown(info, args.folder, weights, runs),
        args.results,
        {"folder": str(args.folder), "runs": runs},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
