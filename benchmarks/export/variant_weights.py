"""Peak memory of making and saving a variant's text graph, its new weights held in memory or
spilled to a scratch file until the save (graphs/edits.py `spilled_initializers`).

    nice python -m benchmarks.export.variant_weights                  # 2B widths, 4 + 4 layers
    python -m benchmarks.export.variant_weights --text-layers 28 --vision-depth 32

The checkpoint is random, written tensor by tensor into shards (`testing/sharded.py`), exported
once to fp32 without the check and with external data, in a work folder this script makes
(`--workdir`, reused; `--clean` deletes it). Then each (recipe, spilled or not) runs in a process
of its own: the calibration feeds recorded first (not measured: the variant step records them
once for every recipe), then the exporter's own StepMeter around `make_graph` + `finish` and
around `save_graph`, as variants/write.py runs them. The two ways' files are compared byte for
byte. Writes benchmarks/results/export/variant-weights.{md,json} (`--results` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.export.streamed import same_bytes
from colembed.layout import BASE_VARIANT
from benchmarks.shared.machine import load_average, machine_info, markdown_header

HERE = Path(__file__).resolve().parents[1]
RESULTS = HERE / "results" / "export" / "variant-weights"
RECIPES = ("int8", "int4", "fp16")


def child(folder: Path, recipe: str, spill: bool, out: Path) -> dict:
    """One recipe's text graph made and saved in this process; each part's peaks."""
    import contextlib

    from colembed_export.graphs.edits import finish, spilled_initializers
    from colembed_export.measure import StepMeter
    from colembed_export.variants.gates import calibration_feeds
    from colembed_export.variants.recipes import CALIBRATED_RECIPES, make_graph
    from colembed_export.variants.write import save_graph

    calibration = calibration_feeds(folder)["text"] if recipe in CALIBRATED_RECIPES else None
    meter = StepMeter(lambda m: print(f"[variant] {m}", file=sys.stderr, flush=True))
    out.mkdir(parents=True, exist_ok=True)
    scratch = out.parent / f"{out.name}.spill"
    with spilled_initializers(scratch) if spill else contextlib.nullcontext():
        with meter.step("make"):
            model, _ = make_graph(recipe, folder / "text.onnx", out.parent, calibration)
            finish(model)
        with meter.step("save"):
            save_graph(model, out, "text.variant.onnx", external=True)
            del model
    return {"recipe": recipe, "spilled": spill, "steps": meter.as_dicts()}


def run_child(folder: Path, recipe: str, spill: bool, out: Path) -> dict:
    load = load_average()
    command = [sys.executable, "-m", "benchmarks.export.variant_weights", "--child"]
    command += [str(folder), recipe, str(int(spill)), str(out)]
    done = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["load_average_at_start"] = load
    return result


def markdown(info: dict, runs: list[dict], weights_gb: float, text_gb: float, arch: str) -> str:
    lines = [
        "# A variant's new weights spilled to disk until the save: peak memory",
        "",
        markdown_header(info),
        "",
        f"Checkpoint: random weights, {arch}, {weights_gb:.2f} GB of fp32 weights; the text "
        f"graph's fp32 external data {text_gb:.2f} GB. Each run in a process of its own; "
        "peak RSS / peak anonymous memory in GB, seconds, per part (the exporter's StepMeter).",
        "",
        "| recipe | new weights | make | save | same bytes | load at start |",
        "|---|---|---:|---:|---|---|",
    ]
    for r in runs:
        cells = [
            f"{s['peak_rss_gb']:.2f} / {s.get('peak_anon_gb') or 0:.2f} / {s['seconds']:.0f}"
            for s in r["steps"]
        ]
        lines.append(
            f"| {r['recipe']} | {'spilled' if r['spilled'] else 'in memory'} | "
            + " | ".join(cells)
            + f" | {r.get('same', '-')} | "
            + ", ".join(f"{x:.1f}" for x in r["load_average_at_start"] or [])
            + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--vision-depth", type=int, default=4)
    parser.add_argument("--text-layers", type=int, default=4)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--workdir", default="/tmp/colembed-bench-variant-weights")
    parser.add_argument("--clean", action="store_true", help="delete the work folder at the end")
    parser.add_argument("--results", default=str(RESULTS), help="path without extension")
    args = parser.parse_args()
    if args.child:
        folder, recipe, spill, out = args.child
        print(json.dumps(child(Path(folder), recipe, spill == "1", Path(out))))
        return 0

    import dataclasses

    from colembed import safe_fs
    from colembed_export.pipeline.exporter import export_model
    from colembed_export.testing.sharded import build_sharded_checkpoint
    from colembed_export.testing.tiny_qwen2 import PRESETS

    info = machine_info()
    workdir = safe_fs.make_work_folder(args.workdir, "bench_export_variant_weights")
    spec = dataclasses.replace(
        PRESETS["qwen2-vl-2b"], vision_depth=args.vision_depth, text_layers=args.text_layers
    )
    checkpoint = workdir / f"qwen2-vl-2b-v{spec.vision_depth}-t{spec.text_layers}"
    if not (checkpoint / "config.json").is_file():
        build_sharded_checkpoint(checkpoint, spec, seed=0)
    fp32 = workdir / BASE_VARIANT
    if not (fp32 / "colembed_manifest.json").is_file():
        export_model(
            checkpoint, fp32, random_weights=True, overwrite=True, check=False, external_data=True
        )
    runs = []
    for recipe in args.recipes.split(","):
        outs = {}
        for spill in (False, True):
            outs[spill] = workdir / f"{recipe}-{'spilled' if spill else 'memory'}"
            print(f"--- {recipe}, spilled={spill}", file=sys.stderr, flush=True)
            runs.append(run_child(fp32, recipe, spill, outs[spill]))
        same = all(
            same_bytes(outs[False] / name, outs[True] / name)
            for name in ("text.variant.onnx", "text.variant.onnx_data")
        )
        runs[-1]["same"] = runs[-2]["same"] = "identical" if same else "DIFFERENT"
        for out in outs.values():
            for path in out.iterdir():
                path.unlink()
            out.rmdir()
    weights = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors")) / 1e9
    text = (fp32 / "text.onnx_data").stat().st_size / 1e9
    arch = f"Qwen2-VL-2B widths, {spec.vision_depth} vision blocks + {spec.text_layers} text layers"
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results + ".json").write_text(
        json.dumps({"machine": info, "weights_gb": weights, "runs": runs}, indent=2) + "\n"
    )
    note = markdown(info, runs, weights, text, arch)
    Path(args.results + ".md").write_text(note)
    print(note)
    if args.clean:
        safe_fs.remove_tree(workdir, owner=safe_fs.is_work_folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
