"""The int8 vision graph's attention: QK^T and PV as integer products, one head at a time.

The fp32 vision graph runs each block's attention as onnxruntime's fused
`com.microsoft.MultiHeadAttention` (graphs.py): on CPU, without a mask, MLAS's flash attention in
fp32, at about the CPU's fp32 peak. At full Qwen2-VL-2B depth on a letter page (32 blocks,
2,976 patches, 16 heads of 80) that is ~1.45 TFLOP, 10.2 s of a 25.2 s int8 page
(results/embed/embed-full.md). `int8_attentions` rewrites each such node (three inputs: no mask, no
bias, no past) into:

- Q, K per (image, head) in one scale each (Q uint8 around 128; K int8 within +-63, so u8 x s8
  pair sums are exact on x86 with or without VNNI), V int8 per (image, head, channel), its scale
  applied to the small output;
- a Scan over (image, head): QK^T as ONE MatMulIntegerToFloat (the scores written once, both
  scales and the softmax scale applied in the kernel's output step; onnxruntime's CPU kernel takes
  scalar scales only, hence one head per call), Softmax, the probabilities to uint8 per query row
  (row max / 255), PV in MatMulInteger, the row scale applied to the (tokens, head_dim) output.
  One head's T x T score tensor instead of all heads': the passes over it stay near the cache.

Why it exists and why it is off (recipes.INT8_VISION_ATTENTION, the one switch; the fp32 graph
never changes): `benchmarks/experiments/attention_int8.py` (results/experiments/attention-int8.md, its "int8 per
head, P per row" row) measured one 2976-patch attention on the AVX-512 VNNI EPYC at 0.64x the
fused fp32 attention's time on a quiet machine (1.57x faster; a full-depth int8 page ~27.9 ->
~24 s), at par under load ~10 (the passes over the score tensor compete for memory), at a
per-token min cosine of 0.99899 (logits' std ~1) and 0.99796 (std ~4, sharper heads): the
integer QK^T with one scale per head sets the loss. The switch waits for an end-to-end A/B at
2B widths and the variants' gates at depth. Imports onnx_ir and numpy only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..graphs.edits import _swap_in, add_initializer

MS_DOMAIN = "com.microsoft"
# QuantizeLinear's and MatMulIntegerToFloat's codes: Q uint8 with zero point 128 (peak 127), the
# probabilities uint8 per row with zero point 0, K and V int8 within +-63. x86 CPUs without VNNI
# multiply u8 x s8 with pmaddubsw, which adds two products into a saturating int16: u8 255 with
# s8 codes to +-63 stays below 32767 on every x86 path (8-bit K and V saturated there).
CODE_PEAK = 127
SIGNED_CODE_PEAK = 63
PROB_LEVELS = 255
SCALE_FLOOR = 1e-30  # an all-zero head (padding) gets a tiny scale instead of a division by zero


def _attr(node: Any, name: str, default: Any) -> Any:
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def _eligible(node: Any) -> tuple[int, int, int] | None:
    """(heads, head_dim, width) of a plain 3-input MultiHeadAttention over (B, T, width), else None."""
    if node.op_type != "MultiHeadAttention" or node.domain != MS_DOMAIN:
        return None
    inputs = list(node.inputs)
    if len(inputs) != 3 or any(v is None for v in inputs) or _attr(node, "unidirectional", 0):
        return None
    heads = _attr(node, "num_heads", None)
    shape = inputs[0].shape
    if not heads or shape is None or len(shape) != 3 or not isinstance(shape[2], int):
        return None
    width = shape[2]
    if width % heads or any(v.shape is None or v.shape[-1] != width for v in inputs[1:]):
        return None
    return heads, width // heads, width


class _Consts:
    """Shared initializers of the rewrite (one set per graph)."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self.values: dict[str, Any] = {}

    def __call__(self, name: str, value: Any, dtype: Any = np.int64) -> Any:
        name = f"int8_attention_{name}"
        if name not in self.values:
            self.values[name] = add_initializer(self.graph, name, np.array(value, dtype))
        return self.values[name]


def _head_body(c: _Consts, tokens: Any, head_dim: int, prefix: str) -> Any:
    """The Scan body: one (image, head): q u8 (T, d), k^T s8 (d, T), v s8 (T, d), two scales."""
    import onnx_ir as ir

    def value(name, dtype, shape):
        return ir.Value(name=f"{prefix}_{name}", type=ir.TensorType(dtype), shape=ir.Shape(shape))

    q = value("bq", ir.DataType.UINT8, [tokens, head_dim])
    k_t = value("bkT", ir.DataType.INT8, [head_dim, tokens])
    v = value("bv", ir.DataType.INT8, [tokens, head_dim])
    q_scale = value("ba", ir.DataType.FLOAT, [])
    k_scale = value("bb", ir.DataType.FLOAT, [])
    nodes = []

    def add(op, inputs, domain="", **attributes):
        node = ir.node(
            op, inputs, attributes or None, domain=domain, name=f"{prefix}_{op}_{len(nodes)}"
        )
        node.outputs[0].name = f"{prefix}_{op}_{len(nodes)}_out"
        nodes.append(node)
        return node.outputs[0]

    scores = add(
        "MatMulIntegerToFloat",
        [q, k_t, q_scale, k_scale, c("u8_128", 128, np.uint8), c("i8_0", 0, np.int8)],
        domain=MS_DOMAIN,
    )
    probs = add("Softmax", [scores], axis=-1)
    row_peak = add("ReduceMax", [probs, c("axis_last", [-1])], keepdims=0)
    row_scale = add("Mul", [row_peak, c("inv_prob_levels", 1 / PROB_LEVELS, np.float32)])
    zero_points = add("Expand", [c("u8_0", 0, np.uint8), add("Shape", [row_scale])])
    codes = add("QuantizeLinear", [probs, row_scale, zero_points], axis=0)  # opset 18: no dtype
    product = add("MatMulInteger", [codes, v, c("u8_0", 0, np.uint8), c("i8_0", 0, np.int8)])
    product = add("Cast", [product], to=ir.DataType.FLOAT)
    column = add("Unsqueeze", [row_scale, c("axis_last", [-1])])
    out = add("Mul", [product, column])
    return ir.Graph([q, k_t, v, q_scale, k_scale], [out], nodes=nodes, name=f"{prefix}_head")


def _rewrite(
    graph: Any, node: Any, c: _Consts, heads: int, head_dim: int, width: int, softmax_scale: float
) -> list[Any]:
    import onnx_ir as ir

    prefix = node.name or f"mha_{id(node)}"
    query, key, value = node.inputs
    nodes: list[Any] = []

    def add(op, inputs, domain="", **attributes):
        n = ir.node(
            op, inputs, attributes or None, domain=domain, name=f"{prefix}_int8_{op}_{len(nodes)}"
        )
        n.outputs[0].name = f"{prefix}_int8_{op}_{len(nodes)}_out"
        n.metadata_props.update(node.metadata_props)
        nodes.append(n)
        return n.outputs[0]

    # (B, T, width) -> (B * heads, T, d)
    tokens = add("Shape", [query], start=1, end=2)
    per_head_shape = add("Concat", [c("minus1", [-1]), tokens, c("head_dim", [head_dim])], axis=0)

    def per_head(x):
        split = add("Reshape", [x, c("split_heads", [0, 0, heads, head_dim])])
        moved = add("Transpose", [split], perm=[0, 2, 1, 3])
        return add("Reshape", [moved, per_head_shape])

    def peak_scale(x, axes, keepdims, code_peak):  # max |x| over axes / code_peak, floored
        peak = add(
            "ReduceMax",
            [add("Abs", [x]), c(f"axes_{'_'.join(map(str, axes))}", axes)],
            keepdims=keepdims,
        )
        peak = add("Max", [peak, c("floor", SCALE_FLOOR, np.float32)])
        return add("Mul", [peak, c(f"inv_code_peak_{code_peak}", 1 / code_peak, np.float32)])

    q, k, v = per_head(query), per_head(key), per_head(value)
    q_scale = peak_scale(q, [1, 2], 0, CODE_PEAK)  # (B * heads,)
    k_scale = peak_scale(k, [1, 2], 0, SIGNED_CODE_PEAK)
    count = add("Shape", [q_scale])
    q_codes = add(
        "QuantizeLinear", [q, q_scale, add("Expand", [c("u8_128", 128, np.uint8), count])], axis=0
    )
    k_codes = add(
        "QuantizeLinear", [k, k_scale, add("Expand", [c("i8_0", 0, np.int8), count])], axis=0
    )
    k_t = add("Transpose", [k_codes], perm=[0, 2, 1])
    v_scale = peak_scale(v, [1], 1, SIGNED_CODE_PEAK)  # (B * heads, 1, d): per channel
    v_codes = add(
        "QuantizeLinear",
        [add("Div", [v, v_scale]), c("one", 1.0, np.float32), c("i8_0", 0, np.int8)],
    )
    qk_scale = add("Mul", [q_scale, c(f"softmax_scale_{head_dim}", softmax_scale, np.float32)])
    body = _head_body(c, None, head_dim, f"{prefix}_int8_body")
    scan = ir.node(
        "Scan",
        [q_codes, k_t, v_codes, qk_scale, k_scale],
        {"body": body, "num_scan_inputs": 5},
        name=f"{prefix}_int8_Scan",
    )
    scan.outputs[0].name = f"{prefix}_int8_Scan_out"
    scan.metadata_props.update(node.metadata_props)
    nodes.append(scan)
    out = add("Mul", [scan.outputs[0], v_scale])
    # (B * heads, T, d) -> (B, T, width)
    grouped_shape = add(
        "Concat", [c("minus1_heads", [-1, heads]), tokens, c("head_dim", [head_dim])], axis=0
    )
    out = add("Transpose", [add("Reshape", [out, grouped_shape])], perm=[0, 2, 1, 3])
    add("Reshape", [out, c("merge_heads", [0, 0, width])])
    return nodes


def int8_attentions(model: Any) -> int:
    """Rewrite every plain MultiHeadAttention of `model` (an onnx_ir Model) in place; returns how
    many. Any other attention node (mask, bias, past, unknown width) is left as it is."""
    graph = model.graph
    consts = _Consts(graph)
    count = 0
    for node in list(graph):
        shape = _eligible(node)
        if shape is None:
            continue
        heads, head_dim, width = shape
        scale = _attr(node, "scale", 0.0) or head_dim**-0.5
        _swap_in(graph, node, _rewrite(graph, node, consts, heads, head_dim, width, scale))
        count += 1
    if count:
        from onnx_ir.passes.common import RemoveUnusedNodesPass

        RemoveUnusedNodesPass()(model)
        if model.opset_imports.get(MS_DOMAIN) is None:
            model.opset_imports[MS_DOMAIN] = 1
    return count
