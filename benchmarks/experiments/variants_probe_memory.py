"""Question: What does a calibration probe cost with and without weight prepacking?
Answer: unpacked: 0.41x the anonymous peak (3.50 vs 8.44 GB), 0.72x the time, the same peaks
Note: benchmarks/results/experiments/variants-probe-prepacking-2b-full.md

A calibration probe's memory and time, with and without onnxruntime's weight prepacking.

    python -m benchmarks.experiments.variants_probe_memory FOLDER \
        [--role text] [--results benchmarks/results/NAME]

FOLDER is a model folder with fp32 graphs (an export, or the staging folder a benchmark leaves).
Each arm runs, in a fresh process, what the fp16 recipe runs before writing a graph: the
exporter's calibration feeds for the role (`evaluation.calibration_feeds`: the sample pages, the
ranking pages, the sample queries and a long query), then `graph_edits.fp16_gemm_peaks` over the
fp32 graph of the role, i.e. one probe session (`graph_edits._probe`) run on every feed. Arms:

- `prepacked`: onnxruntime's default, the probe session prepacks every MatMul weight (a packed
  anonymous copy; the external-data file's pages are released);
- `unpacked`: `graph_edits.PROBE_PREPACKING = False` (the committed probe): the weights stay the
  file's memory-mapped pages, packed per run by the GEMM.

Per arm, measured over the probe alone (the feeds are recorded first): wall time, peak RSS and
peak anonymous memory (`RssAnon`, sampled every 50 ms by the exporter's StepMeter: what the
kernel cannot drop under pressure; file-backed pages it can), and the largest relative difference
of any measured peak between the arms (the recipe's decision reads them).

What it models: one probe of the variant step at the folder's size (the fp16 recipe's; the int8
recipe's smoothing and outlier probes are the same session over other tensors). What it does not:
the variant step's other parts (writing graphs, the gate: `bench_export.py --variants`,
`variants_gate_memory.py`), nor memory pressure itself (the machine here has room for both arms).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # the benchmarks folder

ARMS = {"prepacked": True, "unpacked": False}  # arm -> graph_edits.PROBE_PREPACKING


def child(arm: str, folder: Path, role: str, out: Path) -> None:
    """One arm's probe in this process; writes its figures to `out`."""
    from colembed.layout import BASE_VARIANT
    from colembed.manifest import read_manifest
    from colembed_export.graphs import edits as graph_edits
    from colembed_export.variants.gates import calibration_feeds
    from colembed_export.measure import StepMeter
    from colembed_export.variants.recipes import FP16_KEEP_SCOPES
    import onnx_ir as ir

    graph_edits.PROBE_PREPACKING = ARMS[arm]
    feeds = calibration_feeds(folder)[role]
    src = folder / read_manifest(folder).variants[BASE_VARIANT][role].file
    model = ir.load(str(src))
    meter = StepMeter(lambda m: print(f"[{arm}] {m}", file=sys.stderr, flush=True))
    start = time.perf_counter()
    with meter.step("probe"):
        peaks = graph_edits.fp16_gemm_peaks(model, src, feeds, keep_scopes=FP16_KEEP_SCOPES)
    (record,) = meter.records
    out.write_text(
        json.dumps(
            {
                "arm": arm,
                "prepacking": ARMS[arm],
                "feeds": len(feeds),
                "seconds": round(time.perf_counter() - start, 2),
                "peak_rss_gb": record.peak_rss_gb,
                "peak_anon_gb": record.peak_anon_gb,
                "rss_after_gb": record.rss_after_gb,
                "peaks": peaks,
            },
            indent=2,
        )
        + "\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--role", default="text", choices=("text", "vision"))
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help="write RESULTS.md and RESULTS.json (default: print)",
    )
    parser.add_argument("--child", nargs=2, metavar=("ARM", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.folder, args.role, Path(args.child[1]))
        return 0
    import numpy  # noqa: F401 (machine_info describes numpy's BLAS)
    from benchmarks.shared.machine import machine_info, markdown_header

    info = machine_info()
    data = args.folder / f".probe-{args.role}"
    runs = []
    for arm in ARMS:
        out = data.with_name(f"{data.name}-{arm}.json")
        subprocess.run(
            [
                sys.executable,
                "-m",
                __spec__.name,
                str(args.folder),
                "--role",
                args.role,
                "--child",
                arm,
                str(out),
            ],
            check=True,
        )
        runs.append(json.loads(out.read_text()))
        out.unlink()
    weights = sum(p.stat().st_size for p in args.folder.glob(f"{args.role}.onnx*"))
    first = runs[0]
    worst = max(
        abs(a - b) / max(abs(a), 1e-30)
        for name, a in first["peaks"].items()
        for b in [runs[1]["peaks"][name]]
        if a != float("inf") and b != float("inf")
    )
    lines = [
        f"# A calibration probe with and without weight prepacking ({args.role} graph)",
        "",
        markdown_header(info),
        "",
        f"Folder: `{args.folder}`, {weights / 1e9:.2f} GB of fp32 {args.role} graph (file "
        f"and external data); {first['feeds']} calibration feeds. Each arm in a fresh "
        "process, one after another.",
        "",
        "| arm | seconds | peak RSS GB | peak anonymous GB | RSS after GB |",
        "|---|---:|---:|---:|---:|",
    ]
    for run in runs:
        lines.append(
            f"| {run['arm']} | {run['seconds']:.1f} | {run['peak_rss_gb']:.2f} | "
            f"{run['peak_anon_gb']:.2f} | {run['rss_after_gb']:.2f} |"
        )
    lines += [
        "",
        f"unpacked / prepacked: time {runs[1]['seconds'] / first['seconds']:.2f}x, "
        f"peak anonymous memory {runs[1]['peak_anon_gb'] / first['peak_anon_gb']:.2f}x, "
        f"peak RSS {runs[1]['peak_rss_gb'] / first['peak_rss_gb']:.2f}x; the largest "
        f"relative difference of any of the {len(first['peaks'])} measured peaks {worst:.1e}.",
        "",
    ]
    text = "\n".join(lines)
    if args.results is None:
        print(text)
    else:
        args.results.with_suffix(".md").write_text(text)
        args.results.with_suffix(".json").write_text(
            json.dumps(
                {
                    "machine": info,
                    "folder": str(args.folder),
                    "role": args.role,
                    "weights_gb": round(weights / 1e9, 3),
                    "runs": runs,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
