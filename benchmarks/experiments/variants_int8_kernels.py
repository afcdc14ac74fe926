"""Question: Is MatMulNBits (8-bit blocks) faster or truer than the row scheme?
Answer: truer (min cosine 0.9997+ vs 0.988-0.997) but 1.7-3.5x the row scheme's time on AVX2
Note: benchmarks/results/experiments/variants-int8-bits.md

One int8 MatMul at Qwen2-VL-2B widths, three ways: the "row" scheme vs MatMulNBits 8-bit blocks.

    nice -n 19 .venv/bin/python -u benchmarks/experiments/variants_int8_kernels.py

Arms, on one MatMul with a constant (K, N) weight: quantise.py's "row" scheme (7-bit weights per
column, one activation scale per token, MatMulIntegerToFloat) and com.microsoft MatMulNBits with
8-bit asymmetric weight blocks of 16, 32 or 128 along K, accuracy level 4 (the kernel quantises the
activation to int8 per token and per block of K: the candidate "an activation scale
per row per group of input channels", fused in one kernel) or level 1 (fp32 compute). Per arm:
per-token cosine to the float64 product (min / mean), then time at 20 and 200 tokens,
interleaved (order reversed every round), median of 3 rounds (5 with `--row-only`), ratio to the
row scheme. The "row, 2 weight codes" arm is the row scheme with `weight_passes=2`
(each weight as two 7-bit codes: twice the integer products, one activation quantisation).

What it models: the MatMul shapes of a 2B-width text layer (1536 -> 8960 up/gate, 8960 -> 1536
down) and an activation with three channels 30x the rest (no fp32 outlier split in the row arm:
this is the kernel, not the recipe). What it does not: the recipe's SmoothQuant and outlier
channels, error propagation through layers (variants_ablation.py --nbits8 measures that), or
VNNI machines (MatMulNBits' int8 path differs there).
"""

from __future__ import annotations

import os
import time

import numpy as np


def _fp32_model(w):
    from onnx import TensorProto, helper, numpy_helper

    K, N = w.shape
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", N])],
        [numpy_helper.from_array(w, "w")],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


def row_model(w, passes=1):
    import onnx_ir as ir

    from colembed_export.variants.quantise import quantise_matmuls

    model = ir.from_proto(_fp32_model(w))
    quantise_matmuls(model, {"mm": "row"}, weight_passes=passes)
    return ir.to_proto(model)


def nbits8_model(w, block, accuracy):
    import onnx_ir as ir

    from colembed_export.variants.quantise import quantise_int4_matmuls

    model = ir.from_proto(_fp32_model(w))
    quantise_int4_matmuls(
        model,
        [n for n in model.graph if n.op_type == "MatMul"],
        block_size=block,
        accuracy_level=accuracy,
        bits=8,
    )
    return ir.to_proto(model)


def session(proto):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(
        proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def cosines(a, b):
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--row-only",
        action="store_true",
        help="only the row scheme with one and "
        "two weight codes (quantise_matmuls weight_passes), no MatMulNBits arms",
    )
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print("load average at start", os.getloadavg(), flush=True)
    for K, N in [(1536, 8960), (8960, 1536)]:
        w = (rng.standard_normal((K, N)) * 0.02).astype(np.float32)
        x = rng.standard_normal((200, K)).astype(np.float32)
        x[:, rng.integers(0, K, 3)] *= 30  # a few big channels
        arms = {"row": session(row_model(w)), "row, 2 weight codes": session(row_model(w, 2))}
        for block, accuracy in [] if args.row_only else [(16, 4), (32, 4), (128, 4), (32, 1)]:
            arms[f"nbits8 block {block} acc {accuracy}"] = session(nbits8_model(w, block, accuracy))
        want = x.astype(np.float64) @ w.astype(np.float64)
        for name, s in arms.items():
            c = cosines(s.run(None, {"x": x})[0], want)
            print(
                f"K {K} N {N} {name}: per-token cosine min {c.min():.6f} mean {c.mean():.6f}",
                flush=True,
            )
        for tokens in (20, 200):
            xs = x[:tokens]
            times = {n: [] for n in arms}
            reps = max(3, 200 // tokens)
            for r in range(5 if args.row_only else 3):
                for n in list(arms) if r % 2 == 0 else list(arms)[::-1]:
                    start = time.perf_counter()
                    for _ in range(reps):
                        arms[n].run(None, {"x": xs})
                    times[n].append((time.perf_counter() - start) / reps)
            base = np.median(times["row"])
            print(
                f"K {K} N {N} tokens {tokens}: "
                + "; ".join(
                    f"{n} {np.median(v) * 1e3:.1f} ms ({np.median(v) / base:.2f}x row)"
                    for n, v in times.items()
                ),
                flush=True,
            )
    print("load average at end", os.getloadavg(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
