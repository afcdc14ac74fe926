"""Export time and peak memory per step, on a random-weight checkpoint of a real size.

    nice python -m benchmarks.export                      # Qwen2-VL-2B size (8.8 GB)
    python -m benchmarks.export --vision-depth 4 --text-layers 4   # reduced depth
    nice python -m benchmarks.export --family colqwen2.5 --clean   # Qwen2.5-VL-3B
    python -m benchmarks.export --family colqwen3 \
        --clean                                   # Qwen3-VL-4B, full depth: ~19 GB (projected)
    python -m benchmarks.export --family colqwen3.5 --vision-depth 2 --text-layers 4 \
        --results /tmp/export-3_5-4b-2+4     # Qwen3.5-4B widths, reduced (reference env needed)
    python -m benchmarks.export --family colqwen2.5 --preset qwen2.5-vl-7b \
        --vision-depth 4 --text-layers 2 --results /tmp/export-7b-t2        # 7B widths, reduced
    python -m benchmarks.export --variants int8,fp16 \
        --int8-weight-passes 2 --clean --results benchmarks/results/export/export-variants-2b-passes-2
                                # full 2B with variants, int8 as two codes per weight (~10 GB)

The checkpoint is built by the family's random-weight builder (`--family colqwen2`:
`colembed_export.testing.tiny_qwen2.build_checkpoint`, preset `qwen2-vl-2b`; `colqwen2.5`:
`colembed_export.testing.tiny_qwen2_5.build_checkpoint_2_5`, preset `qwen2.5-vl-3b`: real widths,
heads and vocabulary; depths overridable, full-attention blocks kept inside a reduced depth;
`colqwen3.5`: `colembed_export.testing.tiny_qwen3_5.build_sharded_checkpoint`, preset
`qwen3.5-4b`, written one tensor at a time, its processor files from the reference's environment)
in a separate process, inside a work folder this script creates (`--workdir`, marked by
colembed.safe_fs); a later run with the same --workdir reuses it. `--clean` deletes the work
folder at the end (only a folder this script made).

The export runs with the check on (the torch reference, then onnxruntime on the exported graphs),
as a user's `colembed export` does. Per step: wall time and the step's own peak RSS (the kernel's
high-water mark is reset at each step start, colembed_export.measure). The figure that matters is
the overall peak against the fp32 weights' size: the target is <= 1.1x (a full-size export with `--variant int8,fp16` within the memory users have).

Writes benchmarks/results/export/export.{md,json} (ColQwen2), export-colqwen2_5.{md,json},
export-colqwen3.{md,json} or export-colqwen3_5.{md,json} (the latest run of each family only;
`--results` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # the benchmarks folder

from benchmarks.shared.common import write_note  # noqa: E402
from benchmarks.shared.machine import machine_info, markdown_header  # noqa: E402

from colembed.layout import BASE_VARIANT  # noqa: E402

RESULTS = HERE / "results" / "export"
TARGET_PEAK_RATIO = 1.1  # a full-size export with variants within 1.1x the fp32 weights
# family -> (default preset, default vision depth, default text layers, results file, widths)
FAMILIES = {
    "colqwen2": ("qwen2-vl-2b", 32, 28, "export", "Qwen2-VL-2B"),
    "colqwen2.5": ("qwen2.5-vl-3b", 32, 36, "export-colqwen2_5", "Qwen2.5-VL-3B"),
    "colqwen3": ("qwen3-vl-4b", 24, 36, "export-colqwen3", "Qwen3-VL-4B"),
    "colqwen3.5": ("qwen3.5-4b", 24, 32, "export-colqwen3_5", "Qwen3.5-4B"),
}
# presets whose widths are another model's than the family's default (the label in the table)
PRESET_WIDTHS = {"qwen2.5-vl-7b": "Qwen2.5-VL-7B"}
BUILD = """
import sys
from pathlib import Path
from benchmarks.shared.specs import build, reduced_spec
family, preset, depth, layers, out = sys.argv[1:6]
build(family, Path(out), reduced_spec(family, preset, int(depth), int(layers)))
"""


def checkpoint_in(
    workdir: Path, family: str, preset: str, vision_depth: int, text_layers: int
) -> Path:
    """The checkpoint folder in `workdir`, built (in a child process) unless already there."""
    folder = workdir / f"{preset}-v{vision_depth}-t{text_layers}"
    if not (folder / "config.json").is_file():
        start = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-c",
                BUILD,
                family,
                preset,
                str(vision_depth),
                str(text_layers),
                str(folder),
            ],
            check=True,
        )
        print(f"built {folder} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return folder


def run(
    checkpoint: Path,
    out: Path,
    variants: tuple[str, ...] = (),
    int8_weight_passes: int | None = None,
) -> dict:
    from colembed_export.pipeline.exporter import export_model

    from colembed_export.variants.write import VariantsRefused

    weights = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))
    start = time.perf_counter()
    try:
        report = export_model(
            checkpoint,
            out,
            random_weights=True,
            overwrite=True,
            variants=variants,
            int8_weight_passes=int8_weight_passes,
            progress=lambda m: print(f"[export] {m}", file=sys.stderr, flush=True),
        )
    except VariantsRefused as e:
        # A variant refused by its gate (or a gate set fp32 cannot judge) is a result: the
        # export's steps and memory, the gates' figures up to the refusal, and the folder written
        # without the refused variants; any other refusal has no steps to report.
        steps, checks, refused = e.steps, e.checks, str(e)
        architecture = json.loads((checkpoint / "colembed_tiny.json").read_text())["spec"]
    else:
        steps, checks, refused = report.steps, report.check, None
        architecture = report.manifest.architecture.to_dict()
    seconds = time.perf_counter() - start
    peak = max(step["peak_rss_gb"] for step in steps)
    return {
        "weights_gb": round(weights / 1e9, 3),
        "seconds": round(seconds, 1),
        "peak_rss_gb": peak,
        "peak_over_weights": round(peak / (weights / 1e9), 3),
        "steps": steps,
        "check": checks.get(BASE_VARIANT, {}),
        "variants": list(variants),
        "variant_buckets": {v: checks[v].get("buckets") for v in variants if v in checks},
        "variant_recipes": {
            v: {k: checks[v].get(k) for k in ("recipes", "int8_weight_passes", "refused_attempts")}
            for v in variants
            if v in checks
        },
        "refused": refused,
        "architecture": architecture,
        "int8_weight_passes": int8_weight_passes,
    }


def markdown(info: dict, result: dict, widths: str = "Qwen2-VL-2B") -> str:
    arch = result["architecture"]
    lines = [
        "# Export benchmark: time and peak RSS per step",
        "",
        markdown_header(info),
        "",
        f"Checkpoint: random weights, {widths} widths, {arch['vision_depth']} vision blocks + "
        f"{arch['text_layers']} text layers, {result['weights_gb']:.2f} GB of fp32 weights. "
        "Export with the check on (defaults of `colembed export`)"
        + (f", variants {','.join(result['variants'])}" if result.get("variants") else "")
        + (
            f"; int8 forced to {result['int8_weight_passes']} code(s) per weight "
            "(--int8-weight-passes)"
            if result.get("int8_weight_passes")
            else ""
        )
        + (
            f"; the int8 gate's mean threshold raised to {result['int8_gate_mean']} for this run "
            "(--int8-gate-mean: the fallback to two codes measured where one code holds the "
            "exporter's 0.99)"
            if result.get("int8_gate_mean") is not None
            else ""
        )
        + ".",
        "",
        f"**Total {result['seconds'] / 60:.1f} min, peak RSS {result['peak_rss_gb']:.2f} GB = "
        f"{result['peak_over_weights']:.2f}x the fp32 weights** (target <= {TARGET_PEAK_RATIO}x). "
        + (
            f"Check: max abs diff {result['check']['max_abs_diff']:.1e} on the final embeddings."
            if "max_abs_diff" in result["check"]
            else "The fp32 check passed (its figure is written only with the folder)."
        ),
        "",
        *(
            [
                f"**Refused by the variants' gate** (the folder was written without the refused "
                f"variants; the figures below are up to the refusal): {result['refused']}",
                "",
            ]
            if result.get("refused")
            else []
        ),
        "| step | seconds | peak RSS GB | peak / weights | peak anonymous GB | RSS after GB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for s in result["steps"]:  # a sub-step (a part of the variant step) is listed before its step
        label = (
            f"&nbsp;&nbsp;part: {s['step'].removeprefix('variants: ')}"
            if s.get("parent")
            else s["step"]
        )
        anon = s.get("peak_anon_gb")  # older results have none
        lines.append(
            f"| {label} | {s['seconds']:.1f} | {s['peak_rss_gb']:.2f} | "
            f"{s['peak_rss_gb'] / result['weights_gb']:.2f}x | "
            f"{'-' if anon is None else f'{anon:.2f}'} | {s['rss_after_gb']:.2f} |"
        )
    lines += [
        "",
        "Peak RSS per step is that step's own high-water mark (VmHWM reset at its start), "
        "mapped weight files' resident pages included; peak anonymous memory (RssAnon, "
        "sampled every 50 ms) is what the kernel cannot drop under pressure; "
        "the parts of the variant step (each graph made and saved, the gate set through fp32 "
        "and through each variant) are listed before it, and its peak is the largest of "
        "theirs.",
    ]
    for name, made in (result.get("variant_recipes") or {}).items():
        if made.get("int8_weight_passes") is None:
            continue
        lines += [
            "",
            f"{name}: written with {made['int8_weight_passes']} int8 code(s) per weight "
            f"(recipes {made['recipes']})"
            + "".join(
                f"; refused before it: {r['int8_weight_passes']} code(s) per weight, mean "
                f"{r['mean_cosine']:.5f}, min {r['min_cosine']:.5f}, worst item "
                f"{r['worst_item']!r} ({r['worst_item_min']:.5f})"
                for r in made.get("refused_attempts") or []
            )
            + ".",
        ]
    buckets = result.get("variant_buckets") or {}
    if buckets:  # the variants' gate figures (per-token cosine to fp32), per length bucket
        names = list(buckets)
        rows = sorted({b for v in buckets.values() for b in (v or {})})
        lines += [
            "",
            "Variants against fp32, per-token cosine mean / min per length bucket "
            "(the exporter's gate set):",
            "",
            "| bucket | " + " | ".join(names) + " |",
            "|---|" + "---:|" * len(names),
        ]
        for row in rows:
            cells = [
                f"{buckets[n][row]['mean']:.5f} / {buckets[n][row]['min']:.5f}"
                if row in (buckets[n] or {})
                else ""
                for n in names
            ]
            lines.append(f"| {row} | " + " | ".join(cells) + " |")
    load = (info.get("load_average_at_start") or [0.0])[0]
    if load > info["physical_cores"] / 2:
        lines += [
            f"Shared machine: load average {load:.1f} at the start on {info['physical_cores']} "
            "cores; other jobs' work stretches the times (peak RSS is this process's own)."
        ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="colqwen2")
    parser.add_argument("--preset", help="architecture preset (default: the family's full size)")
    parser.add_argument("--vision-depth", type=int, help="default: the preset's")
    parser.add_argument("--text-layers", type=int, help="default: the preset's")
    parser.add_argument("--workdir", default="/tmp/colembed-bench-export")
    parser.add_argument("--clean", action="store_true", help="delete the work folder at the end")
    parser.add_argument(
        "--variants", default="", help="e.g. int8,fp16 (the variant step measured too)"
    )
    parser.add_argument(
        "--int8-weight-passes",
        type=int,
        choices=(1, 2),
        help="int8 codes per weight, forced (default: the exporter's, one code "
        "then two when the gate refuses one)",
    )
    parser.add_argument(
        "--int8-gate-mean",
        type=float,
        help="the int8 gate's mean-cosine threshold for this run (default the "
        "exporter's, 0.99): raised, it refuses one int8 code per weight at a "
        "reduced depth where one code holds, to measure the exporter's fallback "
        "to two codes (its extra build and gate) there",
    )
    parser.add_argument(
        "--results",
        help="results path without extension (default "
        "benchmarks/results/export/export for colqwen2, export-colqwen2_5 for colqwen2.5)",
    )
    args = parser.parse_args()

    from colembed import safe_fs

    if args.int8_gate_mean is not None:
        import dataclasses

        from colembed_export.variants import recipes

        spec = recipes.VARIANTS["int8"]
        recipes.VARIANTS["int8"] = dataclasses.replace(
            spec, gate=dataclasses.replace(spec.gate, mean_cosine=args.int8_gate_mean)
        )

    preset, depth, layers, results, widths = FAMILIES[args.family]
    widths = PRESET_WIDTHS.get(args.preset, widths)
    results = args.results or str(RESULTS / results)
    info = machine_info()
    workdir = safe_fs.make_work_folder(args.workdir, "bench_export")
    checkpoint = checkpoint_in(
        workdir,
        args.family,
        args.preset or preset,
        args.vision_depth or depth,
        args.text_layers or layers,
    )
    variants = tuple(v for v in args.variants.split(",") if v)
    result = run(checkpoint, workdir / "model", variants, args.int8_weight_passes)
    result["family"] = args.family
    result["int8_gate_mean"] = args.int8_gate_mean
    Path(results).parent.mkdir(parents=True, exist_ok=True)
    write_note(results, {"machine": info, **result}, markdown(info, result, widths))
    if args.clean:
        safe_fs.remove_tree(workdir, owner=safe_fs.is_work_folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
