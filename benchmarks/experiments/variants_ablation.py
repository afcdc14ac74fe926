"""Question: Which int8 MatMuls cost the page fidelity?
Answer: none alone: no group kept fp32 lifts the worst page to min 0.95 (best 0.939): error spread
Note: benchmarks/results/experiments/variants-ablation-2b-heldout.md

Which int8 MatMuls cost the page fidelity: the text graph in int8 with groups of MatMuls kept fp32.

    python -m benchmarks.experiments.variants_ablation FP32_FOLDER \
        [--pages "sample page 2,smallest"]

The vision graph stays fp32 in every arm (so the text graph's share of the error is isolated).
Each arm writes the text graph with the int8 recipe's decisions (SmoothQuant factors and fp32
outlier channels, decided once on the exporter's calibration feeds) and keeps one group of
MatMuls in fp32 (all of one projection kind, or all of one layer); the per-token cosine of the
final embeddings to fp32 (mean / min) is measured through the colembed runtime on the named gate
pages. Per-MatMul local errors (variants_matmul_error.py) are ~1e-4 everywhere; this shows how
they add up to the embedding, which is what the gate judges. `--int8-levels W,A` writes every arm
with other code peaks (weights -W..W, activations -A..A; quantise.py WEIGHT_PEAK / ACTIVATION_PEAK);
`--nbits8 BLOCK` with onnxruntime's MatMulNBits 8-bit blocks (activation scale per token and block).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from colembed.layout import BASE_VARIANT

HERE = Path(__file__).resolve().parents[1]  # the benchmarks folder


def write_arm(
    fp32: Path,
    arm: Path,
    keep: set[str],
    calibration: list[dict],
    per_feed: dict,
    levels: tuple[int, int] | None = None,
    nbits8: int | None = None,
) -> None:
    import onnx_ir as ir

    from colembed.integrity import describe_file
    from colembed.manifest import MANIFEST_NAME, Manifest, read_manifest
    from colembed_export.graphs.edits import finish
    from colembed_export.variants.quantise import quantise_matmuls
    from colembed_export.variants.recipes import row_calibration, weight_matmuls
    from colembed_export.variants.write import save_graph

    # The arm's graph is written into the fp32 folder itself (onnx_ir refuses hard-linked external
    # data, and a copy per arm costs the whole folder); `arm` holds the fp32 manifest to restore.
    arm.mkdir(parents=True, exist_ok=True)
    if not (arm / MANIFEST_NAME).is_file():
        shutil.copy(fp32 / MANIFEST_NAME, arm / MANIFEST_NAME)
    src = fp32 / "text.onnx"
    model = ir.load(src)
    matmuls = weight_matmuls(model)
    factors, outliers = row_calibration(model, src, matmuls, calibration, per_feed)
    schemes = {}
    from colembed_export.graphs.edits import module_path

    for node in matmuls:
        path = module_path(node)
        kept = any(k in path for k in keep)  # quantise_matmuls smooths a kept MatMul's weight
        schemes[node.name] = (
            BASE_VARIANT if kept else "row"
        )  # quantise.SCHEMES: BASE_VARIANT keeps fp32
    from colembed_export.variants.quantise import (
        ACTIVATION_PEAK,
        WEIGHT_PEAK,
        quantise_int4_matmuls,
    )

    if nbits8:  # MatMulNBits 8-bit blocks (kept MatMuls fp32, unsmoothed: the kernel's per-block
        # activation scales do not need SmoothQuant; the smoothed weights above are undone by it)
        model = ir.load(src)
        chosen = [n for n in weight_matmuls(model) if not any(k in module_path(n) for k in keep)]
        quantise_int4_matmuls(model, chosen, block_size=nbits8, accuracy_level=4, bits=8)
    else:
        weights, activations = levels or (WEIGHT_PEAK, ACTIVATION_PEAK)
        quantise_matmuls(
            model,
            schemes,
            factors,
            outliers=outliers,
            weight_levels=weights,
            activation_levels=activations,
        )
    finish(model)
    file, data = save_graph(model, fp32, "text.ablation.onnx", external=True)
    manifest = read_manifest(arm)
    d = manifest.to_dict()
    vision = manifest.graph(BASE_VARIANT, "vision").to_dict()
    text = dict(manifest.graph(BASE_VARIANT, "text").to_dict(), file=file, data_file=data)
    d["variants"]["int8"] = {"vision": vision, "text": text}
    d["files"].update({f: describe_file(fp32 / f) for f in (file, data)})
    Manifest.from_dict(d).write(fp32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--pages", default="sample page 2,smallest")
    parser.add_argument(
        "--arms",
        default="none,mlp.down_proj,self_attn.o_proj,self_attn.v_proj,"
        "mlp.up_proj,mlp.gate_proj,layers.0.,layers.1.,projection",
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/colembed-bench-ablation"))
    parser.add_argument("--results")
    parser.add_argument(
        "--int8-levels", help="W,A: weight and activation code peaks (default: quantise.py's)"
    )
    parser.add_argument(
        "--nbits8",
        type=int,
        metavar="BLOCK",
        help="write the int8 MatMuls as "
        "MatMulNBits 8-bit blocks of BLOCK along K, accuracy level 4 (activations "
        "quantised per token and block by the kernel) instead of the row scheme",
    )
    args = parser.parse_args()
    levels = tuple(int(v) for v in args.int8_levels.split(",")) if args.int8_levels else None

    import colembed
    from colembed_export.variants.gates import calibration_feeds, gate_pages, token_cosines
    from colembed_export.graphs.edits import channel_maxima_per_feed
    from colembed_export.variants.recipes import weight_matmuls
    from benchmarks.shared.common import machine_info, report_results

    import onnx_ir as ir

    info = machine_info()
    reference = colembed.load(args.folder, verify=False)
    pages = [p for p in gate_pages(reference) if any(w in p[0] for w in args.pages.split(","))]
    want = [reference.embed_images([img], batch_size=1)[0] for _, img in pages]
    del reference
    calibration = calibration_feeds(args.folder)["text"]
    src = args.folder / "text.onnx"
    inputs = sorted({n.inputs[0].name for n in weight_matmuls(ir.load(src))})
    per_feed = channel_maxima_per_feed(src, inputs, calibration)
    rows = []
    for arm in args.arms.split(","):
        keep = set() if arm == "none" else {arm}
        write_arm(args.folder, args.work, keep, calibration, per_feed, levels, args.nbits8)
        model = colembed.load(args.folder, variant="int8", verify=False)
        for (name, img), w in zip(pages, want):
            cos = token_cosines([model.embed_images([img], batch_size=1)[0]], [w])
            rows.append(
                {
                    "fp32 kept": arm,
                    "int8 levels": (
                        f"MatMulNBits 8-bit, block {args.nbits8}"
                        if args.nbits8
                        else args.int8_levels or "default"
                    ),
                    "page": name,
                    "mean": float(cos.mean()),
                    "min": float(cos.min()),
                    "worst_token": int(cos.argmin()),
                    "tokens": int(cos.size),
                }
            )
            print(rows[-1], flush=True)
        del model
    from colembed.manifest import MANIFEST_NAME

    shutil.copy(args.work / MANIFEST_NAME, args.folder / MANIFEST_NAME)  # fp32 only again
    for name in ("text.ablation.onnx", "text.ablation.onnx_data"):
        (args.folder / name).unlink(missing_ok=True)
    lines = [
        f"folder: `{args.folder}`",
        "",
        "| kept fp32 | int8 code peaks W,A | page | mean | min | worst token / tokens |",
        "|---|---|---|---:|---:|---:|",
    ]
    lines += [
        f"| {r['fp32 kept']} | {r['int8 levels']} | {r['page']} | {r['mean']:.5f} | {r['min']:.4f} | "
        f"{r['worst_token']} / {r['tokens']} |"
        for r in rows
    ]
    title = "int8 text graph, vision fp32: which MatMuls cost the pages"
    report_results(title, info, lines, args.results, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
