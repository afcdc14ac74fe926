"""int8 graphs written weight by weight, each MatMul with the activation scale it needs.

Every MatMul with a constant fp32 weight gets int8 weights (symmetric, one scale per output
column) and one of three activation schemes, chosen per MatMul by the int8 recipe (recipes.py):

- "tensor": DynamicQuantizeLinear (one uint8 scale and zero point for the whole activation
  tensor) + MatMulInteger + Cast + Mul, exactly the nodes onnxruntime's `quantize_dynamic` writes;
  its CPU optimiser fuses them into one DynamicQuantizeMatMul kernel. The scale follows the
  largest value anywhere in the tensor: every token of every item of the batch, padding included.
- "row": one symmetric scale per row (token), from plain ONNX ops: max(ReduceMax, -ReduceMin)
  per row, QuantizeLinear per axis (uint8, zero point 128), MatMulInteger, then the product scaled by
  row scale x column scale. A token's precision no longer depends on the other tokens, the
  sequence length or what it is batched with. onnxruntime fuses the product and its scaling
  into MatMulIntegerToFloat (measured exact against the unfused nodes); the per-row range and
  QuantizeLinear stay separate element-wise passes over the activation.
- "fp32": the MatMul is left as it is.

Streaming: the source graph is loaded lazily (onnx_ir memory-maps external data per tensor);
each weight is read, optionally multiplied by its SmoothQuant row factors (graph_edits.
smoothing_factors), quantised and its mapping released before the next, so the process holds the
int8 weights (a quarter of the fp32 bytes) plus one fp32 weight at a time, never a second full
fp32 copy (onnxruntime's `quantize_dynamic` loads the whole model proto and copies it).
`quantise_int4_matmuls` streams the int4 recipe the same way: each weight goes through
onnxruntime's own 4-bit block quantiser (`quantize_matmul_4bits`, the C++ kernel its
MatMulNBitsQuantizer calls) one at a time, instead of that quantizer's whole-model proto (it loads
every fp32 weight into memory, then copies the model).
This module imports onnx_ir and numpy; onnxruntime for int4 only, when called.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from colembed.errors import ExportError
from colembed.layout import BASE_VARIANT

from ..graphs.edits import add_initializer, release

SCHEMES = ("tensor", "row", BASE_VARIANT)  # BASE_VARIANT: the MatMul stays in fp32
INT8_PEAK = 127  # symmetric: -127..127 (the -128 code unused, as onnxruntime's QInt8 weights)
# Weights use 7 bits (-63..63): onnxruntime's u8 x s8 kernels on x86 without VNNI (AVX2, AVX-512
# before VNNI) add pairs of u8*s8 products in saturating 16-bit lanes (vpmaddubsw), so
# 255*127*2 overflows and a product comes out wrong by up to tens of thousands of units (measured,
# onnxruntime 1.32, AVX2: MatMulInteger with 8-bit weights off by 45877 of 146355; with 7-bit
# weights exact). 255*63*2 fits. onnxruntime's quantize_dynamic calls this `reduce_range`.
WEIGHT_PEAK = 63
# The "row" scheme's activations: symmetric in -ACTIVATION_PEAK..ACTIVATION_PEAK around the zero
# point ACTIVATION_PEAK + 1 (uint8; MatMulInteger takes one a_zero_point). The pair-sum bound
# above is on the stored codes: 8-bit activations (codes 1..255) need 7-bit weights; 7-bit
# activations (peak 63, codes 1..127) leave 8-bit weights exact (127*127*2 = 32258 fits int16),
# the trade measured in benchmarks/results/experiments/variants-int8-bits.md.
ACTIVATION_PEAK = 127
ROW_ZERO_POINT = ACTIVATION_PEAK + 1  # (today's default: codes 1..255 around 128)
ROW_SCALE_FLOOR = 1e-30  # an all-zero row quantises to zeros instead of dividing by zero
# How many int8 codes hold each weight of a "row" MatMul (`quantise_matmuls(weight_passes=)`): 1,
# or 2 (the second quantises what the first left, W ~ s1 Q1 + s2 Q2 with s2 ~ s1 / (2 WEIGHT_PEAK):
# ~13-bit weights from two 7-bit codes, each exact on AVX2, one activation quantisation shared,
# twice the integer products). Which one a variant gets is the recipe's (recipes.INT8_RECIPES,
# recipes.recipe_attempts), not this module's.
WEIGHT_PASS_COUNTS = (1, 2)


def quantised_weight(
    weight: np.ndarray, levels: int = WEIGHT_PEAK
) -> tuple[np.ndarray, np.ndarray]:
    """(int8 (K, M), fp32 scale (M,)): symmetric per output column in -levels..levels, zero
    point 0."""
    peak = np.abs(weight).max(axis=0)
    scale = np.where(peak > 0, peak / levels, 1.0).astype(np.float32)
    quantised = np.clip(np.rint(weight / scale), -levels, levels).astype(np.int8)
    return quantised, scale


def quantised_weight_passes(
    weight: np.ndarray, levels: int = WEIGHT_PEAK, passes: int = 1
) -> list[tuple[np.ndarray, np.ndarray]]:
    """`passes` (int8 codes, column scales) pairs whose scaled sum approximates `weight`: each
    pass quantises (per column, `quantised_weight`) what the passes before it left. Every pass's
    codes stay in -levels..levels, so each product is as exact on AVX2 as one pass's."""
    out = []
    rest = np.asarray(weight, np.float32)
    for i in range(passes):
        codes, scale = quantised_weight(rest, levels)
        out.append((codes, scale))
        if i + 1 < passes:
            rest = rest - codes.astype(np.float32) * scale[None, :]
    return out


class _Builder:
    """Appends nodes with unique names after `anchor` nodes of one graph."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph

    def init(self, name: str, array: np.ndarray) -> Any:
        return add_initializer(self.graph, name, array)

    @staticmethod
    def node(
        op: str, inputs: list[Any], name: str, outputs: int = 1, domain: str = "", **attributes: Any
    ) -> Any:
        import onnx_ir as ir

        node = ir.node(
            op, inputs, attributes=attributes, name=name, num_outputs=outputs, domain=domain
        )
        for i, out in enumerate(node.outputs):
            out.name = f"{name}_out{i}" if outputs > 1 else f"{name}_out"
        return node


def _tensor_activation(b: _Builder, x: Any, base: str) -> tuple[list[Any], dict[str, Any]]:
    quant = b.node("DynamicQuantizeLinear", [x], f"{base}_dql", outputs=3)
    xq, xs, xzp = quant.outputs
    return [quant], {"q": xq, "scale": xs, "zero_point": xzp}


def _row_activation(
    b: _Builder,
    x: Any,
    depth: int,
    base: str,
    outliers: np.ndarray | None,
    peak: int = ACTIVATION_PEAK,
) -> tuple[list[Any], dict[str, Any]]:
    nodes = [
        b.node(
            "Reshape",
            [x, b.init(f"{base}_rows_shape", np.array([-1, depth], np.int64))],
            f"{base}_rows",
        ),
    ]
    rows = nodes[-1].outputs[0]
    found: dict[str, Any] = {}
    if outliers is not None and outliers.size:
        mask = np.ones(depth, np.float32)
        mask[outliers] = 0.0
        nodes.append(
            b.node(
                "Gather",
                [rows, b.init(f"{base}_outlier_idx", outliers.astype(np.int64))],
                f"{base}_outlier_cols",
                axis=1,
            )
        )
        found["outlier_cols"] = nodes[-1].outputs[0]
        nodes.append(b.node("Mul", [rows, b.init(f"{base}_inlier_mask", mask)], f"{base}_inliers"))
        rows = nodes[-1].outputs[0]
    # A row's peak |x| as max(max x, -min x): the same value as ReduceMax(Abs(x)) for every finite
    # row, from two reading passes instead of an Abs pass that writes a copy of the activation
    # (a page's vision MLP input is 2976 x 5120 floats) and a third pass that reads it back.
    axis1 = b.init(f"{base}_axis1", np.array([1], np.int64))
    nodes.append(b.node("ReduceMax", [rows, axis1], f"{base}_high", keepdims=0))
    high = nodes[-1].outputs[0]
    nodes.append(b.node("ReduceMin", [rows, axis1], f"{base}_low", keepdims=0))
    nodes.append(b.node("Neg", [nodes[-1].outputs[0]], f"{base}_low_neg"))
    nodes.append(
        b.node(
            "Max",
            [
                high,
                nodes[-1].outputs[0],
                b.init(f"{base}_floor", np.array(ROW_SCALE_FLOOR * peak, np.float32)),
            ],
            f"{base}_floored",
        )
    )
    nodes.append(
        b.node(
            "Mul",
            [nodes[-1].outputs[0], b.init(f"{base}_inv_peak", np.array(1.0 / peak, np.float32))],
            f"{base}_scale",
        )
    )
    scale = nodes[-1].outputs[0]
    nodes.append(b.node("Shape", [scale], f"{base}_count"))
    nodes.append(
        b.node(
            "Expand",
            [b.init(f"{base}_zp_scalar", np.array(peak + 1, np.uint8)), nodes[-1].outputs[0]],
            f"{base}_zps",
        )
    )
    nodes.append(
        b.node("QuantizeLinear", [rows, scale, nodes[-1].outputs[0]], f"{base}_quant", axis=0)
    )
    xq = nodes[-1].outputs[0]
    nodes.append(
        b.node(
            "Unsqueeze",
            [scale, b.init(f"{base}_axis1u", np.array([1], np.int64))],
            f"{base}_scale_col",
        )
    )
    scale_col = nodes[-1].outputs[0]
    nodes.append(b.node("Shape", [x], f"{base}_shape", end=-1))
    return nodes, {
        "q": xq,
        "scale": scale_col,
        "lead_shape": nodes[-1].outputs[0],
        "zero_point": b.init(f"{base}_zp", np.array(peak + 1, np.uint8)),
        **found,
    }


def quantise_matmuls(
    model: Any,
    schemes: Mapping[str, str],
    smoothing: Mapping[str, np.ndarray] | None = None,
    *,
    outliers: Mapping[str, np.ndarray] | None = None,
    weight_levels: int = WEIGHT_PEAK,
    activation_levels: int = ACTIVATION_PEAK,
    weight_passes: int = 1,
) -> dict[str, int]:
    """Rewrite every MatMul named in `schemes` ({node name: scheme}) in place; returns how many
    MatMuls got each scheme. `smoothing` maps a MatMul's name to the factors its weight's rows
    are multiplied by before quantising (the norm before it was divided by them already).
    `outliers` maps a "row" MatMul's name to the input channels computed in fp32 beside the int8
    product (LLM.int8()'s decomposition: Y = X[:, rest] W[rest] in int8 + X[:, out] W[out] in
    fp32); every MatMul reading the same activation must name the same channels.
    `weight_levels` / `activation_levels`: the codes' peaks (see WEIGHT_PEAK: their stored
    codes' pair sums must fit int16 on AVX2, so 8-bit weights need activations of 7 bits).
    `weight_passes` (one of WEIGHT_PASS_COUNTS): int8 codes per "row" weight."""
    if weight_levels * 2 * (2 * activation_levels + 1) > 32767:
        raise ExportError(
            f"int8 weights of peak {weight_levels} with activations of peak "
            f"{activation_levels} overflow the AVX2 kernels' 16-bit pair sums"
        )
    import onnx_ir as ir
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    from ..graphs.edits import _const_float, _swap_in

    passes = weight_passes
    if passes not in WEIGHT_PASS_COUNTS:
        raise ExportError(f"weight_passes must be 1 or 2, not {passes}")
    graph = model.graph
    b = _Builder(graph)
    counts = dict.fromkeys(SCHEMES, 0)
    activations: dict[tuple[int, str], tuple[list[Any], dict[str, Any]]] = {}
    for node in list(graph):
        scheme = schemes.get(node.name)
        if scheme is None or node.op_type != "MatMul":
            continue
        if scheme not in SCHEMES:
            raise ExportError(f"{node.name}: unknown int8 activation scheme {scheme!r}")
        counts[scheme] += 1
        x, w = node.inputs
        factors = (smoothing or {}).get(node.name)
        if scheme == BASE_VARIANT:  # an fp32 MatMul behind a smoothed norm takes its factors too
            if factors is not None:
                w.const_value = ir.tensor(
                    _const_float(w) * factors[:, None].astype(np.float32), name=w.name
                )
            continue
        array = _const_float(w)
        if array is None or array.ndim != 2:
            raise ExportError(f"{node.name}: int8 needs a constant 2-D fp32 weight")
        source = array if factors is None else array * factors[:, None].astype(np.float32)
        split = (outliers or {}).get(node.name) if scheme == "row" else None
        split = None if split is None or not len(split) else np.asarray(split, np.int64)
        outlier_rows = None
        if split is not None:
            outlier_rows = np.ascontiguousarray(source[split])
            source = source.copy() if source is array else source
            source[split] = 0.0
        layers = quantised_weight_passes(source, weight_levels, passes if scheme == "row" else 1)
        quantised, scale = layers[0]
        del source, array
        if len(w.uses()) == 1:
            release(w)
        depth, width = quantised.shape
        base = node.name
        wq = b.init(f"{base}_w_int8", quantised)
        ws = b.init(f"{base}_w_scale", scale)
        wzp = b.init(f"{base}_w_zp", np.zeros(width, np.int8))
        key = (id(x), scheme)
        new: list[Any] = []
        if key not in activations:  # one activation quantisation per tensor, shared by its MatMuls
            built = (
                _tensor_activation(b, x, base)
                if scheme == "tensor"
                else _row_activation(b, x, depth, base, split, activation_levels)
            )
            activations[key] = built
            new += built[0]
        act = activations[key][1]
        product = b.node("MatMulInteger", [act["q"], wq, act["zero_point"], wzp], f"{base}_int")
        as_float = b.node("Cast", [product.outputs[0]], f"{base}_float", to=ir.DataType.FLOAT)
        if scheme == "tensor":  # the pattern onnxruntime fuses (into DynamicQuantizeMatMul)
            scales = b.node("Mul", [act["scale"], ws], f"{base}_scales")
            scaled = b.node("Mul", [as_float.outputs[0], scales.outputs[0]], f"{base}_scaled")
            new += [product, as_float, scales, scaled]
        else:  # row x column scales in one Mul: onnxruntime fuses it into MatMulIntegerToFloat
            columns = b.node("Mul", [act["scale"], ws], f"{base}_columns")
            scaled = b.node("Mul", [as_float.outputs[0], columns.outputs[0]], f"{base}_scaled")
            new += [product, as_float, columns, scaled]
            for i, (codes, fine) in enumerate(layers[1:], start=2):  # the residual passes
                extra = b.node(
                    "MatMulInteger",
                    [act["q"], b.init(f"{base}_w{i}_int8", codes), act["zero_point"], wzp],
                    f"{base}_int{i}",
                )
                cast = b.node("Cast", [extra.outputs[0]], f"{base}_float{i}", to=ir.DataType.FLOAT)
                cols = b.node(
                    "Mul", [act["scale"], b.init(f"{base}_w{i}_scale", fine)], f"{base}_columns{i}"
                )
                part = b.node("Mul", [cast.outputs[0], cols.outputs[0]], f"{base}_scaled{i}")
                scaled = b.node("Add", [scaled.outputs[0], part.outputs[0]], f"{base}_sum{i}")
                new += [extra, cast, cols, part, scaled]
            if outlier_rows is not None:
                if "outlier_cols" not in act:
                    raise ExportError(
                        f"{node.name}: MatMuls reading one activation name other outlier channels"
                    )
                exact = b.node(
                    "MatMul",
                    [act["outlier_cols"], b.init(f"{base}_w_outliers", outlier_rows)],
                    f"{base}_outlier_product",
                )
                scaled = b.node("Add", [scaled.outputs[0], exact.outputs[0]], f"{base}_joined")
                new += [exact, scaled]
        if scheme == "row":
            shape = b.node(
                "Concat",
                [act["lead_shape"], b.init(f"{base}_width", np.array([width], np.int64))],
                f"{base}_out_shape",
                axis=0,
            )
            new += [
                shape,
                b.node("Reshape", [scaled.outputs[0], shape.outputs[0]], f"{base}_unrows"),
            ]
        _swap_in(graph, node, new)
    RemoveUnusedNodesPass()(model)
    return counts


def quantised_weight_4bit(
    weight: np.ndarray, block_size: int, symmetric: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packed (N, blocks, block/2) uint8, scales (N, blocks) fp32, zero points (N, ceil(blocks/2))
    uint8) of a (K, N) fp32 weight: 4-bit blocks of `block_size` along K, asymmetric (or
    `symmetric`: codes around 8, the zero points unused), by onnxruntime's own kernel
    (bit-identical to its MatMulNBitsQuantizer)."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits

    rows, cols = weight.shape
    blocks = (rows + block_size - 1) // block_size
    if rows == blocks * block_size:  # no copy: the kernel reads the mapped weight
        padded = np.ascontiguousarray(weight, np.float32)
    else:
        padded = np.zeros((blocks * block_size, cols), np.float32)
        padded[:rows] = weight
    packed = np.zeros((cols, blocks, block_size // 2), np.uint8)
    zero_points = np.zeros((cols, (blocks + 1) // 2), np.uint8)
    scales = np.zeros((cols, blocks), np.float32)
    quantize_matmul_4bits(packed, padded, scales, zero_points, block_size, cols, rows, symmetric)
    return packed, scales, zero_points


def quantised_weight_8bit(
    weight: np.ndarray, block_size: int, symmetric: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packed (N, blocks, block) uint8, scales (N, blocks) fp32, zero points (N, blocks) uint8)
    of a (K, N) fp32 weight: 8-bit blocks along K (asymmetric, or `symmetric` around 128), by
    onnxruntime's own kernel."""
    from onnxruntime.capi._pybind_state import quantize_matmul_8bits

    rows, cols = weight.shape
    blocks = (rows + block_size - 1) // block_size
    padded = np.zeros((blocks * block_size, cols), np.float32)
    padded[:rows] = weight
    packed = np.zeros((cols, blocks, block_size), np.uint8)
    zero_points = np.zeros((cols, blocks), np.uint8)
    scales = np.zeros((cols, blocks), np.float32)
    quantize_matmul_8bits(packed, padded, scales, zero_points, block_size, cols, rows, symmetric)
    return packed, scales, zero_points


def quantise_int4_matmuls(
    model: Any,
    nodes: list[Any],
    *,
    block_size: int,
    accuracy_level: int,
    bits: int = 4,
    symmetric: bool = False,
) -> int:
    """Replace each MatMul in `nodes` (constant 2-D fp32 weight) by com.microsoft MatMulNBits
    (4 inputs: A, packed weight, scales, zero points, asymmetric; or, `symmetric`, 3 inputs: the
    kernel's default zero point 2^(bits-1)), weight by weight, releasing each fp32 mapping after
    use. Returns how many were replaced. `bits=8` writes 8-bit blocks (with
    accuracy level 4 the kernel quantises the activation per token and block of K: what
    benchmarks/results/experiments/variants-int8-bits.md measures against the "row" scheme; no recipe uses it)."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    from ..graphs.edits import _const_float, _swap_in

    b = _Builder(model.graph)
    for node in nodes:
        x, w = node.inputs
        array = _const_float(w)
        if array is None or array.ndim != 2:
            raise ExportError(f"{node.name}: int4 needs a constant 2-D fp32 weight")
        depth, width = array.shape
        packed, scales, zero_points = (
            quantised_weight_8bit if bits == 8 else quantised_weight_4bit
        )(array, block_size, symmetric)
        del array
        if len(w.uses()) == 1:
            release(w)
        base = node.name
        inputs = [x, b.init(f"{base}_w_q4", packed), b.init(f"{base}_w_scales", scales)]
        if not symmetric:
            inputs.append(b.init(f"{base}_w_zero_points", zero_points))
        nbits = b.node(
            "MatMulNBits",
            inputs,
            f"{base}_q{bits}",
            domain="com.microsoft",
            K=depth,
            N=width,
            bits=bits,
            block_size=block_size,
            accuracy_level=accuracy_level,
        )
        _swap_in(model.graph, node, [nbits])
    if nodes:
        model.opset_imports.setdefault("com.microsoft", 1)
    RemoveUnusedNodesPass()(model)
    return len(nodes)
