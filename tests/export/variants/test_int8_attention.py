"""The int8 vision attention (export/variants/int8_attention.py; off by default,
recipes.INT8_VISION_ATTENTION): the rewrite keeps each image's attention within 0.999 per token
of onnxruntime's fp32 MultiHeadAttention (images at unlike scales: one scale per image and
head), leaves the attentions it cannot express alone, and the int8 recipe writes it into the
exported vision graph only when asked (the default int8 graph keeps the fused attention)."""

from __future__ import annotations

import numpy as np
import pytest

from colembed_export.variants.int8_attention import int8_attentions

HEADS, HEAD_DIM = 4, 16


def _attention_model(*, mask: bool = False, scale: float | None = 0.3):
    from onnx import TensorProto, helper

    width = HEADS * HEAD_DIM
    inputs = [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["b", "t", width]) for x in "qkv"]
    names = ["q", "k", "v"]
    if mask:
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.INT32, ["b", "t"]))
        names.append("mask")
    attrs = {"num_heads": HEADS} | ({"scale": scale} if scale else {})
    graph = helper.make_graph(
        [
            helper.make_node(
                "MultiHeadAttention", names, ["y"], domain="com.microsoft", name="mha", **attrs
            ),
            helper.make_node("Identity", ["y"], ["out"]),
        ],
        "attention",
        inputs,
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b", "t", width])],
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]  # as exported
    return helper.make_model(graph, opset_imports=opsets)


def _run(proto, feeds):
    from colembed.sessions import Session

    return Session(proto.SerializeToString(), threads=1).run(feeds)[0]


@pytest.mark.parametrize("scale", [0.3, None])
def test_rewrite_tracks_fp32_attention_per_image(scale):
    import onnx_ir as ir

    proto = _attention_model(scale=scale)
    model = ir.from_proto(proto)
    assert int8_attentions(model) == 1
    ops = [n.op_type for n in model.graph]
    assert "MultiHeadAttention" not in ops and "Scan" in ops
    rng = np.random.default_rng(0)
    feeds = {x: rng.standard_normal((3, 97, HEADS * HEAD_DIM)).astype(np.float32) for x in "qkv"}
    feeds["q"][1] *= 30.0  # images at unlike scales, the same logits: each (image, head) has its
    feeds["k"][1] /= 30.0  # own scales (one scale for all would flatten image 0's and 2's codes)
    feeds["v"][2] *= 1e-3
    want, got = _run(proto, feeds), _run(ir.to_proto(model), feeds)
    cosine = (want * got).sum(-1) / np.linalg.norm(want, axis=-1) / np.linalg.norm(got, axis=-1)
    assert cosine.min() >= 0.999, cosine.min()
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


def test_attention_with_a_mask_is_left_alone():
    import onnx_ir as ir

    model = ir.from_proto(_attention_model(mask=True))
    assert int8_attentions(model) == 0
    assert [n.op_type for n in model.graph].count("MultiHeadAttention") == 1


def _feeds(model, rng):
    """Random feeds for a graph's float inputs: symbolic dims 1 for images, 16 otherwise."""
    from onnx import TensorProto

    feeds = {}
    for value in model.graph.input:
        dims = [
            d.dim_value or (1 if i == 0 and len(value.type.tensor_type.shape.dim) == 3 else 16)
            for i, d in enumerate(value.type.tensor_type.shape.dim)
        ]
        assert value.type.tensor_type.elem_type == TensorProto.FLOAT, value.name
        feeds[value.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


def test_int8_recipe_writes_the_attention_only_when_asked(exported_variants, tmp_path):
    import onnx
    import onnx_ir as ir

    from colembed.sessions import Session
    from colembed_export.variants import recipes

    assert recipes.INT8_VISION_ATTENTION is False  # the default int8 graph keeps the fused one
    vision = exported_variants.folder / "vision.onnx"
    fp32 = onnx.load(str(vision), load_external_data=False)
    blocks = [n.op_type for n in fp32.graph.node].count("MultiHeadAttention")
    assert blocks >= 1
    default, figures = recipes.quantize_int8(vision)
    assert figures["int8_attentions"] == 0
    assert [n.op_type for n in default.graph].count("MultiHeadAttention") == blocks
    model = ir.load(vision)  # the attention alone, on the exported fp32 graph
    assert int8_attentions(model) == blocks
    ops = [n.op_type for n in model.graph]
    assert "MultiHeadAttention" not in ops and ops.count("Scan") == blocks
    ir.save(model, tmp_path / "vision.onnx", external_data="vision.onnx_data")
    feeds = _feeds(fp32, np.random.default_rng(0))
    want, got = (
        Session(str(path), threads=1).run(feeds)[0] for path in (vision, tmp_path / "vision.onnx")
    )
    want, got = want.reshape(-1, want.shape[-1]), got.reshape(-1, got.shape[-1])
    cosine = (want * got).sum(-1) / np.linalg.norm(want, axis=-1) / np.linalg.norm(got, axis=-1)
    assert cosine.min() >= 0.999, cosine.min()
    asked, figures = recipes.quantize_int8(vision, attention=True)
    assert figures["int8_attentions"] == blocks
    assert [n.op_type for n in asked.graph].count("Scan") == blocks
