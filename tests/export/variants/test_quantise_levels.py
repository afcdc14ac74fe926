"""The int8 "row" scheme's code peaks: onnxruntime's integer kernels exact for the pairs allowed,
the graph equal to its numpy emulation, the overflowing pair refused.

onnxruntime's u8 x s8 kernels on AVX2 (no VNNI) add pairs of products in saturating int16
(quantise.py, WEIGHT_PEAK), so which code ranges are exact is a property of this machine's
kernels, not of ONNX: these tests run the real kernels on the stored codes' extremes.
"""

from __future__ import annotations

import numpy as np
import pytest

from colembed.errors import ExportError
from colembed_export.variants import quantise as Q


def _session(model_proto):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(
        model_proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _matmul_integer(a: np.ndarray, b: np.ndarray, a_zero_point: int) -> np.ndarray:
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "b", "azp", "bzp"], ["y"])],
        "g",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, ["T", a.shape[1]])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, ["T", b.shape[1]])],
        [
            numpy_helper.from_array(b, "b"),
            numpy_helper.from_array(np.array(a_zero_point, np.uint8), "azp"),
            numpy_helper.from_array(np.zeros(b.shape[1], np.int8), "bzp"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    return _session(model).run(None, {"a": a})[0]


@pytest.mark.parametrize("weights, activations", [(Q.WEIGHT_PEAK, Q.ACTIVATION_PEAK), (127, 63)])
def test_integer_kernel_exact_at_the_allowed_code_extremes(weights, activations):
    """Every stored code at its extreme in one row and one column (the worst pair sums), at a
    Qwen2-VL-2B depth: onnxruntime's MatMulInteger equals the int64 product."""
    rng = np.random.default_rng(0)
    depth, width, rows = 1536, 64, 5
    zero_point = activations + 1
    a = rng.integers(1, 2 * activations + 2, (rows, depth)).astype(np.uint8)
    a[0] = 2 * activations + 1  # the largest code everywhere
    a[1] = 1  # the smallest
    b = rng.integers(-weights, weights + 1, (depth, width)).astype(np.int8)
    b[:, 0] = weights
    b[:, 1] = -weights
    want = (a.astype(np.int64) - zero_point) @ b.astype(np.int64)
    np.testing.assert_array_equal(_matmul_integer(a, b, zero_point), want)


def _single_matmul(weight: np.ndarray, lead: tuple = ("T",)):
    import onnx_ir as ir
    from onnx import TensorProto, helper, numpy_helper

    depth, width = weight.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*lead, depth])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*lead, width])],
        [numpy_helper.from_array(weight, "w")],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    return ir.from_proto(proto)


def _emulated_row_product(x, weight, weights, activations):
    """quantise.py's row scheme in float64/int64: per-token activation codes, per-column weights."""
    wq, ws = Q.quantised_weight(weight, weights)
    scale = np.maximum(np.abs(x).max(axis=1), Q.ROW_SCALE_FLOOR * activations) / activations
    scale = scale.astype(np.float32)
    codes = np.clip(np.rint(x / scale[:, None]), -activations, activations).astype(np.int64)
    return (codes @ wq.astype(np.int64)) * (scale[:, None].astype(np.float64) * ws[None, :])


@pytest.mark.parametrize("weights, activations", [(Q.WEIGHT_PEAK, Q.ACTIVATION_PEAK), (127, 63)])
def test_row_scheme_graph_equals_its_emulation(weights, activations):
    """The row scheme on a (batch 2, tokens, depth) activation, as the text graph feeds it, gives
    the emulated product (per-token codes: the two items do not share a scale)."""
    import onnx_ir as ir

    rng = np.random.default_rng(1)
    weight = (rng.standard_normal((256, 48)) * 0.05).astype(np.float32)
    x = rng.standard_normal((7, 256)).astype(np.float32)
    x[2, 5] = 40.0  # a massive channel in one token only: the other tokens keep their scale
    x[4, 9] = -55.0  # and a negative one: a row's peak is its largest |x|, of either sign
    model = _single_matmul(weight, lead=("B", "T"))
    assert (
        Q.quantise_matmuls(
            model, {"mm": "row"}, weight_levels=weights, activation_levels=activations
        )["row"]
        == 1
    )
    batched = np.stack([x, x[::-1]])[:, :7]
    got_batched = _session(ir.to_proto(model)).run(None, {"x": batched})[0]
    np.testing.assert_array_equal(got_batched[1], got_batched[0][::-1])
    got = got_batched[0]
    want = _emulated_row_product(x, weight, weights, activations)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5 * np.abs(want).max())
    exact = x.astype(np.float64) @ weight.astype(np.float64)
    others = [i for i in range(len(x)) if i not in (2, 4)]  # 2 and 4: their scale follows it
    cos = np.sum(got[others] * exact[others], axis=1) / (
        np.linalg.norm(got[others], axis=1) * np.linalg.norm(exact[others], axis=1)
    )
    assert cos.min() > 0.999, cos  # and it is the product at all


def test_code_peaks_that_overflow_the_pair_sums_are_refused():
    model = _single_matmul(np.ones((8, 4), np.float32))
    with pytest.raises(ExportError, match="16-bit pair sums"):
        Q.quantise_matmuls(model, {"mm": "row"}, weight_levels=127, activation_levels=127)


def test_8bit_block_writer_runs_in_matmulnbits():
    """quantise_int4_matmuls(bits=8) (benchmarks only): onnxruntime runs the blocks it writes and
    the product is the fp32 one to 8-bit precision (a wrong packing or layout would not be)."""
    import onnx_ir as ir

    rng = np.random.default_rng(2)
    weight = (rng.standard_normal((256, 48)) * 0.05).astype(np.float32)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    model = _single_matmul(weight)
    assert (
        Q.quantise_int4_matmuls(
            model,
            [n for n in model.graph if n.op_type == "MatMul"],
            block_size=16,
            accuracy_level=4,
            bits=8,
        )
        == 1
    )
    assert [n.op_type for n in model.graph] == ["MatMulNBits"]
    got = _session(ir.to_proto(model)).run(None, {"x": x})[0].astype(np.float64)
    want = x.astype(np.float64) @ weight.astype(np.float64)
    cos = np.sum(got * want, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() > 0.9999, cos


@pytest.mark.parametrize("bits,block", [(4, 16), (8, 128)])
def test_symmetric_blocks_run_without_zero_points(bits, block):
    """quantise_int4_matmuls(symmetric=True) writes MatMulNBits with 3 inputs (the kernel's default
    zero point): onnxruntime runs it, the product is the fp32 one to the format's precision, and
    the asymmetric blocks of the same weight are the closer (recipes.INT4_SYMMETRIC is False)."""
    import onnx_ir as ir

    rng = np.random.default_rng(4)
    weight = (rng.standard_normal((256, 48)) * 0.05).astype(np.float32)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    want = x.astype(np.float64) @ weight.astype(np.float64)
    errors = {}
    for symmetric in (True, False):
        model = _single_matmul(weight)
        Q.quantise_int4_matmuls(
            model,
            [n for n in model.graph if n.op_type == "MatMul"],
            block_size=block,
            accuracy_level=4,
            bits=bits,
            symmetric=symmetric,
        )
        (node,) = list(model.graph)
        assert node.op_type == "MatMulNBits" and len(node.inputs) == (3 if symmetric else 4)
        got = _session(ir.to_proto(model)).run(None, {"x": x})[0].astype(np.float64)
        errors[symmetric] = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert errors[True] < (0.12 if bits == 4 else 0.02), errors
    assert errors[False] < errors[True], errors


def test_two_weight_codes_stay_in_the_exact_range_and_refine_the_weight():
    """Each pass's codes stay within the peak the AVX2 pair sums allow (the integer kernels see
    only such codes, test above), and the second pass cuts the weight's rounding error by about
    the code range (~2 x WEIGHT_PEAK), which one pass at any exact peak cannot."""
    rng = np.random.default_rng(3)
    weight = (rng.standard_normal((512, 96)) * 0.02).astype(np.float32)
    weight[7, 3] = 0.5  # one large weight sets its column's scale
    passes = Q.quantised_weight_passes(weight, Q.WEIGHT_PEAK, 2)
    assert len(passes) == 2
    for codes, _ in passes:
        assert codes.dtype == np.int8 and np.abs(codes).max() <= Q.WEIGHT_PEAK
    (first, s1), (second, s2) = passes
    assert np.all(s2 <= s1 / (2 * Q.WEIGHT_PEAK) * 1.0001)  # the residual is within half a step
    one = first * s1.astype(np.float64)
    two = one + second * s2.astype(np.float64)
    err1, err2 = np.abs(one - weight).max(), np.abs(two - weight).max()
    assert err2 < err1 / (Q.WEIGHT_PEAK)  # ~1/(2 peak) in theory; margin for rounding ties
    assert Q.quantised_weight_passes(weight, Q.WEIGHT_PEAK, 1)[0][0].tobytes() == first.tobytes()


def test_row_scheme_with_two_weight_codes_equals_its_emulation():
    """The graph with two codes per weight (two MatMulIntegers on one activation quantisation)
    gives the emulated sum of both passes, and is nearer the fp32 product than one pass."""
    import onnx_ir as ir

    rng = np.random.default_rng(4)
    weight = (rng.standard_normal((256, 48)) * 0.05).astype(np.float32)
    x = rng.standard_normal((2, 9, 256)).astype(np.float32)
    rows = x.reshape(-1, 256)
    scale = (
        np.maximum(np.abs(rows).max(axis=1), Q.ROW_SCALE_FLOOR * Q.ACTIVATION_PEAK)
        / Q.ACTIVATION_PEAK
    ).astype(np.float32)
    codes = np.clip(np.rint(rows / scale[:, None]), -Q.ACTIVATION_PEAK, Q.ACTIVATION_PEAK)
    want = sum(
        (codes.astype(np.int64) @ c.astype(np.int64))
        * (scale[:, None].astype(np.float64) * s[None, :])
        for c, s in Q.quantised_weight_passes(weight, Q.WEIGHT_PEAK, 2)
    )
    got = {}
    for passes in (1, 2):
        model = _single_matmul(weight, lead=("B", "T"))
        Q.quantise_matmuls(model, {"mm": "row"}, weight_passes=passes)
        assert sum(n.op_type == "MatMulInteger" for n in model.graph) == passes
        got[passes] = _session(ir.to_proto(model)).run(None, {"x": x})[0].reshape(-1, 48)
    np.testing.assert_allclose(got[2], want, rtol=2e-5, atol=1e-5 * np.abs(want).max())
    exact = rows.astype(np.float64) @ weight.astype(np.float64)
    assert np.abs(got[2] - exact).max() < np.abs(got[1] - exact).max() / 1.5


def test_weight_passes_other_than_one_or_two_are_refused():
    model = _single_matmul(np.ones((8, 4), np.float32))
    with pytest.raises(ExportError, match="weight_passes"):
        Q.quantise_matmuls(model, {"mm": "row"}, weight_passes=3)
