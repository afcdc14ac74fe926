"""Question: How large is one int8 row MatMul's error per code split and with two codes?
Answer: 1.3-2.1% relative at one code, least at the even split (90/90); two codes halve it
Note: benchmarks/results/experiments/variants-int8-code-error.md

One int8 "row" MatMul's rounding error for each exact code split and with two codes per weight.

    python -m benchmarks.experiments.variants_int8_code_error [--results benchmarks/results/NAME]

quantise.py's row scheme emulated in numpy (float64 / int64): weights symmetric per output column
in -W..W, activations per token in -A..A, optionally a second weight code for the first's residual
(quantise.quantised_weight_passes). Every arm keeps its stored codes' AVX2 pair sums within int16
(W x 2 x (2A + 1) <= 32767, quantise_matmuls refuses the rest). Reported: the relative error of
the product, ||Y_q - Y|| / ||Y||, and 1 - the mean per-token cosine, at the input depths of the
tiny fixture (128) and of Qwen2-VL-2B's text layers (1536: q/k/v/gate/up, 8960: down).

What it models: random-weight checkpoints (Gaussian weights and activations), where each MatMul's
error is set by the code steps alone; through 28 layers these errors add up (the cosine loss
grows about linearly with depth, benchmarks/results/variants-fidelity-depth.md). What it does
not: trained or stress-trait activations (outlier channels, heavy tails: there the activations'
step dominates, variants-int8-bits.md), SmoothQuant, the outlier split, or kernel exactness
(tests/export/variants/test_quantise_levels.py runs the real kernels).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parents[1]  # the benchmarks folder

# (weight peak, activation peak, weight codes): today's, the other exact splits, two codes.
ARMS = [(63, 127, 1), (127, 63, 1), (90, 90, 1), (63, 127, 2)]


def row_product(
    x: np.ndarray, weight: np.ndarray, weights: int, activations: int, passes: int
) -> np.ndarray:
    from colembed_export.variants.quantise import quantised_weight_passes

    scale = np.abs(x).max(axis=1, keepdims=True) / activations
    codes = np.clip(np.rint(x / scale), -activations, activations)
    return sum(
        (codes @ c.astype(np.float64)) * scale * s.astype(np.float64)[None, :]
        for c, s in quantised_weight_passes(weight.astype(np.float32), weights, passes)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", help="path without extension")
    args = parser.parse_args()
    from benchmarks.shared.common import machine_info, report_results

    rng = np.random.default_rng(0)
    rows = []
    for depth in (128, 1536, 8960):
        x = rng.standard_normal((64, depth))
        weight = rng.standard_normal((depth, 256)) * 0.02
        exact = x @ weight
        for w, a, passes in ARMS:
            got = row_product(x, weight, w, a, passes)
            cos = (got * exact).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(exact, axis=1)
            rows.append(
                {
                    "K": depth,
                    "weights": w,
                    "activations": a,
                    "codes": passes,
                    "relative_error": float(np.linalg.norm(got - exact) / np.linalg.norm(exact)),
                    "cosine_loss": float(1 - cos.mean()),
                }
            )
    lines = [
        "| K | weight peak | activation peak | codes per weight | relative error | "
        "1 - mean cosine |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['K']} | {r['weights']} | {r['activations']} | {r['codes']} | "
        f"{r['relative_error']:.4f} | {r['cosine_loss']:.2e} |"
        for r in rows
    ]
    report_results(
        "int8 row scheme: one MatMul's rounding error per code split",
        machine_info(),
        [
            "Gaussian activations (64 tokens) and weights (256 columns), numpy "
            "emulation of quantise.py's row scheme.",
            "",
        ]
        + lines,
        args.results,
        {"rows": rows},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
