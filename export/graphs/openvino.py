"""Which graphs OpenVINO runs as onnxruntime does: a check against data/openvino_ops.json.

The rule per `com.microsoft` op lives in the data file (its source and the OpenVINO release it
was checked on are recorded there), like DirectML's kernel table (directml.py). `openvino_problems`
names every node of a graph OpenVINO would refuse or compute with another meaning; the
`openvino` variants' graphs (openvino_form.py) have none. This module imports onnx, never torch.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

RULES_FILE = Path(__file__).with_name("data") / "openvino_ops.json"
MS_DOMAIN = "com.microsoft"


@lru_cache(maxsize=1)
def op_rules() -> dict[str, Any]:
    return json.loads(RULES_FILE.read_text(encoding="utf-8"))


def _constant_shapes(graph: Any) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the graph's constants: initializers and Constant nodes' values."""
    shapes = {t.name: tuple(t.dims) for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    shapes[node.output[0]] = tuple(attr.t.dims)
    return shapes


def openvino_problems(path: str | Path) -> list[str]:
    """Every node of the graph at `path` that OpenVINO's front end refuses or reads with another
    meaning than onnxruntime's, one line each (empty: it runs as on onnxruntime)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    rules = op_rules()["ops"]
    constants = _constant_shapes(model.graph)
    problems = []
    for node in model.graph.node:
        if node.domain != MS_DOMAIN:
            continue
        key = f"{MS_DOMAIN}:{node.op_type}"
        rule = rules.get(key)
        if rule is None:
            problems.append(
                f"{node.op_type} {node.name!r}: no rule for {key} in "
                f"{RULES_FILE.name} (not known to convert)"
            )
        elif not rule["converts"]:
            problems.append(f"{node.op_type} {node.name!r}: not converted ({rule['why']})")
        else:
            reasons = []
            if (
                rule.get("position_ids") == "per_token"
                and len(node.input) > 1
                and constants.get(node.input[1]) == (1,)
            ):
                reasons.append(
                    "position_ids is a (1,) offset, which OpenVINO reads as a row "
                    "index for every token"
                )
            if rule.get("compiled_cache") is False:
                reasons.append(
                    "its compiled form is wrong when read back from OpenVINO's compiled-model cache"
                )
            if "inputs" in rule and len([i for i in node.input if i]) != len(rule["inputs"]):
                reasons.append(
                    f"inputs {list(node.input)}; OpenVINO's conversion is checked for "
                    f"{rule['inputs']} only"
                )
            if reasons:
                problems.append(f"{node.op_type} {node.name!r}: " + "; ".join(reasons))
    return problems
