"""Graph weights written tensor by tensor from the memory-mapped checkpoint, never the whole model.

The graphs are traced from a *stand-in* model: the very module the family's loader builds from the
checkpoint's config (transformers' `ColQwen2ForRetrieval` for ColQwen2 and ColQwen2.5 in either
layout; the ColQwen3 retrieval module over 4.57.1's `Qwen3VLModel`, DeepStack mergers included;
ColQwen3.5's over 4.57.1's Qwen3-VL tower and colembed's own text stack, `qwen3_5/model.py`, whose
Gated DeltaNet projections are separate matrices the graph reads whole), whose weight matrices
(every 2-D parameter: the linear layers and the token embedding, nearly all the bytes) are
uninitialised `torch.empty` tensors of the real shapes and dtype. Nothing writes into them, so the
kernel gives them no pages: the trace costs the activations and the graph, not the weights. The
other parameters (norms, biases, the patch convolution, DeltaNet's depthwise conv kernels, decay
and step; a few MB) are read whole from the checkpoint, because the graph wrappers compute from
them when they are built (the patch convolution becomes a matrix) and the exporter's rewrites may
read them.

After the trace each initializer is mapped back to the checkpoint: the exporter hands a stand-in
over as the very tensor (a torch parameter) or as a transposed view of it (the optimiser folds
`Linear`'s transpose into a numpy view of the same memory), so the initializer's memory names its
stand-in, the stand-in's parameter name names the checkpoint tensor (through the layout's key map:
`checkpoint_tensors`), and the view's strides give
the axis order. Each such initializer becomes an `onnx_ir.LazyTensor` that reads its tensor from
the safetensors shard, widens it to fp32 (exact for F32, F16 and BF16: what the strict loader's
`dtype=torch.float32` does), applies the axis order and is dropped once `ir.save` has written it:
the bytes are the ones today's export writes from the loaded model, one tensor in memory at a
time. Initializers that read no stand-in (constants, the parameters read whole, what the wrappers
derived from them) are written as traced.

Refused, naming the tensor: a checkpoint tensor that is missing, has another shape, or a dtype
other than F32 / F16 / BF16; a tensor the model does not have; a stand-in the graph reads in a
form other than itself or a transpose (a slice, a copy, a folded product), which this writer could
not reproduce from the file.

Every served family and layout streams; `streaming_applies` is the one place that decides, and
says why a checkpoint does not (no safetensors weights: a `.bin` checkpoint; `stream_weights=False`
asks for the whole-model path). A LoRA adapter is merged into its base in memory first
(`families/qwen2_5/adapter.py`): the merged model is exported from that folder of safetensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colembed.errors import ExportError

# Checkpoint dtypes whose widening to fp32 is exact (the loaded model's values, bit for bit).
WIDENED_DTYPES = ("F32", "F16", "BF16")
SHARD_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class StreamedWeightsError(ExportError):
    """A checkpoint tensor the streamed writer cannot use, or a graph it cannot map back."""


# The families whose layouts `checkpoint_tensors` maps (every served one).
STREAMED_FAMILIES = ("colqwen2", "colqwen2.5", "colqwen3", "colqwen3.5")


def streaming_applies(folder: Path, family: Any) -> str | None:
    """None when `folder`'s graph weights can be streamed, else why the whole fp32 model is loaded
    per graph instead: a family outside `STREAMED_FAMILIES`, or a checkpoint without safetensors
    weights (every layout of those families streams; `checkpoint_tensors` maps their keys)."""
    name = family.family.name
    if name not in STREAMED_FAMILIES:
        return f"{family.family.display_name}'s weights are not streamed yet"
    if not ((folder / SHARD_INDEX).is_file() or any(folder.glob("*.safetensors"))):
        return f"no {SINGLE_FILE} or {SHARD_INDEX}"
    return None


class CheckpointTensors:
    """The safetensors tensors of a checkpoint folder by their name in the model (`where`: name ->
    (file, key in that file)), read one at a time through `safe_open`: a tensor read keeps only
    its own pages mapped, and only while it is alive, so the pages read do not stay counted in
    this process's memory. Without `where`, transformers' layout: the shard index's or the single
    file's keys are the model's names."""

    def __init__(self, folder: Path, where: dict[str, tuple[Path, str]] | None = None) -> None:
        self.folder = Path(folder)
        if where is None:
            where = {name: (self.folder / shard, name) for name, shard in _shards(self.folder)}
        self.where = dict(where)

    @property
    def shard_of(self) -> dict[str, tuple[Path, str]]:  # the names, for membership tests
        return self.where

    def _open(self, name: str):
        from safetensors import safe_open

        path, key = self.where[name]
        if not Path(path).is_file():
            raise StreamedWeightsError(f"{path}: a shard the checkpoint names is missing")
        return safe_open(path, framework="pt"), key

    def describe(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype string) of `name`, without reading its data."""
        opened, key = self._open(name)
        with opened as f:
            view = f.get_slice(key)
            return tuple(view.get_shape()), view.get_dtype()

    def read(self, name: str):
        """`name` as an fp32 torch tensor (widened exactly from F16 / BF16). An F32 tensor stays
        backed by the shard's pages (mapped for this tensor alone, unmapped when it is dropped):
        written out, it costs no copy."""
        import torch

        opened, key = self._open(name)
        with opened as f:
            return f.get_tensor(key).to(torch.float32)


def _shards(folder: Path) -> list[tuple[str, str]]:
    """(tensor, shard file name) of transformers' layout: the shard index or the single file."""
    from safetensors import safe_open

    index = folder / SHARD_INDEX
    if index.is_file():
        try:
            return list(dict(json.loads(index.read_text())["weight_map"]).items())
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise StreamedWeightsError(f"{index}: not a safetensors shard index ({e})") from e
    if not (folder / SINGLE_FILE).is_file():
        raise StreamedWeightsError(f"{folder}: no {SINGLE_FILE} or {SHARD_INDEX}")
    with safe_open(folder / SINGLE_FILE, framework="pt") as f:
        return [(k, SINGLE_FILE) for k in f.keys()]


@dataclass(frozen=True)
class Skeleton:
    """A checkpoint's model with its parameters on the meta device (no memory; buffers computed),
    its tensors by model name, and the parameters that may be absent from the file because no
    embedding reads them (colpali-engine's headless ColQwen2.5: an untied LM head)."""

    model: Any
    tensors: CheckpointTensors
    optional: frozenset[str] = frozenset()


def checkpoint_tensors(folder: Path, family: Any) -> Skeleton:
    """The stand-in's skeleton per family and layout: the module the family's loader fills, built
    empty, and the layout's key map (each layout's loader module owns its names)."""
    import torch
    from transformers import ColQwen2Config, ColQwen2ForRetrieval
    from transformers.integrations.accelerate import init_empty_weights

    from colembed.errors import ModelFolderError

    folder = Path(folder)
    name = family.family.name
    if name == "colqwen3.5":
        from ..families.qwen3_5.checkpoint import read_checkpoint as read_qwen3_5
        from ..families.qwen3_5.model import build_empty_colqwen3_5, tensor_locations

        try:
            checkpoint = read_qwen3_5(folder)
        except ExportError as e:
            raise StreamedWeightsError(str(e)) from e
        model = build_empty_colqwen3_5(checkpoint)
        return Skeleton(model, CheckpointTensors(folder, tensor_locations(checkpoint)))
    if name == "colqwen3":
        from ..families.qwen3.checkpoint import build_colqwen3, read_checkpoint

        checkpoint = read_checkpoint(folder)
        model = build_colqwen3(folder, checkpoint, empty=True)
        return Skeleton(model, CheckpointTensors(folder, checkpoint.locations()))
    if name == "colqwen2.5":
        from ..families.qwen2_5.checkpoint import (
            build_colpali_layout,
            checkpoint_layout,
            colpali_tensor_locations,
        )

        if checkpoint_layout(folder) == "colpali":
            try:
                where = colpali_tensor_locations(folder)
                model = build_colpali_layout(folder, where, empty=True)
            except ModelFolderError as e:
                raise StreamedWeightsError(f"{folder}: {e}") from e
            model.tie_weights()  # a stored head of tied embeddings is the table's second name
            return Skeleton(
                model, CheckpointTensors(folder, where), frozenset({"vlm.lm_head.weight"})
            )
    config = ColQwen2Config.from_pretrained(folder)
    with init_empty_weights(include_buffers=False):  # parameters on meta, buffers computed
        model = ColQwen2ForRetrieval._from_config(config, dtype=torch.float32)
    model.tie_weights()  # as `from_pretrained` does: a tied tensor is stored under one name
    return Skeleton(model, CheckpointTensors(folder))


def _names_by_parameter(model: Any) -> dict[int, list[str]]:
    """Every name of each parameter (tied parameters have several), by the parameter's id."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def checkpoint_names(
    model: Any, tensors: CheckpointTensors, optional: frozenset[str] = frozenset()
) -> dict[int, str]:
    """The checkpoint tensor of each parameter of `model` (by id), after checking every tensor:
    present (or named in `optional`: then left out), of the parameter's shape, of a dtype that
    widens exactly to fp32; every checkpoint tensor a parameter of the model. Raises
    StreamedWeightsError listing every offender by name."""
    problems: list[str] = []
    found: dict[int, str] = {}
    claimed: set[str] = set()
    params = {id(p): p for p in model.parameters()}
    for pid, names in _names_by_parameter(model).items():
        param = params[pid]
        present = [n for n in names if n in tensors.shard_of]
        claimed.update(present)
        if not present:
            if not optional.intersection(names):
                problems.append(f"missing {names[0]}")
            continue
        name = present[0]
        shape, dtype = tensors.describe(name)
        if shape != tuple(param.shape):
            problems.append(
                f"{name}: shape {list(shape)} in the checkpoint, {list(param.shape)} expected"
            )
        if dtype not in WIDENED_DTYPES:
            problems.append(
                f"{name}: dtype {dtype} in the checkpoint, one of {'/'.join(WIDENED_DTYPES)} expected"
            )
        found[pid] = name
    unexpected = sorted(set(tensors.shard_of) - claimed)
    problems += [f"unexpected {n} (not a tensor of the model)" for n in unexpected]
    if problems:
        shown = "; ".join(problems[:20]) + (
            f" (+{len(problems) - 20} more)" if len(problems) > 20 else ""
        )
        raise StreamedWeightsError(
            f"{tensors.folder}: refusing the checkpoint, {len(problems)} tensor(s) do not match "
            f"the model its config describes: {shown}"
        )
    return found


@dataclass(frozen=True)
class StandIn:
    """A 2-D parameter left unread: where its memory starts, its shape, element strides and the
    checkpoint tensor it stands for."""

    name: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    nbytes: int
    absent: bool = False  # an optional parameter the checkpoint does not store


class StandInModel:
    """The checkpoint's model with stand-ins for its weight matrices (module docstring), and the
    checkpoint it maps them to. `model` is what the graph wrappers are built on."""

    def __init__(self, folder: Path, family: Any = None) -> None:
        if family is None:
            from ..families import export_family
            from ..families.checkpoint import check_architecture

            family = export_family(check_architecture(Path(folder)).name)
        skeleton = checkpoint_tensors(Path(folder), family)
        self.tensors, model = skeleton.tensors, skeleton.model
        names = checkpoint_names(model, self.tensors, skeleton.optional)
        all_names = _names_by_parameter(model)
        self.standins: dict[int, StandIn] = {}  # data pointer -> stand-in
        replaced: dict[int, Any] = {}
        for module in model.modules():
            for key, param in list(module._parameters.items()):
                if param is None:
                    continue
                if id(param) not in replaced:
                    name = names.get(id(param))
                    replaced[id(param)] = self._materialise(param, name, all_names[id(param)][0])
                module._parameters[key] = replaced[id(param)]
        self.model = model.eval()

    def _materialise(self, param: Any, name: str | None, model_name: str):
        """A stand-in for a 2-D parameter or an absent optional one (`name` None: the graph must
        not read it), else the checkpoint's tensor read whole."""
        import torch

        if param.ndim == 2 or name is None:
            value = torch.empty(tuple(param.shape), dtype=torch.float32)
            # A distinct first element: fresh pages read as zeros, and the exporter's passes
            # merge initializers of equal shape and content, which would leave a stand-in
            # unread. One element touches one page, not the tensor.
            value.view(-1)[:1] = float(len(self.standins) + 1)
            self.standins[value.data_ptr()] = StandIn(
                name or model_name,
                tuple(value.shape),
                tuple(value.stride()),
                value.numel() * 4,
                absent=name is None,
            )
        else:
            value = self.tensors.read(name)
        return torch.nn.Parameter(value, requires_grad=False)

    def _standin_of(self, array: Any) -> tuple[StandIn, tuple[int, ...]] | None:
        """(stand-in, axis order) when `array` (numpy) is a stand-in or a permutation view of one;
        None when it reads no stand-in memory; StreamedWeightsError for any other view."""
        import numpy as np

        start = array.__array_interface__["data"][0]
        standin = self.standins.get(start)
        if standin is None:
            for ptr, s in self.standins.items():
                if ptr <= start < ptr + s.nbytes:
                    raise StreamedWeightsError(
                        f"the graph reads part of {s.name} (shape {list(array.shape)}); only "
                        "whole weights or their transposes can be streamed"
                    )
            return None
        element = np.dtype(array.dtype).itemsize
        strides = tuple(st // element for st in array.strides)
        order = []
        for shape, stride in zip(array.shape, strides):
            axes = [
                i
                for i, (sh, st) in enumerate(zip(standin.shape, standin.strides))
                if sh == shape and st == stride and i not in order
            ]
            if not axes:
                break
            order.append(axes[0])
        if array.dtype != np.float32 or sorted(order) != list(range(len(standin.shape))):
            raise StreamedWeightsError(
                f"the graph reads {standin.name} as a {array.dtype} array of shape "
                f"{list(array.shape)}; only the weight or its transpose can be streamed"
            )
        return standin, tuple(order)

    def _lazy(self, value: Any, standin: StandIn, order: tuple[int, ...]):
        import numpy as np
        import onnx_ir as ir

        tensors, name = self.tensors, standin.name

        def read():
            array = tensors.read(name).numpy()
            if order != tuple(range(array.ndim)):
                array = np.ascontiguousarray(np.transpose(array, order))
            return ir.tensor(array, name=value.name)

        return ir.LazyTensor(
            read,
            dtype=ir.DataType.FLOAT,
            shape=ir.Shape([standin.shape[i] for i in order]),
            name=value.name,
        )

    def stream_initializers(self, ir_model: Any, graph: Any) -> dict[str, str]:
        """Swap every initializer of the traced `ir_model` that reads a stand-in for a lazy read of
        its checkpoint tensor; returns {initializer: checkpoint tensor}. Every stand-in among
        `graph`'s (the torch module traced) parameters must be read that way (else the graph used it in a form this
        writer cannot reproduce)."""
        import torch

        streamed: dict[str, str] = {}
        for value in ir_model.graph.initializers.values():
            const = value.const_value
            raw = getattr(const, "raw", None)
            if isinstance(raw, torch.Tensor):
                raw = raw.detach().numpy()
            if raw is None or not hasattr(raw, "__array_interface__"):
                continue
            found = self._standin_of(raw)
            if found is None:
                continue
            standin, order = found
            if standin.absent:
                raise StreamedWeightsError(
                    f"the graph reads {standin.name}, which the checkpoint does not store"
                )
            value.const_value = self._lazy(value, standin, order)
            streamed[value.name] = standin.name
        used = {p.data_ptr() for p in graph.parameters()}
        unread = sorted(s.name for ptr, s in self.standins.items() if ptr in used and not s.absent)
        missing = sorted(set(unread) - set(streamed.values()))
        if missing:
            raise StreamedWeightsError(
                "the graph computes from weights it does not hold as initializers, which "
                f"cannot be streamed: {', '.join(missing)}"
            )
        return streamed


__all__ = [
    "CheckpointTensors",
    "StandInModel",
    "Skeleton",
    "StreamedWeightsError",
    "WIDENED_DTYPES",
    "checkpoint_names",
    "checkpoint_tensors",
    "streaming_applies",
]
