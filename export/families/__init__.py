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
| colqwen3   | `checkpoint_qwen3.load_colqwen3` (colpali,    | `DeepStackImageGraph` | as loaded |
|            | TomoroAI: `layouts_qwen3`)                    |                    |           |

ColQwen3 also has its own text graph (`DeepStackTextGraph`: DeepStack's extra input) and its own
reference run for the check (`verify.reference_outputs_qwen3`: colpali-engine's ColQwen3Processor
semantics with 4.57.1's classes, the tower's first output).

ColQwen3.5 (`qwen3_5.model.load_colqwen3_5`) reuses ColQwen3's image graph with no DeepStack
layers, its reference run and processor (colpali-engine's ColQwen3_5Processor has ColQwen3's
prompts and image pipeline), and has its own text graph (`qwen3_5.text.ColQwen3_5TextGraph`:
colembed's Qwen3.5 stack, traced on its own example inputs, long enough for the DeltaNet layers'
chunk groups).

Example inputs for tracing come from `graphs.example_inputs`, which sizes the vision grid from the
folder's vision attention (several windows, every symbolic size distinct).

Imports torch and transformers lazily, inside the callables: resolving a family is cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from colembed.errors import ExportError, ModelFolderError
from colembed.families import COLQWEN2, COLQWEN2_5, COLQWEN3, COLQWEN3_5, Family, get_family


@dataclass(frozen=True)
class ExportFamily:
    """What the exporter does differently per family (see the module table)."""

    family: Family
    load: Callable[[Path], Any]  # folder -> strict fp32 ColQwen2ForRetrieval in eval mode
    image_graph: Callable[[Any], Any]  # retrieval model -> the torch module of the image graph
    prepare_reference: Callable[[Any], Any]  # retrieval model -> itself, runnable as reference
    text_graph: Callable[[Any], Any] | None = None  # None: graphs.TextGraph
    reference_outputs: Callable[[Any, Path], Any] | None = None  # None: verify.reference_outputs
    # folder -> (processor, PreprocessConfig) for a checkpoint transformers' ColQwen2Processor
    # does not read itself (None: `ColQwen2Processor.from_pretrained(folder)` reads it); the
    # benchmarks' torch reference then runs `load(folder)`'s model
    reference_processor: Callable[[Path], Any] | None = None
    # text graph module -> its tracing inputs, when the shared small ones would let the exporter
    # specialise a size (ColQwen3.5's DeltaNet layers need sequences spanning two chunk groups)
    text_example_inputs: Callable[[Any], tuple] | None = None

    def text_graph_of(self, model: Any):
        from .qwen2.graphs import TextGraph

        return (self.text_graph or TextGraph)(model)

    def run_reference(self, model: Any, folder: Path):
        from ..pipeline.verify import reference_outputs

        return (self.reference_outputs or reference_outputs)(model, folder)


def _image_graph(model: Any):
    from .qwen2.graphs import ImageGraph

    return ImageGraph.of_model(model)


def _windowed_image_graph(model: Any):
    from .qwen2_5.graphs import WindowedImageGraph

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
    from .qwen2_5.checkpoint import checkpoint_layout, load_colqwen2_5

    try:
        if checkpoint_layout(folder) == "transformers":
            return load_strict(folder)
        return load_colqwen2_5(folder)
    except ModelFolderError as e:
        raise ExportError(f"{folder}: the checkpoint does not load ({e})") from e


def _deepstack_image_graph(model: Any):
    from .qwen3.graphs import DeepStackImageGraph

    return DeepStackImageGraph.of_model(model)


def _deepstack_text_graph(model: Any):
    from .qwen3.graphs import DeepStackTextGraph

    return DeepStackTextGraph(model)


def _load_colqwen3(folder: Path):
    from .qwen3.checkpoint import load_colqwen3

    return load_colqwen3(folder)


def _reference_qwen3(model: Any, folder: Path):
    from ..pipeline.verify import reference_outputs_qwen3

    return reference_outputs_qwen3(model, folder)


def _reference_processor_qwen3(folder: Path):
    from ..pipeline.verify import reference_processor_qwen3

    return reference_processor_qwen3(folder)


def _load_colqwen3_5(folder: Path):
    from .qwen3_5.model import load_colqwen3_5

    return load_colqwen3_5(folder)


def _qwen3_5_text_graph(model: Any):
    from .qwen3_5.text import ColQwen3_5TextGraph

    return ColQwen3_5TextGraph(model.text)


def _own_example_inputs(graph: Any) -> tuple:
    return graph.example_inputs()


def _load_colqwen2(folder: Path):
    from .checkpoint import load_strict

    return load_strict(folder)


EXPORT_FAMILIES = {
    COLQWEN2.name: ExportFamily(COLQWEN2, _load_colqwen2, _image_graph, _as_is),
    COLQWEN2_5.name: ExportFamily(
        COLQWEN2_5, _load_colqwen2_5, _windowed_image_graph, _with_dtype_shim
    ),
    COLQWEN3.name: ExportFamily(
        COLQWEN3,
        _load_colqwen3,
        _deepstack_image_graph,
        _as_is,
        text_graph=_deepstack_text_graph,
        reference_outputs=_reference_qwen3,
        reference_processor=_reference_processor_qwen3,
    ),
    COLQWEN3_5.name: ExportFamily(
        COLQWEN3_5,
        _load_colqwen3_5,
        _deepstack_image_graph,  # with no DeepStack layers: the merged features only
        _as_is,
        text_graph=_qwen3_5_text_graph,
        reference_outputs=_reference_qwen3,
        reference_processor=_reference_processor_qwen3,
        text_example_inputs=_own_example_inputs,
    ),
}


def export_family(name: str) -> ExportFamily:
    """The exporter's declaration for a family of `colembed.families`."""
    return EXPORT_FAMILIES[get_family(name).name]


__all__ = ["EXPORT_FAMILIES", "ExportFamily", "export_family"]
