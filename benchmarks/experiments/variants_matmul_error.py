"""Question: Where does int8's error arise, MatMul by MatMul?
Answer: nowhere alone: every MatMul's own per-token cosine is >= 0.9994; the loss adds up over depth
Note: benchmarks/results/experiments/variants-matmul-error-2b-heldout.md

Where int8's error arises: each weight-MatMul's int8 output against fp32, on the same input.

    python -m benchmarks.experiments.variants_matmul_error FP32_FOLDER [--items page,query] \
        [--results benchmarks/results/variants-matmul-error]

For every MatMul the int8 recipe quantises (both graphs), the fp32 graph's own input to it is
recorded on each gate item (onnxruntime, the fp32 export folder's graphs), and the int8 recipe's
product is emulated in numpy exactly as quantise.py writes it: the recipe's SmoothQuant factors
(recipes.py decides them on the exporter's calibration feeds), 7-bit per-column weights, one
activation scale per token, the recipe's fp32 outlier channels. Per MatMul and item: the minimum
per-token cosine of the int8 product to X @ W, and which token (image token or text token). This
is the LOCAL error of each MatMul (fp32 input on both sides); how it accumulates through the
layers is what the gate measures on the whole graphs (variants_fidelity.py).

What it models: the recipe's decisions and arithmetic, on the folder's real inputs (gate pages and
queries). What it does not: onnxruntime's integer kernels (the emulation rounds like
QuantizeLinear, round half to even, and sums exactly in int64; 7-bit weights keep the AVX2 kernels
exact, quantise.py), and the propagation of errors between MatMuls.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parents[1]  # the benchmarks folder


def record_feeds(folder: Path, pages: list[Any], queries: list[str]) -> dict[str, list[dict]]:
    """Each role's fp32 feeds for the pages (one at a time) then the queries (one at a time)."""
    import warnings

    import colembed
    from colembed.errors import QueryTruncatedWarning
    from colembed_export.variants.gates import recording_feeds

    runtime = colembed.load(folder, verify=False)
    recorded = recording_feeds(runtime)
    for page in pages:
        runtime.embed_images([page], batch_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QueryTruncatedWarning)
        for query in queries:
            runtime.embed_queries([query])
    return recorded


def emulated_int8(
    x: np.ndarray,
    w: np.ndarray,
    smoothing: np.ndarray | None,
    outliers: np.ndarray | None,
    levels: int,
) -> np.ndarray:
    """quantise.py's "row" product of x (tokens, K) and w (K, M), in numpy."""
    from colembed_export.variants.quantise import INT8_PEAK, ROW_SCALE_FLOOR, quantised_weight

    x = x.astype(np.float64)
    w = w.astype(np.float64)
    if smoothing is not None:
        x = x / smoothing
        w = w * smoothing[:, None]
    exact = np.zeros((x.shape[0], w.shape[1]))
    if outliers is not None and outliers.size:
        exact = x[:, outliers] @ w[outliers]
        x = x.copy()
        w = w.copy()
        x[:, outliers] = 0.0
        w[outliers] = 0.0
    wq, ws = quantised_weight(w.astype(np.float32), levels)
    scale = np.maximum(np.abs(x).max(axis=1), ROW_SCALE_FLOOR * INT8_PEAK) / INT8_PEAK
    xq = np.clip(np.rint(x / scale[:, None]), -INT8_PEAK, INT8_PEAK)
    return (xq @ wq.astype(np.float64)) * scale[:, None] * ws[None, :].astype(np.float64) + exact


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return np.sum(a * b, axis=1) / np.maximum(norms, 1e-30)


def matmul_errors(
    folder: Path,
    role: str,
    feeds: list[dict],
    names: list[str],
    calibration: list[dict],
    image_token_id: int | None,
) -> list[dict]:
    """Per MatMul and item: min per-token cosine of the emulated int8 product to fp32's."""
    import onnx_ir as ir

    from colembed_export.graphs.edits import _probe, channel_maxima_per_feed, module_path
    from colembed_export.variants.quantise import WEIGHT_PEAK
    from colembed_export.variants.recipes import row_calibration, weight_matmuls

    src = folder / f"{role}.onnx"
    model = ir.load(src)
    matmuls = weight_matmuls(model)
    inputs = sorted({n.inputs[0].name for n in matmuls})
    per_feed = channel_maxima_per_feed(src, inputs, calibration)
    factors, outliers = row_calibration(model, src, matmuls, calibration, per_feed)
    none = np.zeros(0, dtype=np.intp)
    rows = []
    with _probe(src, lambda graph: list(inputs)) as (session, outs):
        for item, feed in zip(names, feeds):
            values = dict(zip(outs, session.run(outs, feed)))
            kinds = None
            if image_token_id is not None and "input_ids" in feed:
                kinds = feed["input_ids"][0] == image_token_id
            for node in matmuls:
                x = values[node.inputs[0].name]
                x = x.reshape(-1, x.shape[-1])
                w = node.inputs[1].const_value.numpy()
                s = factors.get(node.name)
                found = outliers.get(node.name, none)
                want = x.astype(np.float64) @ w.astype(np.float64)
                got = emulated_int8(x, w, s, found, WEIGHT_PEAK)
                cos = row_cosines(got, want)
                worst = int(np.argmin(cos))
                token = (
                    "image"
                    if kinds is not None and kinds.size == cos.size and kinds[worst]
                    else "text"
                    if kinds is not None
                    else "patch"
                )
                row = {
                    "role": role,
                    "item": item,
                    "matmul": module_path(node),
                    "min": float(cos.min()),
                    "mean": float(cos.mean()),
                    "worst_token": worst,
                    "worst_kind": token,
                    "outliers": int(found.size),
                    "depth": int(w.shape[0]),
                }
                if kinds is not None and kinds.size == cos.size and kinds.any():
                    row["min_image"] = float(cos[kinds].min())
                    row["min_text"] = float(cos[~kinds].min())
                rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="an fp32 export folder")
    parser.add_argument(
        "--pages",
        default="",
        help="comma-separated gate page names to run (default: all gate pages)",
    )
    parser.add_argument(
        "--queries", default="bound", help="'bound' (the query at the bound), 'all' or 'none'"
    )
    parser.add_argument("--results", help="results path without extension")
    args = parser.parse_args()

    import colembed
    from colembed_export.variants.gates import calibration_feeds, gate_pages, gate_queries
    from benchmarks.shared.common import machine_info, report_results

    info = machine_info()
    reference = colembed.load(args.folder, verify=False)
    pages = gate_pages(reference)
    if args.pages:
        wanted = args.pages.split(",")
        pages = [p for p in pages if any(w in p[0] for w in wanted)]
    queries = gate_queries(reference)
    queries = {"all": queries, "none": [], "bound": queries[-1:]}[args.queries]
    image_token = reference.config.image_token_id
    del reference
    feeds = record_feeds(args.folder, [p for _, p in pages], [q for _, q in queries])
    calibration = calibration_feeds(args.folder)
    names = [f"page: {n}" for n, _ in pages]
    rows = matmul_errors(args.folder, "vision", feeds["vision"], names, calibration["vision"], None)
    rows += matmul_errors(
        args.folder,
        "text",
        feeds["text"],
        names + [f"query: {n}" for n, _ in queries],
        calibration["text"],
        image_token,
    )
    lines = [
        f"folder: `{args.folder}`",
        "",
        "| role | MatMul | item | min cos | worst token | min image tok | min text tok | "
        "fp32 outlier ch / depth |",
        "|---|---|---|---:|---|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: r["min"])[:60]:
        lines.append(
            f"| {r['role']} | {r['matmul']} | {r['item']} | {r['min']:.5f} | "
            f"{r['worst_kind']} {r['worst_token']} | {r.get('min_image', float('nan')):.5f} | "
            f"{r.get('min_text', float('nan')):.5f} | {r['outliers']} / {r['depth']} |"
        )
    title = "int8 local error per MatMul (emulated recipe vs fp32, same fp32 input)"
    report_results(title, info, lines, args.results, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
