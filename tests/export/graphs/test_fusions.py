"""Exported graphs in the forms onnxruntime's CPU optimiser fuses: RMSNorm as one kernel.

torch writes RMSNorm's rsqrt at opset 18 as Sqrt + Reciprocal + Mul, which onnxruntime leaves as
seven kernels; `graph_edits.fusable_rms_norms` rewrites it as a Div, which it fuses into
SimplifiedLayerNormalization (benchmarks/README.md). The exporter applies it to every graph, so
every variant inherits it; the export check (1e-4 per token) already ran on the edited graphs.
"""

from __future__ import annotations

import json

import numpy as np
import pytest


def _rms_norm_model(x_name: str = "x"):
    """x * Reciprocal(Sqrt(mean(x^2) + eps)) * w, as torch exports it (ONNX proto)."""
    from onnx import TensorProto, helper, numpy_helper

    inits = [
        numpy_helper.from_array(np.array(2.0, np.float32), "two"),
        numpy_helper.from_array(np.array([-1], np.int64), "axes"),
        numpy_helper.from_array(np.array(1e-6, np.float32), "eps"),
        numpy_helper.from_array(np.linspace(0.5, 2, 16, dtype=np.float32), "w"),
    ]
    nodes = [
        helper.make_node("Pow", ["x", "two"], ["p"]),
        helper.make_node("ReduceMean", ["p", "axes"], ["m"], keepdims=1),
        helper.make_node("Add", ["m", "eps"], ["a"]),
        helper.make_node("Sqrt", ["a"], ["s"]),
        helper.make_node("Reciprocal", ["s"], ["r"]),
        helper.make_node("Mul", [x_name, "r"], ["n"]),
        helper.make_node("Mul", ["w", "n"], ["y"]),
    ]
    inputs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, "t", 16]) for n in {"x", x_name}
    ]
    graph = helper.make_graph(
        nodes,
        "rms",
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, "t", 16])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _optimised_ops(source, tmp_path) -> list[str]:
    """The op types of a graph (file path or bytes) as onnxruntime's CPU session optimises it."""
    import onnx

    from colembed.sessions import Session

    out = tmp_path / "optimised.onnx"
    Session(source, threads=1, save_optimized=out)
    return [n.op_type for n in onnx.load(str(out), load_external_data=False).graph.node]


def test_rms_norm_is_rewritten_fused_and_unchanged(tmp_path):
    import onnx_ir as ir

    from colembed.sessions import Session
    from colembed_export.graphs.edits import fusable_rms_norms

    proto = _rms_norm_model()
    model = ir.from_proto(proto)
    assert fusable_rms_norms(model) == 1
    edited = ir.to_proto(model).SerializeToString()
    assert _optimised_ops(proto.SerializeToString(), tmp_path) != ["SimplifiedLayerNormalization"]
    assert _optimised_ops(edited, tmp_path) == ["SimplifiedLayerNormalization"]
    x = np.random.default_rng(0).standard_normal((2, 5, 16), dtype=np.float32) * 30
    (want,) = Session(proto.SerializeToString(), threads=1).run({"x": x})
    (got,) = Session(edited, threads=1).run({"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_reciprocal_that_is_not_a_norm_is_left_alone():
    import onnx_ir as ir

    from colembed_export.graphs.edits import fusable_rms_norms

    model = ir.from_proto(_rms_norm_model(x_name="other"))  # scales another tensor than it measured
    assert fusable_rms_norms(model) == 0
    assert [n.op_type for n in model.graph].count("Reciprocal") == 1


@pytest.mark.parametrize(
    "fixture, roles", [("exported_tiny", ["text"]), ("exported_tiny_2_5", ["vision", "text"])]
)
def test_exported_rms_norms_fuse_in_the_session(fixture, roles, request, tmp_path):
    """Every RMSNorm of both families' fp32 graphs runs as one kernel (ColQwen2's image graph
    uses LayerNorm, already one op)."""
    import onnx

    folder = request.getfixturevalue(fixture).folder
    manifest = json.loads((folder / "colembed_manifest.json").read_text())
    for role in roles:
        path = folder / manifest["variants"]["fp32"][role]["file"]
        assert not [
            n
            for n in onnx.load(str(path), load_external_data=False).graph.node
            if n.op_type == "Reciprocal"
        ]
        ops = _optimised_ops(path, tmp_path)
        assert "SimplifiedLayerNormalization" in ops and "Pow" not in ops, (role, sorted(set(ops)))
