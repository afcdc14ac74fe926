"""Gemm -> MatMul (+ Add) before int8 (export/variants/gemm_as_matmul.py): the rewrite computes
the same function, leaves Gemms it cannot express alone, and the int8 vision graph has no fp32
weight-GEMM left (the patch merger's two Linears stayed fp32 before; 0.1.0 ran them in int8)."""

from __future__ import annotations

import numpy as np
import pytest

from colembed_export.variants.gemm_as_matmul import gemms_as_matmuls


def _gemm_model():
    """x (n, 6) -> Gemm(transB=1, bias) -> Gemm(transB=0, no bias) -> Gemm(alpha=0.5) -> y."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
        for name, shape in (("w1", (5, 6)), ("b1", (5,)), ("w2", (5, 4)), ("w3", (4, 3)))
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h1"], name="g1", transB=1),
        helper.make_node("Gemm", ["h1", "w2"], ["h2"], name="g2"),
        helper.make_node("Gemm", ["h2", "w3"], ["y"], name="g3", alpha=0.5),
    ]
    graph = helper.make_graph(
        nodes,
        "gemms",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(proto, x):
    from colembed.sessions import Session

    return Session(proto.SerializeToString(), threads=1).run({"x": x})[0]


def test_rewrite_is_the_same_function_and_skips_what_it_cannot_express():
    import onnx_ir as ir

    proto = _gemm_model()
    model = ir.from_proto(proto)
    assert gemms_as_matmuls(model) == 2
    ops = [n.op_type for n in model.graph]
    assert ops.count("MatMul") == 2 and ops.count("Add") == 1 and ops.count("Gemm") == 1
    assert "w1" not in model.graph.initializers  # the transposed copy replaced it
    x = np.random.default_rng(1).standard_normal((7, 6)).astype(np.float32)
    np.testing.assert_allclose(_run(ir.to_proto(model), x), _run(proto, x), rtol=1e-5, atol=1e-6)


def test_int8_vision_graph_has_no_fp32_weight_gemm(exported_variants):
    import onnx

    folder = exported_variants.folder

    def graph(file):
        model = onnx.load(str(folder / file), load_external_data=False)
        return model.graph, {i.name for i in model.graph.initializer}

    fp32, fp32_inits = graph("vision.onnx")
    weight_gemms = [
        n for n in fp32.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in fp32_inits
    ]
    assert any(n.op_type == "Gemm" for n in weight_gemms)  # the merger, as torch exports it
    int8, int8_inits = graph("vision.int8.onnx")
    assert not [n.name for n in int8.node if n.op_type == "Gemm" and n.input[1] in int8_inits]
    integer = [n for n in int8.node if n.op_type == "MatMulInteger"]
    assert len(integer) == len(weight_gemms)


def test_rewrite_releases_memory_mapped_weights(tmp_path):
    """As the exporter loads graphs: weights in external data, memory-mapped lazily; the
    transposed weight is a copy, so the mapping can be released (it raised BufferError while a
    view of it was alive)."""
    import onnx
    import onnx_ir as ir

    proto = _gemm_model()
    onnx.save(
        proto,
        str(tmp_path / "g.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="g.onnx_data",
        size_threshold=0,
    )
    model = ir.load(tmp_path / "g.onnx")
    assert gemms_as_matmuls(model) == 2
    ir.save(model, tmp_path / "rewritten.onnx", external_data="rewritten.onnx_data")
    from colembed.sessions import Session

    x = np.random.default_rng(3).standard_normal((4, 6)).astype(np.float32)
    got = Session(tmp_path / "rewritten.onnx", threads=1).run({"x": x})[0]
    np.testing.assert_allclose(got, _run(_gemm_model(), x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attrs", [{"transA": 1}, {"beta": 0.5}])
def test_gemms_with_other_attributes_stay(attrs):
    import onnx_ir as ir
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    c = numpy_helper.from_array(np.ones((4,), np.float32), "c")
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w", "c"], ["y"], **attrs)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])],
        [w, c],
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    assert gemms_as_matmuls(model) == 0


def test_int8_merger_bias_stays_outside_the_per_row_product():
    """The rewritten Gemm's bias Add must not be fused into a per-row-scaled
    MatMulIntegerToFloat: onnxruntime 1.32 then multiplies the bias by the row scale too
    (measured: off by the bias x (row scale - 1)). The row scheme's un-reshape sits between the
    product and the Add, so the optimised graph computes what the unoptimised one does."""
    import onnx_ir as ir

    from colembed.sessions import Session
    from colembed_export.variants.quantise import quantise_matmuls

    proto = _gemm_model()
    model = ir.from_proto(proto)
    gemms_as_matmuls(model)
    quantise_matmuls(model, {n.name: "row" for n in model.graph if n.op_type == "MatMul"})
    x = 3 * np.random.default_rng(2).standard_normal((9, 6)).astype(np.float32)
    quantised = ir.to_proto(model).SerializeToString()
    optimised = Session(quantised, threads=1).run({"x": x})[0]
    plain = Session(quantised, threads=1, graph_optimization="none").run({"x": x})[0]
    np.testing.assert_allclose(optimised, plain, rtol=1e-4, atol=1e-4)
