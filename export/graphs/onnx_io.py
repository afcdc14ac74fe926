"""Turning a torch module into a loadable ONNX file: dynamo export, clean-up, external data, check.

Lessons this module encodes (graphs.md, seed 002):
- the dynamo exporter emits `Reshape(allowzero=1)`, which DirectML rejects: every such attribute
  is cleared (`reshape_allowzero.py`), and RMSNorm is rewritten in the form onnxruntime fuses
  (`graph_edits.fusable_rms_norms`);
- protobuf cannot hold more than 2 GB, so large graphs keep their weights in one `<graph>.onnx_data`
  file beside the graph; `onnx.checker` is run on the path, which handles both forms.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any, Callable

from colembed.contracts import GraphContract
from colembed.errors import ExportError

from ..constants import DATA_SUFFIX, EXTERNAL_DATA_THRESHOLD, OPSET
from .edits import fusable_rms_norms
from .reshape_allowzero import clear_reshape_allowzero

log = logging.getLogger("colembed_export")
# torch's exporter warns about every torchvision op it cannot register; torchvision is
# deliberately absent (it breaks transformers' image processing beside this torch).
logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)


def _dynamic_shapes(contract: GraphContract) -> dict[str, dict[int, Any]]:
    """torch.export dims from the contract: the same symbolic name is the same Dim."""
    import torch

    dims: dict[str, Any] = {}
    shapes: dict[str, dict[int, Any]] = {}
    for spec in contract.inputs:
        axes = {}
        for axis, dim in enumerate(spec.dims):
            if isinstance(dim, str):
                axes[axis] = dims.setdefault(dim, torch.export.Dim(dim))
        shapes[spec.name] = axes
    return shapes


def release_weights(model: Any) -> None:
    """Drop an onnx_ir model's references to its weights once it is saved.

    onnxscript's module-level rewrite rules keep their matcher state, which points into the last
    graph they matched: the exported graph (and through it every torch weight it wraps) outlived
    the export, holding the memory-mapped checkpoint resident while onnxruntime loaded the graphs
    (measured: the text weights stayed resident through the check).
    """
    import onnx_ir as ir

    graph = model.graph
    values = [*graph.initializers.values(), *graph.inputs, *graph.outputs]
    # Inputs removed by the optimiser (the weights the exporter first lifts as inputs) stay keys
    # of the input list's reference counter.
    values.extend(getattr(graph.inputs, "_ref_counter", {}).keys())
    for node in ir.traversal.RecursiveGraphIterator(graph):
        values.extend(v for v in (*node.inputs, *node.outputs) if v is not None)
    for value in values:
        value.const_value = None


def weight_bytes(module: Any) -> int:
    return sum(p.numel() * p.element_size() for p in module.state_dict().values())


def _dynamo_export(
    module: Any,
    example_inputs: tuple,
    contract: GraphContract,
    opset: int,
    translations: dict | None,
) -> Any:
    """torch.onnx.export (dynamo, optimised) with the contract's names and dynamic axes."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return torch.onnx.export(
                module,
                example_inputs,
                input_names=[s.name for s in contract.inputs],
                output_names=[s.name for s in contract.outputs],
                dynamic_shapes={
                    s.name: d for s, d in zip(contract.inputs, _dynamic_shapes(contract).values())
                },
                opset_version=opset,
                dynamo=True,
                optimize=True,
                custom_translation_table=translations,
                verbose=False,
                report=False,
            )
        except Exception as e:  # torch.export raises a zoo of types; all mean the same here
            raise ExportError(f"torch could not export the {contract.role} graph: {e}") from e


def export_graph(
    module: Any,
    example_inputs: tuple,
    contract: GraphContract,
    path: Path,
    *,
    opset: int = OPSET,
    external_data: bool | None = None,
    translations: dict | None = None,
    before_save: Callable[[Any], Any] | None = None,
) -> dict[str, Any]:
    """Export `module` to `path` per `contract`; returns what the manifest records about it.

    `external_data=None` decides by size; `translations` maps custom torch ops to ONNX functions.
    The weights go straight from the torch tensors to disk; the in-memory graph is released before
    returning. `before_save(model)` may swap the traced onnx_ir model's initializers for lazy ones
    (streamed_weights.py) just before it is written. Raises ExportError with the exporter's
    message when torch cannot export the module.
    """
    import onnx
    import onnx_ir as ir

    path = Path(path)
    if external_data is None:
        external_data = weight_bytes(module) > EXTERNAL_DATA_THRESHOLD
    data_name = path.name + DATA_SUFFIX if external_data else None
    program = _dynamo_export(module, example_inputs, contract, opset, translations)
    model = program.model
    cleared = clear_reshape_allowzero(model)
    norms = fusable_rms_norms(model)
    if before_save is not None:
        before_save(model)
    for stale in (path, path.with_name(path.name + DATA_SUFFIX)):
        if stale.exists():
            stale.unlink()
    ir.save(model, path, external_data=data_name, size_threshold_bytes=1024 if data_name else 0)
    release_weights(model)
    del program, model
    try:
        onnx.checker.check_model(os.fspath(path), full_check=False)
    except onnx.checker.ValidationError as e:
        raise ExportError(f"{path.name}: onnx.checker rejected the exported graph: {e}") from e
    log.info(
        "wrote %s (%s), cleared %d Reshape allowzero, %d RMSNorms in fusable form",
        path.name,
        "external data" if data_name else "inline",
        cleared,
        norms,
    )
    return {
        "file": path.name,
        "data_file": data_name,
        "opset": opset,
        "reshape_allowzero_cleared": cleared,
    }
