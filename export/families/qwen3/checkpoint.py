"""Loading a ColQwen3 checkpoint (either published layout) strictly, in fp32, in the export environment.

The export environment pins transformers 4.57.1 (ColQwen2's reference), whose own `Qwen3VLModel`
computes what colpali-engine 0.3.18's `ColQwen3` (a `Qwen3VLModel` subclass on transformers 5.x)
computes: measured on the same weights, docs/reference-colqwen3.md, `tests/export/families/qwen3/test_reference.py`.
So the exporter wraps the checkpoint's weights in 4.57.1's modules and adds the head both
published codes add (a linear projection with bias, L2 normalisation, times the mask), nothing else.

Which tensor is which comes from the layout (`layouts_qwen3`: colpali-engine's `model.*` /
`custom_text_proj`, TomoroAI's `vlm.model.*` / `embedding_proj_layer`), picked by the config's
model_type. The text rope may be 5.x's `rope_parameters` (`rope_theta`, `mrope_section`,
`mrope_interleaved`) or 4.x's `rope_scaling` + `rope_theta` (Qwen/Qwen3-VL-* configs).

Every missing, unexpected, duplicated or mis-shaped tensor is an error naming it (a partial
checkpoint would export random layers); so is a projection whose width disagrees with the
config's `embed_dim` (TomoroAI's).

Memory: the model is built without initialising its weights and each tensor is read from its file
alone and copied in (one tensor per opening: a file kept open stays mapped, a second copy in RSS),
so a load holds about one fp32 copy of the weights, as ColQwen2.5's colpali-layout loader does (a
full Qwen3-VL-4B is 17.6 GB in fp32; reading every tensor first and then copying held two).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from colembed.errors import ExportError

from .layouts import LAYOUTS, Qwen3Layout, layout_of


def normalised_config(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json with the text rope in the installed transformers' spelling (4.57.1:
    `rope_scaling` + `rope_theta`); a 5.x `rope_parameters` is translated, not guessed."""
    config = copy.deepcopy(raw)
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ExportError("config.json: a qwen3_vl config needs a text_config object")
    params = text.pop("rope_parameters", None)
    if params is not None:
        if "mrope_section" not in params or "rope_theta" not in params:
            raise ExportError(
                f"config.json: text_config.rope_parameters {params} lacks "
                "mrope_section or rope_theta"
            )
        if params.get("rope_type", "default") != "default":
            raise ExportError(f"config.json: rope_type {params['rope_type']!r} is not supported")
        text["rope_theta"] = params["rope_theta"]
        text["rope_scaling"] = {
            "rope_type": "default",
            "mrope_section": list(params["mrope_section"]),
            "mrope_interleaved": bool(params.get("mrope_interleaved", True)),
        }
    scaling = text.get("rope_scaling")
    if not isinstance(scaling, dict) or "mrope_section" not in scaling:
        raise ExportError(
            "config.json: text_config has no mrope_section (rope_scaling or rope_parameters)"
        )
    if scaling.get("mrope_interleaved") is False:
        raise ExportError(
            "config.json: Qwen3-VL's M-RoPE is interleaved; mrope_interleaved=false "
            "is not supported"
        )
    config["vision_config"] = {
        k: v for k, v in config.get("vision_config", {}).items() if k != "rope_parameters"
    }
    return config


def _retrieval_module(backbone, projection, embedding_dim: int):
    """A module shaped like transformers' `ColQwen2ForRetrieval` for the exporter's shared steps
    (`vlm.model`, `embedding_proj_layer`, `config.vlm_config`, `config.embedding_dim`), whose
    forward is colpali-engine 0.3.18 `ColQwen3.forward`: backbone -> projection -> L2 -> x mask."""
    import torch
    from torch import nn

    class ColQwen3Retrieval(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vlm = nn.Module()
            self.vlm.model = backbone
            self.embedding_proj_layer = projection
            self.config = SimpleNamespace(vlm_config=backbone.config, embedding_dim=embedding_dim)

        def forward(
            self, input_ids, attention_mask, pixel_values=None, image_grid_thw=None, **_: Any
        ):
            if pixel_values is not None and pixel_values.ndim == 3:  # processor-padded batch
                offsets = image_grid_thw[:, 1] * image_grid_thw[:, 2]
                pixel_values = torch.cat([p[:n] for p, n in zip(pixel_values, offsets)])
            hidden = self.vlm.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                pixel_values=pixel_values,
                image_grid_thw=image_grid_thw,
                use_cache=False,
                return_dict=True,
            ).last_hidden_state
            proj = self.embedding_proj_layer(hidden)
            proj = proj / proj.norm(dim=-1, keepdim=True)
            return SimpleNamespace(embeddings=proj * attention_mask.unsqueeze(-1))

    return ColQwen3Retrieval().eval()


def _set_vision_rope_theta(backbone, raw: dict[str, Any], folder: Path) -> None:
    """4.57.1 builds the vision rotary with base 10000 whatever the config says; the pinned
    reference (transformers 5.x) reads `vision_config.rope_parameters.rope_theta`, and so does the
    runtime's host-made rotary table (the manifest's `vision_rope_theta`). The tower's inverse
    frequencies are rebuilt from the same base, with 4.57.1's formula."""
    import torch

    from colembed.families import COLQWEN3

    theta = COLQWEN3.vision_rope_theta(raw.get("vision_config") or {}, str(folder / "config.json"))
    rotary = backbone.visual.rotary_pos_emb
    dim = 2 * rotary.inv_freq.numel()
    with torch.no_grad():
        rotary.inv_freq.copy_(1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)))


# config.json keys that are not Qwen3VLConfig's: the saving code's (architectures, auto_map,
# dtype), the layout's (model_type, TomoroAI's embed_dim / padding_side, read from the layout).
_NOT_BACKBONE_CONFIG = (
    "architectures",
    "auto_map",
    "dtype",
    "torch_dtype",
    "model_type",
    "transformers_version",
    "embed_dim",
    "padding_side",
)


def checkpoint_layout(config: dict[str, Any], folder: Path) -> Qwen3Layout:
    """The config's ColQwen3 layout, or ExportError naming the ones colembed reads."""
    layout = layout_of(config)
    if layout is None:
        known = ", ".join(f"{x.config_model_type!r} ({x.name})" for x in LAYOUTS)
        raise ExportError(
            f"{folder / 'config.json'}: model_type {config.get('model_type')!r} is "
            f"no ColQwen3 layout colembed reads ({known})"
        )
    return layout


def tensor_locations(folder: Path, layout: Qwen3Layout) -> tuple[dict, dict, list[str]]:
    """(backbone name -> (file, key), projection part -> (file, key), problems) over every
    safetensors file of `folder`; no tensor is read."""
    from safetensors import safe_open

    backbone: dict[str, tuple[Path, str]] = {}
    projection: dict[str, tuple[Path, str]] = {}
    unknown, doubled = [], []
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                part = layout.projection_key(key)
                name = layout.backbone_key(key) if part is None else None
                into, where = (projection, part) if part is not None else (backbone, name)
                if where is None:
                    if not layout.ignored(key):
                        unknown.append(key)
                elif where in into:
                    doubled.append(key)
                else:
                    into[where] = (path, key)
    problems = []
    if unknown:
        problems.append(
            f"{len(unknown)} tensor(s) the {layout.name} layout does not name: {unknown[:5]}"
        )
    if doubled:
        problems.append(f"{len(doubled)} tensor(s) stored twice under two names: {doubled[:5]}")
    if "weight" not in projection:
        problems.append(
            f"no projection weight ({' or '.join(p + 'weight' for p in layout.projection_prefixes)})"
        )
    return backbone, projection, problems


@dataclass(frozen=True)
class Qwen3Checkpoint:
    """A ColQwen3 checkpoint's layout, backbone config and tensor locations, no tensor read.
    `where`: `Qwen3VLModel` state-dict name -> (file, key); `projection_where`: `weight` /
    `bias` -> (file, key); `width`, `hidden`: the projection's shape."""

    raw: dict[str, Any]
    layout: Qwen3Layout
    vlm_config: Any
    where: dict[str, tuple[Path, str]]
    projection_where: dict[str, tuple[Path, str]]
    width: int
    hidden: int

    def locations(self) -> dict[str, tuple[Path, str]]:
        """Every tensor by its name in the retrieval module (`vlm.model.*`,
        `embedding_proj_layer.*`)."""
        return {
            **{f"vlm.model.{name}": at for name, at in self.where.items()},
            **{f"embedding_proj_layer.{part}": at for part, at in self.projection_where.items()},
        }


def _shape(location: tuple[Path, str]) -> tuple[int, ...]:
    from safetensors import safe_open

    with safe_open(str(location[0]), "pt") as f:
        return tuple(f.get_slice(location[1]).get_shape())


def read_checkpoint(folder: Path) -> Qwen3Checkpoint:
    """The layout, config and tensor locations of `folder`; ExportError for an unknown layout,
    an unnamed or doubled tensor, no projection, or a width the config contradicts."""
    from transformers import Qwen3VLConfig

    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    layout = checkpoint_layout(raw, folder)
    config = normalised_config(raw)
    where, projection_where, problems = tensor_locations(folder, layout)
    if problems:
        raise ExportError(f"{folder}: not a {layout.name} checkpoint: " + "; ".join(problems))
    width, hidden = _shape(projection_where["weight"])
    if layout.dim_key is not None and raw.get(layout.dim_key) != width:
        raise ExportError(
            f"{folder / 'config.json'}: {layout.dim_key} {raw.get(layout.dim_key)!r} "
            f"disagrees with the projection's {width} rows"
        )
    vlm_config = Qwen3VLConfig(**{k: v for k, v in config.items() if k not in _NOT_BACKBONE_CONFIG})
    return Qwen3Checkpoint(raw, layout, vlm_config, where, projection_where, width, hidden)


def build_colqwen3(folder: Path, checkpoint: Qwen3Checkpoint, *, empty: bool):
    """The retrieval module of `checkpoint`, fp32, its weights not initialised; with `empty`
    its parameters are on the meta device (no memory: the streamed export's stand-in), else
    allocated for the loader to fill. Buffers are computed either way, the vision rotary's
    from the config's theta."""
    import contextlib

    import torch
    from transformers import Qwen3VLModel
    from transformers.integrations.accelerate import init_empty_weights
    from transformers.modeling_utils import no_init_weights

    context = init_empty_weights(include_buffers=False) if empty else contextlib.nullcontext()
    with context, no_init_weights():  # every tensor is overwritten or refused as missing
        backbone = Qwen3VLModel(checkpoint.vlm_config).to(torch.float32)
        projection = torch.nn.Linear(
            checkpoint.hidden, checkpoint.width, bias="bias" in checkpoint.projection_where
        )
    _set_vision_rope_theta(backbone, checkpoint.raw, folder)
    return _retrieval_module(backbone.eval(), projection.eval(), checkpoint.width)


def load_colqwen3(folder: Path):
    """The checkpoint as a strict fp32 retrieval module (4.57.1's Qwen3VLModel + the projection),
    loaded tensor by tensor (module docstring)."""
    import torch
    from safetensors import safe_open

    folder = Path(folder)
    checkpoint = read_checkpoint(folder)
    where = checkpoint.where

    def read(location: tuple[Path, str]):
        with safe_open(str(location[0]), "pt") as f:  # one tensor per opening (docstring)
            return f.get_tensor(location[1])

    module = build_colqwen3(folder, checkpoint, empty=False)
    backbone, projection = module.vlm.model, module.embedding_proj_layer
    params = backbone.state_dict()  # shares storage with the parameters
    missing = sorted(k for k in params if k not in where)
    unexpected = sorted(k for k in where if k not in params)
    misfit = [
        f"{where[k][1]} {_shape(where[k])}, expected {tuple(params[k].shape)}"
        for k in where
        if k in params and _shape(where[k]) != tuple(params[k].shape)
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {missing[:10]}")
    if unexpected:
        problems.append(
            f"{len(unexpected)} unexpected tensor(s): {[where[k][1] for k in unexpected[:10]]}"
        )
    if misfit:
        problems.append(f"{len(misfit)} mis-shaped tensor(s): {misfit[:5]}")
    if problems:
        raise ExportError(
            f"{folder}: refusing a partial checkpoint, it would export random "
            "layers: " + "; ".join(problems)
        )
    with torch.no_grad():
        for name, location in where.items():
            tensor = read(location)
            params[name].copy_(tensor)
            del tensor
        for part, location in checkpoint.projection_where.items():
            getattr(projection, part).copy_(read(location))
    return module


__all__ = [
    "Qwen3Checkpoint",
    "build_colqwen3",
    "checkpoint_layout",
    "load_colqwen3",
    "normalised_config",
    "read_checkpoint",
    "tensor_locations",
]
