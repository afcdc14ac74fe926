"""The fp32 graphs in the form OpenVINO computes exactly: the `openvino` variants' graph edit.

The exported graphs use onnxruntime's fused `com.microsoft` kernels (graphs.py). OpenVINO's ONNX
front end converts some of them with another meaning or not at all; which forms it runs is data
(`data/openvino_ops.json`, checked by `openvino_problems`). This edit rewrites exactly those
nodes on the written fp32 graph, so onnxruntime's own graphs stay as they are:

- `RotaryEmbedding` becomes its standard-op decomposition: each token's table rows gathered by
  its position id, then rotate-half per head. Two reasons, both measured on OpenVINO 2026.4.1
  (tests/runtime/test_openvino.py): where `position_ids` is a (1,) offset (the vision rotary: token t
  reads row offset + t, onnxruntime's meaning), OpenVINO's front end gathers the tables by the
  ids as given, so every token read row 0 (the identity rotation); and where the ids are per
  token (the text rotary), the fused RoPE kernel OpenVINO makes of the node computes right when
  compiled but wrong when read back from the CPU plugin's compiled-model cache (a single-node
  graph: off by 4.6e9), and a caller may give the runtime a cache. The decomposition is exact on
  both runtimes and caches correctly; the offset form gets explicit per-token ids.
- `GroupQueryAttention` (causal, every item's `seqlens_k` the full length - 1: graphs.py
  `causal_attention`) becomes its standard-op decomposition: heads split, key/value heads
  repeated, QK^T * scale, the causal mask, Softmax, PV. OpenVINO's front end refuses the node in
  this form (it requires rotary cos/sin inputs); on its CPU plugin the decomposition ran at least
  as fast as the opset-23 `Attention` node it also reads, which would raise the graph's opset
  (benchmarks/results/openvino/openvino-2b-2+2-findings.md).

`MultiHeadAttention` (vision attention) converts as it is and is left alone.
This module imports onnx_ir and numpy, never torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from colembed.errors import ExportError

from .edits import add_initializer

MS_DOMAIN = "com.microsoft"


class _Builder:
    """Nodes and shared constants of one rewrite, named after the node they replace."""

    def __init__(self, graph: Any, prefix: str, metadata: dict[str, str]) -> None:
        self.graph, self.prefix, self.metadata = graph, prefix, metadata
        self.nodes: list[Any] = []

    def const(self, name: str, value: Any, dtype: Any = np.int64) -> Any:
        name = f"openvino_form_{name}"
        if name not in self.graph.initializers:
            add_initializer(self.graph, name, np.array(value, dtype))
        return self.graph.initializers[name]

    def add(self, op: str, inputs: list[Any], **attributes: Any) -> Any:
        import onnx_ir as ir

        node = ir.node(op, inputs, attributes or None, name=f"{self.prefix}_{op}_{len(self.nodes)}")
        node.outputs[0].name = f"{node.name}_out"
        node.metadata_props.update(self.metadata)
        self.nodes.append(node)
        return node.outputs[0]


def _constant_array(value: Any) -> np.ndarray | None:
    """The array of a constant input: an initializer or a `Constant` node's value, else None."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
        return producer.attributes["value"].value.numpy()
    return None


def _decomposed_rotary(graph: Any, node: Any) -> int:
    """Replace a RotaryEmbedding (interleaved 0, 3-D input, half tables) by standard ops: each
    token's table rows gathered by its position id (explicit per-token ids where the node has a
    (1,) offset), then rotate-half on every head; returns 1."""
    import onnx_ir as ir

    x, ids, cos, sin = node.inputs[:4]
    interleaved = node.attributes["interleaved"].value if "interleaved" in node.attributes else 0
    if (
        interleaved
        or "rotary_embedding_dim" in node.attributes
        and node.attributes["rotary_embedding_dim"].value
    ):
        raise ExportError(
            f"{node.name}: RotaryEmbedding interleaved or partial; the OpenVINO form "
            "decomposes graphs.py's form only"
        )
    heads = node.attributes["num_heads"].value
    if x.shape is None or len(x.shape) != 3:
        raise ExportError(
            f"{node.name}: RotaryEmbedding input of shape {x.shape}; the OpenVINO "
            "form decomposes a (batch, tokens, heads * head_dim) input only"
        )
    b = _Builder(graph, node.name or "rotary", dict(node.metadata_props))
    offset = _constant_array(ids)
    if offset is not None and offset.shape == (1,):  # onnxruntime's meaning: offset + token index
        shape = b.add("Shape", [x], start=0, end=2)  # (batch, tokens)
        tokens = b.add(
            "Squeeze",
            [
                b.add("Slice", [shape, b.const("one", [1]), b.const("two", [2])]),
                b.const("zero_axis", [0]),
            ],
        )
        start = b.const(f"offset_{int(offset[0])}", int(offset[0]))
        rows = b.add("Range", [start, b.add("Add", [tokens, start]), b.const("step", 1)])
        ids = b.add("Expand", [b.add("Unsqueeze", [rows, b.const("zero_axis", [0])]), shape])
    elif ids.shape is None or len(ids.shape) != 2:
        raise ExportError(f"{node.name}: position_ids of shape {ids.shape}")
    # (batch, tokens, half) -> (batch, tokens, 1, half): one row per token, for every head
    cos_rows, sin_rows = (
        b.add("Unsqueeze", [b.add("Gather", [t, ids], axis=0), b.const("axis_2", [2])])
        for t in (cos, sin)
    )
    per_head = b.add("Reshape", [x, b.const(f"heads_{heads}", [0, 0, heads, -1])])
    split = ir.node(
        "Split",
        [per_head],
        {"axis": -1, "num_outputs": 2},
        name=f"{b.prefix}_Split_{len(b.nodes)}",
        num_outputs=2,
    )
    for i, out in enumerate(split.outputs):
        out.name = f"{split.name}_out{i}"
    split.metadata_props.update(b.metadata)
    b.nodes.append(split)
    first, second = split.outputs
    rotated_first = b.add(
        "Sub", [b.add("Mul", [first, cos_rows]), b.add("Mul", [second, sin_rows])]
    )
    rotated_second = b.add(
        "Add", [b.add("Mul", [second, cos_rows]), b.add("Mul", [first, sin_rows])]
    )
    joined = b.add("Concat", [rotated_first, rotated_second], axis=-1)
    out = b.add("Reshape", [joined, b.add("Shape", [x])])
    graph.insert_after(node, b.nodes)
    _replace_output(graph, node, out)
    return 1


def _replace_output(graph: Any, node: Any, out: Any) -> None:
    """`out` takes the place of `node`'s first output everywhere; `node` leaves the graph."""
    import onnx_ir as ir

    old = node.outputs[0]
    out.shape, out.type = old.shape, old.type  # what later rewrites read (a known width)
    for i, output in enumerate(graph.outputs):
        if output is old:
            graph.outputs[i] = out
    ir.convenience.replace_all_uses_with(old, out)
    graph.remove(node, safe=True)


def _static_width(value: Any, what: str, node: Any) -> int:
    shape = value.shape
    if shape is None or len(shape) != 3 or not isinstance(shape[2], int):
        raise ExportError(
            f"{node.name}: {what} of shape {shape}; the OpenVINO form needs "
            "(batch, tokens, width) with a known width"
        )
    return int(shape[2])


def _decomposed_attention(graph: Any, node: Any) -> int:
    """Replace a GroupQueryAttention of the form graphs.py writes (no cache, no rotary inputs,
    causal over the whole prompt) by standard ops; returns 1."""

    inputs = list(node.inputs) + [None] * (9 - len(node.inputs))
    query, key, value = inputs[:3]
    if any(v is not None for v in inputs[3:5]) or any(v is not None for v in inputs[7:9]):
        raise ExportError(
            f"{node.name}: GroupQueryAttention with a past cache or rotary inputs; "
            "the OpenVINO form decomposes only graphs.py's causal prompt form"
        )
    if any(output.uses() for output in node.outputs[1:]):
        raise ExportError(f"{node.name}: GroupQueryAttention's present key/value are used")
    heads = node.attributes["num_heads"].value
    kv_heads = node.attributes["kv_num_heads"].value
    width = _static_width(query, "query", node)
    if width % heads or heads % kv_heads:
        raise ExportError(f"{node.name}: width {width}, {heads} heads, {kv_heads} key/value heads")
    head_dim = width // heads
    scale = node.attributes["scale"].value if "scale" in node.attributes else head_dim**-0.5
    if not scale:
        scale = head_dim**-0.5
    b = _Builder(graph, node.name or "attention", dict(node.metadata_props))
    to_heads = [0, 2, 1, 3]

    def split_heads(x: Any, count: int) -> Any:  # (b, t, count*d) -> (b, count, t, d)
        return b.add(
            "Transpose",
            [b.add("Reshape", [x, b.const(f"heads_{count}_{head_dim}", [0, 0, count, head_dim])])],
            perm=to_heads,
        )

    def repeat_heads(x: Any) -> Any:  # (b, kv, t, d) -> (b, heads, t, d), each kv head repeated
        if kv_heads == heads:
            return x
        group = heads // kv_heads
        grown = b.add(
            "Expand",
            [
                b.add("Unsqueeze", [x, b.const("axis_2", [2])]),
                b.const(f"group_{group}", [1, 1, group, 1, 1]),
            ],
        )
        return b.add(
            "Reshape", [grown, b.const(f"merged_{heads}_{head_dim}", [0, heads, -1, head_dim])]
        )

    q = split_heads(query, heads)
    k = repeat_heads(split_heads(key, kv_heads))
    v = repeat_heads(split_heads(value, kv_heads))
    scores = b.add(
        "Mul",
        [
            b.add("MatMul", [q, b.add("Transpose", [k], perm=[0, 1, 3, 2])]),
            b.const(f"scale_{scale!r}", scale, np.float32),
        ],
    )
    tokens = b.add("Squeeze", [b.add("Shape", [query], start=1, end=2), b.const("zero_axis", [0])])
    rows = b.add("Range", [b.const("zero", 0), tokens, b.const("step", 1)])
    future = b.add("Greater", [rows, b.add("Unsqueeze", [rows, b.const("one_axis", [1])])])
    masked = b.add("Where", [future, b.const("minus_inf", -np.inf, np.float32), scores])
    probs = b.add("Softmax", [masked], axis=-1)
    out = b.add("Transpose", [b.add("MatMul", [probs, v])], perm=to_heads)
    out = b.add("Reshape", [out, b.const(f"width_{width}", [0, 0, width])])
    graph.insert_after(node, b.nodes)
    _replace_output(graph, node, out)
    return 1


def to_openvino_form(model: Any) -> dict[str, int]:
    """Rewrite `model` (onnx_ir, an fp32 colembed graph) in place into the form OpenVINO computes
    as onnxruntime does; returns how many nodes of each kind were rewritten."""
    done = {"rotary_decomposed": 0, "attention_decomposed": 0}
    for node in list(model.graph):
        if node.domain != MS_DOMAIN:
            continue
        if node.op_type == "RotaryEmbedding":
            done["rotary_decomposed"] += _decomposed_rotary(model.graph, node)
        elif node.op_type == "GroupQueryAttention":
            done["attention_decomposed"] += _decomposed_attention(model.graph, node)
    return done


def openvino_graph(src: Any) -> tuple[Any, dict[str, Any]]:
    """The OpenVINO form of the fp32 graph at `src` (an onnx_ir Model) and what was rewritten."""
    import onnx_ir as ir

    model = ir.load(src)
    return model, {"openvino_form": to_openvino_form(model)}


def openvino_int8_graph(src: Any, work: Any = None) -> tuple[Any, dict[str, Any]]:
    """The OpenVINO form with int8 weights the way OpenVINO runs them fastest without calibration:
    NNCF's weight compression, INT8_ASYM (uint8 per output channel, a scale and zero point each,
    as DequantizeLinear before each MatMul; OpenVINO's CPU plugin keeps the weights int8 and
    decompresses them inside its fully-connected kernel). Activations stay f32: the weights are
    what the CPU reads, and no calibration set can change what a page's tokens become.
    NNCF is handed the ModelProto with the weights left in `src`'s external data (NNCF's
    EXTERNAL_DATA_DIR: it reads each weight from there as it compresses it): protobuf cannot
    serialise a message above 2 GiB, and a 2B graph at full depth holds 2.7 GB (image) and 6.2 GB
    (text) of weights."""
    import logging
    from pathlib import Path

    import nncf
    import onnx_ir as ir
    from nncf.onnx.quantization.backend_parameters import BackendParameters
    from nncf.quantization.advanced_parameters import AdvancedCompressionParameters

    model, figures = openvino_graph(src)
    proto = ir.serde.serialize_model(model)  # external weights stay references to their file
    del model
    weights = Path(src).resolve().parent
    logging.getLogger("nncf").setLevel(logging.ERROR)
    compressed = nncf.compress_weights(
        proto,
        mode=nncf.CompressWeightsMode.INT8_ASYM,
        advanced_parameters=AdvancedCompressionParameters(
            backend_params={BackendParameters.EXTERNAL_DATA_DIR: str(weights)}
        ),
    )
    dequantized = sum(n.op_type == "DequantizeLinear" for n in compressed.graph.node)
    figures["openvino_int8_weights"] = dequantized
    return ir.serde.deserialize_model(compressed), figures
