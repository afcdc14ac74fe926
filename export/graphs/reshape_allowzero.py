"""The one `Reshape(allowzero)` cleaner, applied to every graph colembed writes.

The dynamo exporter emits `Reshape(allowzero=1)`; DirectML rejects it at session start and
onnxruntime then silently falls back to the CPU (graphs.md), so every such attribute is cleared.
Our reshapes never carry a literal 0 dim, so `allowzero=0` has the same meaning. Both the fp32
export (`onnx_io.export_graph`) and the variant recipes (`graph_edits.finish`) call it; it lives
apart from both so that neither imports the other for it.
"""

from __future__ import annotations

from typing import Any


def clear_reshape_allowzero(model: Any) -> int:
    """Set `allowzero=0` on every Reshape of an onnx_ir model (all subgraphs). Returns the count."""
    import onnx_ir as ir

    cleared = 0
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type == "Reshape" and node.domain in ("", "ai.onnx"):
            attr = node.attributes.get("allowzero")
            if attr is not None and attr.value == 1:
                node.attributes["allowzero"] = ir.AttrInt64("allowzero", 0)
                cleared += 1
    return cleared
