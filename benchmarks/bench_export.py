"""Export time and peak memory per step, on a random-weight checkpoint of a real size.

    nice .venv/bin/python benchmarks/bench_export.py                      # Qwen2-VL-2B size (8.8 GB)
    .venv/bin/python benchmarks/bench_export.py --vision-depth 4 --text-layers 4   # reduced depth

The checkpoint is built by `colembed_export.tiny.build_checkpoint` (the `qwen2-vl-2b` preset: real
widths, heads and vocabulary; depths overridable) in a separate process, inside a work folder this
script creates (`--workdir`, marked by colembed.safe_fs); a later run with the same --workdir
reuses it. `--clean` deletes the work folder at the end (only a folder this script made).

The export runs with the check on (the torch reference, then onnxruntime on the exported graphs),
as a user's `colembed export` does. Per step: wall time and the step's own peak RSS (the kernel's
high-water mark is reset at each step start, colembed_export.measure). The figure that matters is
the overall peak against the fp32 weights' size: the target is <= 1.5x.

Writes benchmarks/results/export.{md,json} (the latest run only).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from machine import machine_info, markdown_header  # noqa: E402

RESULTS = HERE / "results"
TARGET_PEAK_RATIO = 1.5
BUILD = """
import sys
from dataclasses import replace
from colembed_export.tiny import PRESETS, build_checkpoint
spec = replace(PRESETS[sys.argv[1]], vision_depth=int(sys.argv[2]), text_layers=int(sys.argv[3]))
build_checkpoint(sys.argv[4], spec, seed=0)
"""


def checkpoint_in(workdir: Path, preset: str, vision_depth: int, text_layers: int) -> Path:
    """The checkpoint folder in `workdir`, built (in a child process) unless already there."""
    folder = workdir / f"{preset}-v{vision_depth}-t{text_layers}"
    if not (folder / "config.json").is_file():
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", BUILD, preset, str(vision_depth), str(text_layers),
                        str(folder)], check=True)
        print(f"built {folder} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return folder


def run(checkpoint: Path, out: Path) -> dict:
    from colembed_export.exporter import export_model

    weights = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))
    start = time.perf_counter()
    report = export_model(checkpoint, out, random_weights=True, overwrite=True,
                          progress=lambda m: print(f"[export] {m}", file=sys.stderr, flush=True))
    seconds = time.perf_counter() - start
    peak = max(step["peak_rss_gb"] for step in report.steps)
    return {"weights_gb": round(weights / 1e9, 3), "seconds": round(seconds, 1),
            "peak_rss_gb": peak, "peak_over_weights": round(peak / (weights / 1e9), 3),
            "steps": report.steps, "check": report.check.get("fp32", {}),
            "architecture": report.manifest.architecture}


def markdown(info: dict, result: dict) -> str:
    arch = result["architecture"]
    lines = [
        "# Export benchmark: time and peak RSS per step",
        "",
        markdown_header(info),
        "",
        f"Checkpoint: random weights, Qwen2-VL-2B widths, {arch['vision_depth']} vision blocks + "
        f"{arch['text_layers']} text layers, {result['weights_gb']:.2f} GB of fp32 weights. "
        "Export with the check on (defaults of `colembed export`).",
        "",
        f"**Total {result['seconds'] / 60:.1f} min, peak RSS {result['peak_rss_gb']:.2f} GB = "
        f"{result['peak_over_weights']:.2f}x the fp32 weights** (target <= {TARGET_PEAK_RATIO}x). "
        f"Check: max abs diff {result['check'].get('max_abs_diff', float('nan')):.1e} on the "
        "final embeddings.",
        "",
        "| step | seconds | peak RSS GB | peak / weights | RSS after GB |",
        "|---|---:|---:|---:|---:|",
    ]
    for s in result["steps"]:
        lines.append(f"| {s['step']} | {s['seconds']:.1f} | {s['peak_rss_gb']:.2f} | "
                     f"{s['peak_rss_gb'] / result['weights_gb']:.2f}x | {s['rss_after_gb']:.2f} |")
    lines += ["", "Peak RSS per step is that step's own high-water mark (VmHWM reset at its start)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen2-vl-2b")
    parser.add_argument("--vision-depth", type=int, default=32)
    parser.add_argument("--text-layers", type=int, default=28)
    parser.add_argument("--workdir", default="/tmp/colembed-bench-export")
    parser.add_argument("--clean", action="store_true", help="delete the work folder at the end")
    parser.add_argument("--results", default=str(RESULTS / "export"),
                        help="results path without extension (default benchmarks/results/export)")
    args = parser.parse_args()

    from colembed import safe_fs

    info = machine_info()
    workdir = safe_fs.make_work_folder(args.workdir, "bench_export")
    checkpoint = checkpoint_in(workdir, args.preset, args.vision_depth, args.text_layers)
    result = run(checkpoint, workdir / "model")
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results + ".json").write_text(json.dumps({"machine": info, **result}, indent=2) + "\n")
    Path(args.results + ".md").write_text(markdown(info, result))
    print(markdown(info, result))
    if args.clean:
        safe_fs.remove_tree(workdir, owner=safe_fs.is_work_folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
