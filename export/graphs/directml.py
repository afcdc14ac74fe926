"""Will DirectML run this graph? A check against its registered kernels, without Windows.

onnxruntime places a node on the DirectML execution provider only when DirectML registered a kernel
for its (domain, op, since-version) with the node's tensor types; anything else silently runs on the
CPU, copying tensors across for every such node. `directml_problems` lists every node of a graph
that would not be placed, plus the graph-level conditions DirectML needs (graphs.md, seed 002):
default-domain opset <= `MAX_OPSET`, no `Reshape(allowzero=1)` (DirectML rejects the whole graph
at session start), and nodes whose attributes or inputs DirectML's kernel checks beyond their types
(`node_rules` in the data file: MatMulNBits with 4- or 8-bit blocks, zero points, whole blocks).

The kernel list is data (`data/directml_kernels.json`), with its source and version recorded.
Limits: types are checked against the union of an op's type constraints, not per constraint; an
op DirectML registers but only runs with CPU-constant inputs (Slice starts, Split sizes) is
counted as placed. This module imports onnx (schemas, type inference), never torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

KERNELS_FILE = Path(__file__).with_name("data") / "directml_kernels.json"
MAX_OPSET = 20  # onnxruntime-directml's highest default-domain opset with full coverage here
DEFAULT_DOMAINS = ("", "ai.onnx")


@dataclass(frozen=True)
class NodeUse:
    """One (domain, op, since-version, element type) a graph uses, with a node that uses it."""

    domain: str
    op: str
    since: int
    dtype: str
    node: str


@lru_cache(maxsize=1)
def kernel_table() -> dict[str, Any]:
    return json.loads(KERNELS_FILE.read_text(encoding="utf-8"))


def _elem_types(model: Any) -> dict[str, int]:
    """Element type of every value; contrib-op outputs take their first input's type (true for the
    contrib ops colembed emits), re-inferred until nothing changes."""
    import onnx

    model = onnx.ModelProto.FromString(model.SerializeToString())
    known: dict[str, int] = {}
    for _ in range(256):
        inferred = onnx.shape_inference.infer_shapes(model)
        g = inferred.graph
        known = {
            v.name: v.type.tensor_type.elem_type
            for v in [*g.value_info, *g.input, *g.output]
            if v.type.tensor_type.elem_type
        }
        known.update({i.name: i.data_type for i in g.initializer})
        added = [
            onnx.helper.make_tensor_value_info(out, known[n.input[0]], None)
            for n in g.node
            if n.domain not in DEFAULT_DOMAINS and n.input and n.input[0] in known
            for out in n.output[:1]
            if out and out not in known
        ]
        if not added:
            return known
        model.graph.value_info.extend(added)
    return known


def _fixed_type_slots(schema: Any, count: int, outputs: bool) -> set[int]:
    """Positions whose type the schema fixes (e.g. Reshape's int64 shape): not a kernel choice."""
    params = schema.outputs if outputs else schema.inputs
    variables = {c.type_param_str for c in schema.type_constraints}
    slots = set()
    for i in range(count):
        param = params[min(i, len(params) - 1)] if params else None
        if param is not None and param.type_str not in variables:
            slots.add(i)
    return slots


def _nodes(graph: Any) -> list[Any]:
    """The graph's nodes and those of its subgraphs (If branches), outermost first."""
    from onnx import AttributeProto

    found = []
    for node in graph.node:
        found.append(node)
        for attr in node.attribute:
            subgraphs = [attr.g] if attr.type == AttributeProto.GRAPH else list(attr.graphs)
            for sub in subgraphs:
                found += _nodes(sub)
    return found


def graph_uses(model: Any) -> list[NodeUse]:
    """Every (domain, op, since, dtype) of the graph's nodes, subgraphs included (onnx ModelProto)."""
    import onnx
    from onnx import helper

    opsets = {o.domain or "": o.version for o in model.opset_import}
    types = _elem_types(model)
    uses = []
    for node in _nodes(model.graph):
        domain = node.domain or ""
        schema = None
        if domain in DEFAULT_DOMAINS:
            schema = onnx.defs.get_schema(node.op_type, opsets.get("", 1), "")
            since = schema.since_version
        else:
            since = opsets.get(domain, 1)
        skip_in = _fixed_type_slots(schema, len(node.input), False) if schema else set()
        skip_out = _fixed_type_slots(schema, len(node.output), True) if schema else set()
        names = [n for i, n in enumerate(node.input) if n and i not in skip_in]
        names += [n for i, n in enumerate(node.output) if n and i not in skip_out]
        dtypes = {helper.tensor_dtype_to_np_dtype(types[n]).name for n in names if n in types} or {
            "?"
        }
        uses += [
            NodeUse(
                domain or "ai.onnx",
                node.op_type,
                since,
                dtype.replace("float32", "float").replace("float64", "double"),
                node.name,
            )
            for dtype in sorted(dtypes)
        ]
    return uses


def unsupported(uses: list[NodeUse]) -> list[str]:
    """The uses DirectML has no kernel for, one line each (op, since, type, an example node)."""
    table = kernel_table()
    sets, kernels = table["type_sets"], table["kernels"]
    missing: dict[tuple[str, str, int, str], str] = {}
    for use in uses:
        versions = dict(
            (since, code) for since, code in kernels.get(use.domain, {}).get(use.op, [])
        )
        if use.since not in versions:
            missing.setdefault((use.domain, use.op, use.since, "-"), use.node)
        elif use.dtype != "?" and use.dtype not in sets[versions[use.since]]:
            missing.setdefault((use.domain, use.op, use.since, use.dtype), use.node)
    return [
        f"{d}:{op} (since {since}){'' if t == '-' else f' on {t}'}, e.g. node {node!r}"
        for (d, op, since, t), node in sorted(missing.items())
    ]


def node_rule_problems(
    node: Any, attrs: dict[str, Any], rules: dict[str, Any], ranks: dict[str, int] | None = None
) -> list[str]:
    """What keeps `node` off DirectML under its op's `node_rules` entry (none: no such rule):
    the kernel's own support query and constructor check attributes, inputs and input ranks
    that the type table cannot show (the data file's rule records which source says so).
    `ranks`: the rank of each tensor the graph declares a shape for (`declared_ranks`)."""
    rule = rules.get(f"{node.domain or 'ai.onnx'}:{node.op_type}")
    if rule is None:
        return []
    problems = []
    name = f"{node.op_type} {node.name!r}"
    if "bits" in rule:
        bits = attrs["bits"].i if "bits" in attrs else 4
        if bits not in rule["bits"]:
            problems.append(f"{name}: {bits} bits; DirectML's kernel takes {rule['bits']}")
    if "inputs" in rule:
        given = list(node.input)
        if len(given) != len(rule["inputs"]) or not all(given):
            problems.append(
                f"{name}: inputs {given}; DirectML's kernel takes exactly "
                f"{', '.join(rule['inputs'])}"
            )
    if "input_rank" in rule:
        rank = (ranks or {}).get(node.input[0])
        if rank != rule["input_rank"]:
            problems.append(
                f"{name}: input of rank {rank if rank is not None else 'unknown'}; "
                f"DirectML's kernel reads rank {rule['input_rank']} only"
            )
    if rule.get("k_multiple_of_block"):
        k, block = attrs["K"].i, attrs["block_size"].i
        if k % block:
            problems.append(
                f"{name}: K {k} is not a whole number of blocks of {block} "
                "(DirectML's kernel takes whole blocks only)"
            )
    return problems


def declared_ranks(graph: Any) -> dict[str, int]:
    """{tensor name: rank} for every tensor whose shape the graph declares (inputs, outputs and
    value_info: the exporter records the shapes it traced)."""
    return {
        v.name: len(v.type.tensor_type.shape.dim)
        for v in [*graph.input, *graph.output, *graph.value_info]
        if v.type.tensor_type.HasField("shape")
    }


def directml_problems(path: str | Path) -> list[str]:
    """Everything that keeps the graph at `path` (or some of its nodes) off DirectML."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    problems = []
    rules = kernel_table().get("node_rules", {})
    opset = next((o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS), 0)
    if opset > MAX_OPSET:
        problems.append(f"default-domain opset {opset} > {MAX_OPSET}")
    ranks = declared_ranks(model.graph)
    for node in model.graph.node:
        attrs = {a.name: a for a in node.attribute}
        if node.op_type == "Reshape" and "allowzero" in attrs and attrs["allowzero"].i == 1:
            problems.append(f"Reshape {node.name!r} has allowzero=1 (DirectML rejects the graph)")
        problems += node_rule_problems(node, attrs, rules, ranks)
    return problems + unsupported(graph_uses(model))
