"""Does int8 vision attention pay on this CPU? One Qwen2-VL-2B vision attention, three ways, interleaved.

    python benchmarks/bench_attention_int8.py                 # letter page: 2,976 patches
    python benchmarks/bench_attention_int8.py --tokens 1024 --rounds 7

Issue 25 asks whether the vision tower's attention (QK^T and PV over ~3,000 patches, 32 blocks,
~1.45 TFLOP a page at full depth, all fp32) should run its products in int8 through
MatMulInteger. This times one block's attention on the shapes of a letter page (16 heads of 80,
`--tokens` patches, one image) as onnxruntime graphs with the same threads:

- "fp32 MultiHeadAttention": what the exported vision graph runs (com.microsoft.MultiHeadAttention;
  on CPU in fp32 without mask it takes MLAS's flash attention: blocked, no T x T score tensor);
- "fp32 MatMul-Softmax-MatMul": the unfused products (the score tensor materialised), so the
  int8 row's difference splits into "unfused" and "int8";
- "int8 QK^T and PV": the same unfused chain with both products in MatMulInteger: Q per (head,
  token) row in uint8 around 128, K per (head, key token) and V per (head, channel) in 7-bit int8
  (u8 x s8 pair sums must fit 16 bits on AVX2 without VNNI, see export/quantise.py), softmax in
  fp32, the probabilities per row in uint8 (scale row max / 255), every scale applied after the
  integer product.

Every graph runs once per round, rounds interleaved (order reversed every other round); the table
gives the median and spread over rounds, each graph's time over fp32 MultiHeadAttention's, and the
per-token cosine of each output to MultiHeadAttention's on random inputs of the model's scale
(q, k, v ~ N(0, 1): random weights, not a trained tower's peaked attention). Writes
results/attention-int8.{md,json} with the machine, instruction sets, load and command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import load_average, machine_info, markdown_header, markdown_table, spread  # noqa: E402

from colembed.sessions import Session, physical_cores  # noqa: E402

HEADS, HEAD_DIM = 16, 80  # Qwen2-VL-2B's vision tower
LETTER_PATCHES = 2976  # a letter page at 150 dpi: 744 image tokens x 4 patches each
KV_PEAK = 63  # 7-bit K and V (u8 x s8 pair sums fit int16 on AVX2 without VNNI)


def _graphs(tokens: int) -> dict[str, Any]:
    """The three attention graphs over q, k, v of shape (1, tokens, heads * head_dim)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    width = HEADS * HEAD_DIM
    scale = HEAD_DIM ** -0.5
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, tokens, width])
              for n in ("q", "k", "v")]
    output = [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, tokens, width])]
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    c = lambda name, value, dtype=np.int64: numpy_helper.from_array(np.array(value, dtype), name)  # noqa: E731
    consts = [c("heads_shape", [tokens, HEADS, HEAD_DIM]), c("rows_shape", [HEADS * tokens, -1]),
              c("bhtd_shape", [HEADS, tokens, -1]), c("out_shape", [1, tokens, width]),
              c("flat_shape", [tokens, width]), c("axis_last", [-1]),
              c("u8_128", 128, np.uint8), c("u8_0", 0, np.uint8), c("i8_0", 0, np.int8),
              c("inv127", 1 / 127, np.float32), c("inv_kv", 1 / KV_PEAK, np.float32),
              c("inv255", 1 / 255, np.float32), c("floor", 1e-30, np.float32),
              c("softmax_scale", scale, np.float32)]
    n = helper.make_node

    def heads(x):  # (1, T, H*D) -> (H, T, D)
        return [n("Reshape", [x, "heads_shape"], [f"{x}_thd"]),
                n("Transpose", [f"{x}_thd"], [f"{x}_htd"], perm=[1, 0, 2])]

    def row_scale(x, rows, inv, name):  # per row of the 2-D `rows`: max |x| * inv (floored)
        return [n("Abs", [rows], [f"{name}_abs"]),
                n("ReduceMax", [f"{name}_abs", "axis_last"], [f"{name}_peak"], keepdims=0),
                n("Max", [f"{name}_peak", "floor"], [f"{name}_floored"]),
                n("Mul", [f"{name}_floored", inv], [f"{name}_scale"])]

    mha = helper.make_graph(
        [n("MultiHeadAttention", ["q", "k", "v"], ["out"], domain="com.microsoft",
           num_heads=HEADS, scale=scale)], "mha", inputs, output)

    unfused_nodes = heads("q") + heads("k") + heads("v") + [
        n("Transpose", ["k_htd"], ["k_hdt"], perm=[0, 2, 1]),
        n("MatMul", ["q_htd", "k_hdt"], ["scores_raw"]),
        n("Mul", ["scores_raw", "softmax_scale"], ["scores"]),
        n("Softmax", ["scores"], ["probs"], axis=-1),
        n("MatMul", ["probs", "v_htd"], ["o_htd"]),
        n("Transpose", ["o_htd"], ["o_thd"], perm=[1, 0, 2]),
        n("Reshape", ["o_thd", "out_shape"], ["out"])]
    used = {name for node in unfused_nodes for name in node.input}
    unfused = helper.make_graph(unfused_nodes, "unfused", inputs, output,
                                [t for t in consts if t.name in used])

    int8_nodes = heads("q") + heads("k") + heads("v") + [
        # Q: one uint8 scale per (head, token) row, zero point 128
        n("Reshape", ["q_htd", "rows_shape"], ["q_rows"]),
        *row_scale("q", "q_rows", "inv127", "q"),
        n("Shape", ["q_scale"], ["q_count"]), n("Expand", ["u8_128", "q_count"], ["q_zps"]),
        n("QuantizeLinear", ["q_rows", "q_scale", "q_zps"], ["q_u8_rows"], axis=0),
        n("Reshape", ["q_u8_rows", "bhtd_shape"], ["q_u8"]),
        # K: one 7-bit scale per (head, key token), as the columns of K^T
        n("Reshape", ["k_htd", "rows_shape"], ["k_rows"]),
        *row_scale("k", "k_rows", "inv_kv", "k"),
        n("Shape", ["k_scale"], ["k_count"]), n("Expand", ["i8_0", "k_count"], ["k_zps"]),
        n("QuantizeLinear", ["k_rows", "k_scale", "k_zps"], ["k_i8_rows"], axis=0),
        n("Reshape", ["k_i8_rows", "bhtd_shape"], ["k_i8"]),
        n("Transpose", ["k_i8"], ["k_i8_t"], perm=[0, 2, 1]),
        n("MatMulInteger", ["q_u8", "k_i8_t", "u8_128", "i8_0"], ["s_int"]),
        n("Cast", ["s_int"], ["s_float"], to=TensorProto.FLOAT),
        n("Reshape", ["q_scale", "bhtd_shape"], ["q_scale_col"]),  # (H, T, 1)
        n("Mul", ["q_scale_col", "softmax_scale"], ["q_scale_soft"]),
        n("Reshape", ["k_scale", c("k_row_shape", [HEADS, 1, tokens]).name], ["k_scale_row"]),
        n("Mul", ["s_float", "q_scale_soft"], ["s_q"]),
        n("Mul", ["s_q", "k_scale_row"], ["scores"]),
        n("Softmax", ["scores"], ["probs"], axis=-1),
        # P: one uint8 scale per row (row max / 255), zero point 0
        n("Reshape", ["probs", "rows_shape"], ["p_rows"]),
        n("ReduceMax", ["p_rows", "axis_last"], ["p_peak"], keepdims=0),
        n("Mul", ["p_peak", "inv255"], ["p_scale"]),
        n("Shape", ["p_scale"], ["p_count"]), n("Expand", ["u8_0", "p_count"], ["p_zps"]),
        n("QuantizeLinear", ["p_rows", "p_scale", "p_zps"], ["p_u8_rows"], axis=0),
        n("Reshape", ["p_u8_rows", "bhtd_shape"], ["p_u8"]),
        # V: one 7-bit scale per (head, channel) over the tokens
        n("Reshape", ["v", "flat_shape"], ["v_flat"]),
        n("Abs", ["v_flat"], ["v_abs"]),
        n("ReduceMax", ["v_abs", c("axis0", [0]).name], ["v_peak"], keepdims=0),
        n("Max", ["v_peak", "floor"], ["v_floored"]),
        n("Mul", ["v_floored", "inv_kv"], ["v_scale"]),
        n("Shape", ["v_scale"], ["v_count"]), n("Expand", ["i8_0", "v_count"], ["v_zps"]),
        n("QuantizeLinear", ["v_flat", "v_scale", "v_zps"], ["v_i8_flat"], axis=1),
        n("Reshape", ["v_i8_flat", "heads_shape"], ["v_i8_thd"]),
        n("Transpose", ["v_i8_thd"], ["v_i8"], perm=[1, 0, 2]),
        n("MatMulInteger", ["p_u8", "v_i8", "u8_0", "i8_0"], ["o_int"]),
        n("Cast", ["o_int"], ["o_float"], to=TensorProto.FLOAT),
        n("Reshape", ["p_scale", "bhtd_shape"], ["p_scale_col"]),
        n("Reshape", ["v_scale", c("v_row_shape", [HEADS, 1, HEAD_DIM]).name], ["v_scale_row"]),
        n("Mul", ["o_float", "p_scale_col"], ["o_p"]),
        n("Mul", ["o_p", "v_scale_row"], ["o_htd"]),
        n("Transpose", ["o_htd"], ["o_thd"], perm=[1, 0, 2]),
        n("Reshape", ["o_thd", "out_shape"], ["out"])]
    extra = [c("k_row_shape", [HEADS, 1, tokens]), c("v_row_shape", [HEADS, 1, HEAD_DIM]),
             c("axis0", [0])]
    int8 = helper.make_graph(int8_nodes, "int8", inputs, output, consts + extra)
    return {name: helper.make_model(g, opset_imports=opsets) for name, g in (
        ("fp32 MultiHeadAttention", mha), ("fp32 MatMul-Softmax-MatMul", unfused),
        ("int8 QK^T and PV", int8))}


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=LETTER_PATCHES, help="patches of the image")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, help="intra-op threads (default: physical cores)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    threads = args.threads or physical_cores()
    info = machine_info()
    load_start = load_average()
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((1, args.tokens, HEADS * HEAD_DIM), dtype=np.float32)
             for n in ("q", "k", "v")}
    sessions = {name: Session(model.SerializeToString(), threads=threads)
                for name, model in _graphs(args.tokens).items()}
    outputs = {name: s.run(feeds)[0][0] for name, s in sessions.items()}  # warm-up + outputs
    reference = outputs["fp32 MultiHeadAttention"]
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for r in range(args.rounds):
        order = list(sessions.items())
        if r % 2:
            order.reverse()
        for name, session in order:
            start = time.perf_counter()
            session.run(feeds)
            times[name].append(time.perf_counter() - start)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{name} {times[name][-1]:.3f} s" for name in sessions), file=sys.stderr, flush=True)
    flops = 2 * 2 * HEADS * args.tokens**2 * HEAD_DIM
    rows = {}
    for name in sessions:
        out = outputs[name]
        cosine = np.sum(out * reference, 1) / np.linalg.norm(out, axis=1) / np.linalg.norm(
            reference, axis=1)
        paired = [t / m for t, m in zip(times[name], times["fp32 MultiHeadAttention"])]
        rows[name] = {"s": spread(times[name]), "over_mha": spread(paired),
                      "gflops": flops / statistics.median(times[name]) / 1e9,
                      "cosine_mean": float(cosine.mean()), "cosine_min": float(cosine.min())}
    results = {"machine": info, "tokens": args.tokens, "heads": HEADS, "head_dim": HEAD_DIM,
               "threads": threads, "rounds": args.rounds, "load_average_start": load_start,
               "load_average_end": load_average(), "flops": flops, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention-int8.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [f"# One vision attention, {args.tokens} patches x {HEADS} heads of {HEAD_DIM}: "
             "fp32 fused, fp32 unfused, int8 products", "", markdown_header(info),
             f"- threads {threads}; {args.rounds} interleaved rounds after a warm-up; load "
             f"average at start {load_start}, at end {results['load_average_end']}",
             f"- {flops / 1e9:.1f} GFLOP of products per run; cosine: per token, to "
             "MultiHeadAttention's output, q/k/v ~ N(0, 1)", ""]
    lines += markdown_table(
        ["graph", "s (median)", "spread s", "x MHA time (median of rounds)", "GFLOP/s",
         "mean / min cosine"],
        [[name, f"{r['s']['median']:.3f}", f"{r['s']['min']:.3f} - {r['s']['max']:.3f}",
          f"{r['over_mha']['median']:.2f} ({r['over_mha']['min']:.2f} - {r['over_mha']['max']:.2f})",
          f"{r['gflops']:.0f}", f"{r['cosine_mean']:.5f} / {r['cosine_min']:.5f}"]
         for name, r in rows.items()])
    (args.out / "attention-int8.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
