"""The exporter's half of each family declaration (`colembed.families` holds the torch-free half).

Per family, what only the exporter needs: how a checkpoint becomes one strict fp32
`ColQwen2ForRetrieval` (the class every graph wraps and the check compares against), which module
becomes the image graph, and what the unpatched reference needs to run its own page forward.
Everything else (the text graph, the scorer, the processor files, the check, the manifest) is one
code path for every family.

| family     | loader                                        | image graph        | reference |
|------------|-----------------------------------------------|--------------------|-----------|
| colqwen2   | `checkpoint.load_strict` (transformers only)  | `ImageGraph`       | as loaded |
| colqwen2.5 | `load_strict` (transformers layout),          | `WindowedImageGraph` | + `get_dtype` |
|            | `checkpoint_qwen2_5.load_colqwen2_5` (colpali) |                    | shim      |

Example inputs for tracing come from `graphs.example_inputs`, which sizes the vision grid from the
folder's vision attention (several windows, every symbolic size distinct).

Imports torch and transformers lazily, inside the callables: resolving a family is cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from colembed.errors import ExportError, ModelFolderError
from colembed.families import COLQWEN2, COLQWEN2_5, Family, get_family


@dataclass(frozen=True)
class ExportFamily:
    """What the exporter does differently per family (see the module table)."""

    family: Family
    load: Callable[[Path], Any]  # folder -> strict fp32 ColQwen2ForRetrieval in eval mode
    image_graph: Callable[[Any], Any]  # retrieval model -> the torch module of the image graph
    prepare_reference: Callable[[Any], Any]  # retrieval model -> itself, runnable as reference


def _image_graph(model: Any):
    from .graphs import ImageGraph

    return ImageGraph.of_model(model)


def _windowed_image_graph(model: Any):
    from .graphs_qwen2_5 import WindowedImageGraph

    return WindowedImageGraph.of_model(model)


def _as_is(model: Any) -> Any:
    return model


def _with_dtype_shim(model: Any) -> Any:
    """transformers 4.57.1 `ColQwen2ForRetrieval.forward` calls `visual.get_dtype()`, which only
    Qwen2-VL's tower defines (docs/reference-colqwen2_5.md, pinned by
    `test_reference_page_forward_needs_the_dtype_shim`). The shim returns the tower's own dtype."""
    visual = model.vlm.model.visual
    if not hasattr(visual, "get_dtype"):
        dtype = next(visual.parameters()).dtype
        visual.get_dtype = lambda: dtype
    return model


def _load_colqwen2_5(folder: Path):
    """transformers' layout through the strict loader; colpali-engine's published layout through
    `load_colqwen2_5` (which refuses missing and unexpected tensors itself)."""
    from .checkpoint import load_strict
    from .checkpoint_qwen2_5 import checkpoint_layout, load_colqwen2_5

    try:
        if checkpoint_layout(folder) == "transformers":
            return load_strict(folder)
        return load_colqwen2_5(folder)
    except ModelFolderError as e:
        raise ExportError(f"{folder}: the checkpoint does not load ({e})") from e


def _load_colqwen2(folder: Path):
    from .checkpoint import load_strict

    return load_strict(folder)


EXPORT_FAMILIES = {
    COLQWEN2.name: ExportFamily(COLQWEN2, _load_colqwen2, _image_graph, _as_is),
    COLQWEN2_5.name: ExportFamily(COLQWEN2_5, _load_colqwen2_5, _windowed_image_graph,
                                  _with_dtype_shim),
}


def export_family(name: str) -> ExportFamily:
    """The exporter's declaration for a family of `colembed.families`."""
    return EXPORT_FAMILIES[get_family(name).name]


__all__ = ["EXPORT_FAMILIES", "ExportFamily", "export_family"]
