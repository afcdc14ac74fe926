"""Per-length-bucket fidelity of each variant to fp32, on random weights and the stress checkpoints.

    python -m benchmarks.variants.fidelity                    # the tiny checkpoints
    python -m benchmarks.variants.fidelity \
        --configs 2b-heldout --variants int8,fp16                   # Qwen2-VL-2B widths, 1+2 layers

Each configuration is a checkpoint built here (random weights: `tiny.build_checkpoint`; stress:
`tiny.build_stress_checkpoint` with the traits the recipes were chosen on; held-out stress: the
same with `tiny.HELD_OUT_STRESS`, other channels and magnitudes; the `tiny-2.5-*` ones the same
for ColQwen2.5 by `tiny_qwen2_5`, whose stress traits add the gated vision MLP's 2e5 intermediate
and a vision residual above fp16's maximum), exported to fp32 without the
torch check, then each variant written by the exporter's own variant step (variants.
_write_graphs: the committed recipes, calibration included) and judged by the exporter's own gate
(evaluation.evaluate_variants: the gate's queries from one word to the query bound, pages from
20x20 to the full image-token budget and aspect-50 strips, mixed batches; per item and per
length bucket). Unlike an export, a variant that misses its gate is reported, not refused.

What it models: what a user's `colembed export --variant ...` checks, on checkpoints whose
activations carry trained-model traits (massive residual channels, large image features). What
it does not: trained weights (none can be downloaded here); the full depth at the 2B widths (the
`tiny-deep-*` and `tiny-V+T-*` configurations show error accumulating over depth at tiny widths,
the `2b-*` ones the 2B widths at 1+2 layers).

`--int4 KNOBS` measures the int4 recipe with other knobs (block size, accuracy level, symmetric
blocks, bits per MatMul role; variants_int4_recipes.py's arm syntax), the exporter unchanged.

`--int8-levels W,A` measures the int8 recipe with other code peaks (weights -W..W, activations
-A..A around A + 1; quantise.py's WEIGHT_PEAK / ACTIVATION_PEAK) instead of the committed ones,
e.g. `--int8-levels 127,63` (8-bit weights, 7-bit activations); the exporter is not changed.

Writes benchmarks/results/variants/variants-fidelity.{md,json} (or --results). Work folders live under
$COLEMBED_BENCH_DIR (default /tmp/colembed-bench-variants) and are reused by a later run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

from colembed.layout import BASE_VARIANT, MANIFEST_NAME

HERE = Path(__file__).resolve().parents[1]  # the benchmarks folder

RESULTS = HERE / "results" / "variants" / "variants-fidelity"
# name -> (preset, vision depth, text layers, checkpoint kind)
CONFIGS = {
    "tiny-random": ("tiny", None, None, "random"),
    "tiny-stress": ("tiny", None, None, "stress"),
    "tiny-heldout": ("tiny", None, None, "heldout"),
    "2b-random": ("qwen2-vl-2b", 1, 2, "random"),
    "2b-stress": ("qwen2-vl-2b", 1, 2, "stress"),
    "2b-heldout": ("qwen2-vl-2b", 1, 2, "heldout"),
    # ColQwen2.5 (Qwen2.5-VL: windowed vision attention, RMSNorm + gated-MLP vision blocks),
    # export/testing/tiny_qwen2_5.py; its stress traits add the gated vision MLP's 2e5 intermediate.
    "tiny-2.5-random": ("tiny-2.5", None, None, "random"),
    "tiny-2.5-stress": ("tiny-2.5", None, None, "stress"),
    "tiny-2.5-heldout": ("tiny-2.5", None, None, "heldout"),
    # Error accumulation over depth: the tiny widths at the real model's depth (32
    # vision blocks, 28 text layers) and at depths between, where int8's per-MatMul rounding
    # compounds through the residual stream as it does in the real 2B (whose full-size export
    # missed the gate at mean 0.990 while every 1-4-layer fixture passed). They model how error
    # grows with depth under each recipe; not trained weights, nor the 2B widths' activation
    # statistics (the `2b-*` configurations, 1+2 layers, show those).
    **{f"tiny-deep-{kind}": ("tiny", 32, 28, kind) for kind in ("random", "stress", "heldout")},
    **{
        f"tiny-{vision}+{text}-{kind}": ("tiny", vision, text, kind)
        for vision, text in ((2, 7), (8, 14))
        for kind in ("random", "stress", "heldout")
    },
    # The 2B widths at depths between the 1+2 fixtures and the full 32+28, where the full-size
    # export's int8 refusal (mean 0.98984) arises: 2+2 (the gate's memory), 8+7 and 16+14 (a
    # quarter and half the depth; 2.9 and 4.8 GB of fp32 weights: run them under the lock).
    **{
        f"2b-{vision}+{text}-random": ("qwen2-vl-2b", vision, text, "random")
        for vision, text in ((2, 2), (8, 7), (16, 14))
    },
    # Qwen3-VL-4B widths (ColQwen3, text 2560, MLP 9728; export/testing/tiny_qwen3.py's `qwen3-vl-4b`,
    # reduced as benchmark_specs.reduced_spec does): where int4 met its gate's refusal at 2+2
    # (benchmarks/results/export/export-colqwen3-variants-2+2.md); 2+4 and 2+8 for the depth trend.
    **{
        f"4b-{vision}+{text}-random": ("qwen3-vl-4b", vision, text, "random")
        for vision, text in ((2, 2), (2, 4), (2, 8))
    },
}
QWEN2_5_PRESETS = ("tiny-2.5",)
QWEN3_PRESETS = ("qwen3-vl-4b",)
KIND_LABELS = {
    "random": "random weights",
    "stress": "stress traits (StressTraits())",
    "heldout": "held-out stress traits (HELD_OUT_STRESS)",
}


def parse_arm(text: str) -> tuple[str, dict[str, Any]]:
    """`name:key=value,...` -> (name, quantize_int4 keyword arguments)."""
    name, _, spec = text.partition(":")
    knobs: dict[str, Any] = {}
    for part in filter(None, spec.split(",")):
        key, _, value = part.partition("=")
        if key == "block":
            knobs["block_size"] = int(value)
        elif key == "block8":
            knobs["block_size_8bit"] = int(value)
        elif key == "level":
            knobs["accuracy_level"] = int(value)
        elif key == "sym":
            knobs["symmetric"] = bool(int(value))
        elif key == "bits":
            pairs = [p.rsplit(":", 1) for p in value.split("+")]
            knobs["role_bits"] = tuple((("" if f == "*" else f), int(b)) for f, b in pairs)
        else:
            raise SystemExit(
                f"arm {name!r}: unknown knob {key!r} (block, block8, level, sym, bits)"
            )
    return name, knobs


def build(config: str, root: Path) -> Path:
    """The fp32 export folder of `config` (built and exported unless already there)."""
    from colembed_export.pipeline.exporter import export_model
    from colembed_export.testing.tiny_qwen2 import (
        HELD_OUT_STRESS,
        PRESETS,
        StressTraits,
        build_checkpoint,
        build_stress_checkpoint,
    )

    preset, depth, layers, kind = CONFIGS[config]
    folder = root / f"{config}-fp32"
    if (folder / MANIFEST_NAME).is_file():
        return folder
    checkpoint = root / f"{config}-checkpoint"
    if not (checkpoint / "config.json").is_file():
        if preset in QWEN3_PRESETS:
            from benchmarks.shared.specs import build as build_family, reduced_spec

            if kind != "random":
                raise ValueError(f"{config}: only random weights at {preset} widths")
            build_family("colqwen3", checkpoint, reduced_spec("colqwen3", preset, depth, layers))
        elif preset in QWEN2_5_PRESETS:
            from colembed_export.testing.tiny_qwen2_5 import (
                Qwen2_5StressTraits,
                build_checkpoint_2_5,
                build_stress_checkpoint_2_5,
            )

            if kind == "random":
                build_checkpoint_2_5(checkpoint, preset, seed=0)
            else:  # held-out: ColQwen2's held-out text traits, the 2.5 vision traits' defaults
                traits = Qwen2_5StressTraits(
                    **(dataclasses.asdict(HELD_OUT_STRESS) if kind == "heldout" else {})
                )
                build_stress_checkpoint_2_5(checkpoint, preset, traits=traits)
        else:
            spec = PRESETS[preset]
            if depth is not None:
                spec = dataclasses.replace(spec, vision_depth=depth, text_layers=layers)
            if kind == "random":
                build_checkpoint(checkpoint, spec, seed=0)
            else:
                traits = HELD_OUT_STRESS if kind == "heldout" else StressTraits()
                build_stress_checkpoint(checkpoint, spec, traits=traits)
    export_model(checkpoint, folder, check=False, random_weights=True, overwrite=True)
    return folder


def measure(
    folder: Path,
    variants: list[str],
    work: Path,
    gate: bool = True,
    int8_weight_passes: int | None = None,
) -> dict[str, Any]:
    """Write the variants into a copy of the fp32 folder (`work`/staging) and judge them (never
    refusing; `gate=False`: written only), each by one recipe: its first attempt (recipes.
    recipe_attempts; int8: one code per weight) or every int8 graph with `int8_weight_passes`
    codes per weight. No fallback: this measures a recipe, the exporter chooses one."""
    import shutil

    from colembed import safe_fs
    from colembed.manifest import Manifest, read_manifest
    from colembed_export.variants.gates import evaluate_variants
    from colembed_export.measure import StepMeter
    from colembed.integrity import describe_file
    from colembed_export.variants.recipes import VARIANTS, quiet_quantisers, recipe_attempts
    from colembed_export.variants.write import _write_graphs

    staging = work / "staging"
    if staging.exists():
        shutil.rmtree(staging)
    shutil.copytree(folder, staging)
    manifest = read_manifest(staging)
    graphs = {role: manifest.graph(BASE_VARIANT, role) for role in ("vision", "text")}
    quiet_quantisers()
    meter = StepMeter(lambda m: print(m, file=sys.stderr, flush=True))
    start = time.perf_counter()
    plan = {v: recipe_attempts(v, int8_weight_passes)[0] for v in variants}
    entries, measured = _write_graphs(staging, graphs, plan, lambda m: None, meter.step)
    write_seconds = time.perf_counter() - start
    data = manifest.to_dict()
    data["variants"].update(
        {v: {r: g.to_dict() for r, g in roles.items()} for v, roles in entries.items()}
    )
    data["files"] = {
        p.name: describe_file(p)
        for p in sorted(staging.iterdir())
        if p.is_file() and p.name not in (MANIFEST_NAME, safe_fs.STAGING_MARKER)
    }
    Manifest.from_dict(data).write(staging)
    if not gate:
        return {
            "staging": str(staging),
            "write_seconds": round(write_seconds, 1),
            "steps": meter.as_dicts(),
        }
    start = time.perf_counter()
    results, failures = evaluate_variants(
        staging, variants, {n: VARIANTS[n].gate for n in variants}, measured, step=meter.step
    )
    weights = sum(
        p.stat().st_size
        for p in folder.iterdir()
        if p.name.endswith(".onnx_data") or p.name.endswith(".onnx")
    )
    return {
        "results": results,
        "failures": failures,
        "write_seconds": round(write_seconds, 1),
        "gate_seconds": round(time.perf_counter() - start, 1),
        "steps": meter.as_dicts(),
        "fp32_graph_bytes": weights,
    }


def markdown(info: dict, runs: dict[str, dict], int8_weight_passes: int | None = None) -> str:
    from colembed_export.variants import quantise
    from colembed_export.variants.recipes import GATES
    from benchmarks.shared.common import results_markdown

    from colembed_export.variants.recipes import quantize_int4, quantize_int8

    lines = [
        f"int8 code peaks: weights -{quantise.WEIGHT_PEAK}..{quantise.WEIGHT_PEAK} "
        f"({int8_weight_passes or 1} code(s) per weight), activations "
        f"-{quantise.ACTIVATION_PEAK}..{quantise.ACTIVATION_PEAK} per token; SmoothQuant "
        f"alpha {quantize_int8.__kwdefaults__['alpha']}. int4 text graph: "
        + ", ".join(f"{k} {v}" for k, v in quantize_int4.__kwdefaults__.items())
        + ".",
        "",
        "Per-token cosine of each variant's embeddings to fp32's (mean / min over the "
        "bucket's tokens), by the exporter's own gate set (export/variants/gates.py: queries "
        "from one word to the query bound, pages from 20x20 to the full image-token "
        "budget and aspect-50 strips, each alone and in mixed batches). Gates: "
        + "; ".join(
            f"{n} mean >= {g.mean_cosine}"
            + (f", min >= {g.min_cosine}" if g.min_cosine is not None else "")
            for n, g in GATES.items()
        )
        + ".",
        "",
    ]
    for config, run in runs.items():
        preset, depth, layers, kind = CONFIGS[config]
        shape = f"{preset} widths" + (
            f", {depth} vision block(s) + {layers} text layers" if depth is not None else ""
        )
        lines += [
            f"## {config}: {KIND_LABELS[kind]}, {shape}",
            "",
            f"Variant step {run['write_seconds']:.0f} s, gate {run['gate_seconds']:.0f} s; "
            f"fp32 graphs {run['fp32_graph_bytes'] / 1e9:.2f} GB. Each part's own peak RSS:",
            "",
            "| part | seconds | peak RSS GB |",
            "|---|---:|---:|",
        ]
        lines += [
            f"| {s['step'].removeprefix('variants: ')} | {s['seconds']:.1f} | "
            f"{s['peak_rss_gb']:.2f} |"
            for s in run["steps"]
        ]
        lines.append("")
        names = list(run["results"])
        buckets = sorted(
            {b for r in run["results"].values() for b in r["buckets"]},
            key=lambda b: (b.split()[0], int(b.split()[1].split("-")[0].rstrip("+"))),
        )
        lines += ["| bucket | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for bucket in buckets:
            cells = []
            for n in names:
                row = run["results"][n]["buckets"].get(bucket)
                cells.append(f"{row['mean']:.5f} / {row['min']:.5f}" if row else "")
            lines.append(f"| {bucket} | " + " | ".join(cells) + " |")
        lines.append(
            "| **worst item** | "
            + " | ".join(
                f"{r['worst_item']} ({r['items'][r['worst_item']]['min']:.4f})"
                for r in run["results"].values()
            )
            + " |"
        )
        lines.append(
            "| top-1 agreement | "
            + " | ".join(f"{r['ranking']['top1_agreement']:.3f}" for r in run["results"].values())
            + " |"
        )
        lines += [
            "",
            "By kind of query token (mean / min over the gate's query tokens of that "
            "kind; the worst token's text):",
            "",
        ]
        kinds = sorted({k for r in run["results"].values() for k in r.get("token_classes", {})})
        lines += ["| token kind | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for kind in kinds:
            cells = []
            for n in names:
                row = run["results"][n].get("token_classes", {}).get(kind)
                cells.append(
                    f"{row['mean']:.5f} / {row['min']:.5f} ({row['worst']['text']!r})"
                    if row
                    else ""
                )
            lines.append(f"| {kind} | " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        lines.append("")
        if run["failures"]:
            lines += ["Gate misses (the exporter refuses these variants):", ""]
            lines += [f"- {f}" for f in run["failures"]] + [""]
        else:
            lines += ["Every variant meets its gate.", ""]
    return results_markdown(
        "Variant fidelity to fp32, per length bucket and kind of token", info, lines
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--configs",
        default="tiny-random,tiny-stress,tiny-heldout",
        help=f"comma-separated, of {sorted(CONFIGS)}",
    )
    parser.add_argument("--variants", default="int8,int4,fp16")
    parser.add_argument("--results", default=str(RESULTS), help="path without extension")
    parser.add_argument(
        "--int8-levels",
        help="W,A: the int8 recipe's weight and activation code "
        "peaks for this run (default: quantise.py's)",
    )
    parser.add_argument(
        "--int8-weight-passes",
        type=int,
        choices=(1, 2),
        help="int8 codes per weight (default 1: the int8 recipe's first attempt)",
    )
    parser.add_argument(
        "--smoothing-alpha",
        help="SmoothQuant alpha of the int8 recipe for this "
        "run, or 'none' (default: recipes.SMOOTHING_ALPHA)",
    )
    parser.add_argument(
        "--int4",
        metavar="KNOBS",
        help="the int4 recipe's knobs for this run, "
        "as variants_int4_recipes.py's arms take them (e.g. 'block=16,level=0,"
        "bits=mlp.down_proj:8'; default: recipes.py's)",
    )
    parser.add_argument(
        "--write-only",
        action="store_true",
        help="write the variants into "
        "WORK/staging and stop (for variants_gate_memory.py, variants_speed_ab.py)",
    )
    args = parser.parse_args()
    from colembed_export.variants import quantise, recipes

    if args.int8_levels:
        quantise.WEIGHT_PEAK, quantise.ACTIVATION_PEAK = (
            int(v) for v in args.int8_levels.split(",")
        )
    if args.smoothing_alpha:
        alpha = None if args.smoothing_alpha == "none" else float(args.smoothing_alpha)
        recipes.quantize_int8.__kwdefaults__["alpha"] = alpha
    if args.int4:
        recipes.quantize_int4.__kwdefaults__.update(parse_arm(f"int4:{args.int4}")[1])

    from benchmarks.shared.common import machine_info, write_results

    info = machine_info()
    root = Path(os.environ.get("COLEMBED_BENCH_DIR", "/tmp/colembed-bench-variants")) / "fidelity"
    root.mkdir(parents=True, exist_ok=True)
    variants = [v for v in args.variants.split(",") if v]
    runs = {}
    for config in args.configs.split(","):
        if config not in CONFIGS:
            parser.error(f"unknown configuration {config!r}; known: {sorted(CONFIGS)}")
        folder = build(config, root)
        arm = (
            (f"-levels-{args.int8_levels.replace(',', '-')}" if args.int8_levels else "")
            + (f"-passes-{args.int8_weight_passes}" if args.int8_weight_passes else "")
            + (f"-alpha-{args.smoothing_alpha}" if args.smoothing_alpha else "")
            + (
                "-int4-" + "".join(c if c.isalnum() else "-" for c in args.int4)
                if args.int4
                else ""
            )
        )
        runs[config] = measure(
            folder,
            variants,
            root / f"{config}-work{arm}",
            gate=not args.write_only,
            int8_weight_passes=args.int8_weight_passes,
        )
        if args.write_only:
            print(f"{config}: written to {runs[config]['staging']}", file=sys.stderr)
            continue
        print(f"{config}: {runs[config]['failures'] or 'all gates met'}", file=sys.stderr)
    if args.write_only:
        return 0
    text = markdown(info, runs, args.int8_weight_passes)
    write_results(args.results, text, info, {"runs": runs})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
