"""Project a full-depth export's peak memory from two reduced-depth runs at real widths.

    python -m benchmarks.export.project /tmp/export-7b-v4-t2.json /tmp/export-7b-v4-t6.json \
        --preset qwen2.5-vl-7b --full-3b benchmarks/results/export/export-colqwen2_5.json \
        --results benchmarks/results/export/export-colqwen2_5-7b

Inputs are one or two `bench_export.py --results` JSONs of one preset that differ only in the
number of language layers (same vision depth). Why: an export's per-step peak is an affine
function of the weights it holds (the torch model resident while the reference runs, a graph's
weights while it is traced, both graphs' sessions while the check runs); two depths give each
step's slope and offset. With one run the slope is taken as 1 (every added byte of weights
resident once), what the full-depth 3B export shows (benchmarks/results/export/export-colqwen2_5.md:
peak 0.99x the fp32 weights), except for the vision graph (below).
The full-depth checkpoint's fp32 size is counted exactly on the preset's config (meta device, no
weights). Each step is projected along its own slope, linearly in the weights' bytes: text layers
and vision blocks alike (both are resident fp32 weights). The one step the language layers do not
move, the vision graph, is taken from a measured full-depth export of the same vision tower
(`--full-3b`: Qwen2.5-VL-3B and -7B share it except the merger's output width), when given.

What it does not model: page-cache pressure and swap (the projection is the process's own RSS),
and the adapter merge that precedes a published model's export (one more fp32 load of the base,
not part of these runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # the benchmarks folder

VISION_STEP = "export the vision graph"


TEXT_STEP = "export the text graph"


# preset -> (title, checkpoint sentence, full depth "vision + language", what the count holds)
PRESET_FACTS = {
    "qwen2.5-vl-7b": (
        "ColQwen2.5 7B",
        "Qwen2.5-VL-7B widths (hidden 3584, GQA 28:4, MLP 18944, "
        "vocabulary 152064, untied embeddings; vision tower 1280 wide, merger to "
        "3584)",
        "32 + 28",
        "the untied LM head included; the export holds no head",
    ),
    "qwen3-vl-4b": (
        "ColQwen3 4B (Qwen3-VL-4B: TomoroAI/tomoro-colqwen3-embed-4b)",
        "Qwen3-VL-4B widths (hidden 2560, GQA 32:8, head dim 128, MLP 9728, vocabulary "
        "151936, tied embeddings; vision tower 1024 wide with DeepStack mergers, merger "
        "to 2560; 320-wide projection)",
        "24 + 36",
        "tied embeddings once, the projection included, no LM head",
    ),
}


def checkpoint_bytes_3(
    preset: str, vision_depth: int | None = None, text_layers: int | None = None
) -> tuple[int, int]:
    """fp32 bytes of the ColQwen3 preset's checkpoint (Qwen3VLModel + projection, as
    `tiny_qwen3.build_checkpoint_3` writes it), and of its tower."""
    import torch
    from transformers import Qwen3VLModel

    from benchmarks.shared.specs import reduced_spec
    from colembed_export.testing.tiny_qwen3 import EMBEDDING_DIM, PRESETS_3, build_vlm_config

    spec = PRESETS_3[preset]
    if vision_depth or text_layers:
        spec = reduced_spec(
            "colqwen3", preset, vision_depth or spec.vision_depth, text_layers or spec.text_layers
        )
    with torch.device("meta"):
        model = Qwen3VLModel(build_vlm_config(spec))
    vision = sum(p.numel() for p in model.visual.parameters())
    total = sum(p.numel() for p in model.parameters()) + (spec.text_hidden + 1) * EMBEDDING_DIM
    return 4 * total, 4 * vision


def checkpoint_bytes(
    preset: str, vision_depth: int | None = None, text_layers: int | None = None
) -> tuple[int, int]:
    """fp32 bytes of the preset's ColQwen2ForRetrieval (tied tensors once), and of its tower."""
    if preset.startswith("qwen3"):
        return checkpoint_bytes_3(preset, vision_depth, text_layers)
    import torch
    from transformers import ColQwen2Config, ColQwen2ForRetrieval

    from colembed_export.testing.tiny_qwen2_5 import PRESETS_2_5, build_vlm_config

    spec = PRESETS_2_5[preset]
    if vision_depth or text_layers:
        depth = vision_depth or spec.vision_depth
        spec = dataclasses.replace(
            spec,
            vision_depth=depth,
            text_layers=text_layers or spec.text_layers,
            fullatt_block_indexes=tuple(i for i in spec.fullatt_block_indexes if i < depth)
            or (depth - 1,),
        )
    with torch.device("meta"):
        model = ColQwen2ForRetrieval(
            ColQwen2Config(vlm_config=build_vlm_config(spec), embedding_dim=spec.embedding_dim)
        )
    vision = sum(p.numel() for p in model.vlm.model.visual.parameters())
    return 4 * sum(p.numel() for p in model.parameters()), 4 * vision


def project(
    small: dict,
    large: dict | None,
    preset: str,
    full_vision_step: float | None,
    whole_model_per_graph: bool = False,
) -> dict:
    """Per step: measured peaks, slope per GB of weights, projected GB at the preset's depth.
    The vision graph grows with the tower's weights, the text graph with the rest, the other
    steps with all of them."""
    one_run = large is None
    large = small if one_run else large
    arch = large["architecture"]
    full, full_vision = checkpoint_bytes(preset)
    run, run_vision = checkpoint_bytes(preset, arch["vision_depth"], arch["text_layers"])
    added = {
        VISION_STEP: (full_vision - run_vision) / 1e9,
        TEXT_STEP: (full - full_vision - run + run_vision) / 1e9,
    }
    w_small, w_large = small["weights_gb"], large["weights_gb"]
    steps = []
    in_large = {s["step"]: s for s in large["steps"]}
    for first in small["steps"]:  # a step the larger run lacks is projected from the smaller one
        step = in_large.get(first["step"], first)
        a, b = first["peak_rss_gb"], step["peak_rss_gb"]
        alone = one_run or step is first
        ran = small if step is first else large
        run, run_vision = checkpoint_bytes(
            preset, ran["architecture"]["vision_depth"], ran["architecture"]["text_layers"]
        )
        added = {
            VISION_STEP: (full_vision - run_vision) / 1e9,
            TEXT_STEP: (full - full_vision - run + run_vision) / 1e9,
        }
        if whole_model_per_graph:  # the loader copies every tensor in: each graph step holds all
            added = {}
        holds_weights = b > 0.3 * ran["weights_gb"]  # steps that hold no weights stay put
        if alone or step["step"] == VISION_STEP:  # the runs differ in language layers only
            slope = 1.0 if holds_weights else 0.0
        else:
            slope = (b - a) / (w_large - w_small)
        projected = b + slope * added.get(step["step"], (full - run) / 1e9)
        source = "projected"
        if (
            step["step"] == VISION_STEP
            and full_vision_step is not None
            and full_vision_step > projected
        ):
            projected, source = full_vision_step, "full-depth vision tower (3B run)"
        steps.append(
            {
                "step": step["step"],
                "peak_small_gb": a,
                "peak_large_gb": b,
                "slope_per_weight_gb": round(slope, 3),
                "projected_gb": round(projected, 2),
                "source": source
                if not (step is first and not one_run)
                else "smaller run only, slope 1",
                "seconds_small": first["seconds"],
                "seconds_large": step["seconds"],
            }
        )
    return {
        "weights_small_gb": w_small,
        "weights_large_gb": w_large,
        "weights_full_gb": round(full / 1e9, 2),
        "steps": steps,
        "projected_peak_gb": max(s["projected_gb"] for s in steps),
    }


def markdown(
    result: dict,
    small: dict,
    large: dict,
    command: str,
    ram_gb: float,
    preset: str = "qwen2.5-vl-7b",
) -> str:
    from benchmarks.shared.machine import markdown_header

    title, widths, full_depth, counted = PRESET_FACTS[preset]
    a, b = small["architecture"], large["architecture"]
    fits = result["projected_peak_gb"] <= ram_gb
    lines = [
        f"# {title} export: peak memory, measured at reduced depth, projected to full depth",
        "",
        markdown_header(large["machine"]),
        f"- projection: `{command}`"
        + (
            ""
            if a is b
            else f" over that run and the same at "
            f"{a['text_layers']} language layers "
            f"({small['machine']['date']})"
        ),
        "",
        f"Checkpoints: random weights, {widths}, "
        f"{a['vision_depth']} vision blocks + "
        + (f"{a['text_layers']}" if a is b else f"{a['text_layers']} / {b['text_layers']}")
        + f" language layers: {result['weights_small_gb']:.2f}"
        + ("" if a is b else f" / {result['weights_large_gb']:.2f}")
        + " GB of fp32 weights. "
        f"Full depth ({full_depth}): **{result['weights_full_gb']:.2f} GB** of fp32 weights "
        f"(counted on the config, {counted}). Export "
        "with the check on (defaults of `colembed export`). "
        + (
            "Slope 1 for every step that holds weights (one measured depth; see the script's "
            "docstring)."
            if a is b
            else "Slopes from the two depths."
        ),
        "",
        f"**Projected peak RSS {result['projected_peak_gb']:.1f} GB: "
        + ("fits" if fits else "does not fit")
        + f" this machine's {ram_gb:.1f} GB of RAM.** "
        f"Check at reduced depth: max abs diff {small['check'].get('max_abs_diff', float('nan')):.1e}"
        f" / {large['check'].get('max_abs_diff', float('nan')):.1e} on the final embeddings.",
        "",
        "| step | peak GB (small) | peak GB (large) | slope (GB per GB of weights) | projected GB | from |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for s in result["steps"]:
        lines.append(
            f"| {s['step']} | {s['peak_small_gb']:.2f} | {s['peak_large_gb']:.2f} | "
            f"{s['slope_per_weight_gb']:.2f} | {s['projected_gb']:.2f} | {s['source']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("small")
    parser.add_argument("large", nargs="?", help="a second depth (else slope 1, see above)")
    parser.add_argument("--preset", default="qwen2.5-vl-7b")
    parser.add_argument("--full-3b", help="a full-depth bench_export JSON of the same vision tower")
    parser.add_argument(
        "--whole-model-per-graph",
        action="store_true",
        help="each graph step holds the whole model (a loader that copies every "
        "tensor in, as ColQwen3's does, not a memory map): project both graph "
        "steps along all added weights",
    )
    parser.add_argument("--results", required=True, help="output path without extension")
    args = parser.parse_args()

    small = json.loads(Path(args.small).read_text())
    large = json.loads(Path(args.large).read_text()) if args.large else None
    full_vision = None
    if args.full_3b:
        full = json.loads(Path(args.full_3b).read_text())
        full_vision = next(s["peak_rss_gb"] for s in full["steps"] if s["step"] == VISION_STEP)
    result = project(small, large, args.preset, full_vision, args.whole_model_per_graph)
    ram = ((large or small)["machine"].get("memory_gib") or 24.0) * 2**30 / 1e9  # GiB -> GB
    command = "python -m benchmarks.export.project " + " ".join(sys.argv[1:])
    Path(args.results + ".json").write_text(
        json.dumps(
            {"machine": (large or small)["machine"], "small": small, "large": large, **result},
            indent=2,
        )
        + "\n"
    )
    Path(args.results + ".md").write_text(
        markdown(result, small, large or small, command, float(ram), args.preset)
    )
    print(Path(args.results + ".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
