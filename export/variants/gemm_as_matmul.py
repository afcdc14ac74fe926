"""Gemm nodes with a constant weight rewritten as MatMul (+ Add of the bias), so int8 reaches them.

The torch exporter writes a Linear over a 2-D input as `Gemm(A, W, C, transB=1)`: in the Qwen2-VL
vision tower that is the patch merger's MLP (5120 -> 5120 -> text width, on every merged token of
a page), while the blocks' Linears over 3-D inputs come out as MatMul + Add. The int8 recipe
quantises MatMuls (quantise.py), so the merger stayed fp32 in the int8 vision graph: ~50 GFLOP per
letter page, 14% of a 2+2-layer int8 page's vision time when profiled (benchmarks/results/
embed-against.md), where 0.1.0 (onnxruntime's quantize_dynamic, which takes Gemm) ran it in int8.

`gemms_as_matmuls` rewrites `Gemm(A, W, C)` with transA=0, alpha=1 (beta=1 when C is there), a
constant 2-D fp32 W and a 2-D A into `MatMul(A, W or W^T)` followed by `Add(C)`: the same function
in the same precision (the fp32 graphs keep their Gemm; this runs on the int8 recipe's copy only).
Any other Gemm is left as it is. The MatMul keeps the Gemm's torch name scope, so the recipe's
per-module reports still name the merger. Imports onnx_ir and numpy only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..graphs.edits import ONNX_DOMAINS, _const_float, _swap_in, add_initializer, release


def _attribute(node: Any, name: str, default: Any) -> Any:
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def gemms_as_matmuls(model: Any) -> int:
    """Rewrite every eligible Gemm of `model` (an onnx_ir Model) in place; returns how many."""
    import onnx_ir as ir

    graph = model.graph
    count = 0
    for node in list(graph):
        if node.op_type != "Gemm" or node.domain not in ONNX_DOMAINS:
            continue
        a, w = node.inputs[0], node.inputs[1]
        c = node.inputs[2] if len(node.inputs) > 2 else None
        weight = _const_float(w)
        if (
            weight is None
            or weight.ndim != 2
            or _attribute(node, "transA", 0)
            or _attribute(node, "alpha", 1.0) != 1.0
            or (c is not None and _attribute(node, "beta", 1.0) != 1.0)
        ):
            continue
        if _attribute(node, "transB", 0):
            matrix = np.array(weight.T, order="C")  # a copy: the mapping is released below
            del weight  # no view of the memory-mapped weight may outlive it
            weight_value = add_initializer(graph, f"{w.name}_t", matrix)
            if len(w.uses()) == 1:
                release(w)
        else:
            del weight
            weight_value = w
        product = ir.node("MatMul", [a, weight_value], name=f"{node.name}_matmul")
        product.outputs[0].name = f"{node.name}_matmul_out"
        product.metadata_props.update(node.metadata_props)
        new = [product]
        if c is not None:
            biased = ir.node("Add", [product.outputs[0], c], name=f"{node.name}_bias")
            biased.outputs[0].name = f"{node.name}_bias_out"
            biased.metadata_props.update(node.metadata_props)
            new.append(biased)
        _swap_in(graph, node, new)
        count += 1
    if count:
        from onnx_ir.passes.common import RemoveUnusedNodesPass

        RemoveUnusedNodesPass()(model)
    return count
