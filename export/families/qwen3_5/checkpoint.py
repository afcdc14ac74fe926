"""Reading a ColQwen3.5 checkpoint as the pinned reference saves it, in the export environment.

colpali-engine 0.3.18's `ColQwen3_5` is a `Qwen3_5Model` subclass plus `custom_text_proj`; its
`save_pretrained` (transformers 5.x) writes a bare `qwen3_5` config.json (`architectures:
["ColQwen3_5"]`, the projection width as `dim`, default 128) and the weights under the model's own
names, with no `model.` prefix: `visual.*`, `language_model.*`, `custom_text_proj.*`
(`QWEN3_5_COLPALI`, declared data). A Qwen3.5 release's multi-token-prediction head (`mtp.*`) is
ignored, as the reference's loader ignores it; any other tensor the layout does not name is an
error, and so is a missing, duplicated or mis-shaped one (a partial checkpoint would export random
layers).

The export environment's transformers (4.57.1) has no Qwen3.5. Its vision tower is Qwen3-VL's
without DeepStack (transformers 5.24 `Qwen3_5VisionModel`: the same patch embedding, learned
position table, blocks and exact-GELU merger, no `deepstack_merger_list`), so it is loaded onto
4.57.1's `Qwen3VLVisionModel` with an empty `deepstack_visual_indexes` and the vision rotary
base of the config (5.x reads `vision_config.rope_parameters`; 4.57.1 fixes 10000), measured
against 5.24's tower in `tests/export/families/qwen3_5/test_vision.py`.

Each tensor is read from its file alone and copied in (one tensor per opening, as
`families/qwen3/checkpoint.py` does), so a load holds about one fp32 copy of the weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from colembed.errors import ExportError


@dataclass(frozen=True)
class Qwen3_5Layout:
    """One on-disk ColQwen3.5 layout: which key prefix holds which part.

    `parts`: (on-disk prefix, part) pairs, part one of `visual`, `language_model`, `projection`;
    a tensor's name within its part is the key after the prefix. `ignored_prefixes`: tensors that
    no embedding reads and the reference's loader skips."""

    name: str
    config_model_type: str
    parts: tuple[tuple[str, str], ...]
    ignored_prefixes: tuple[str, ...] = ()
    dim_key: str = "dim"  # the config key of the projection's width
    default_dim: int = 128  # colpali-engine's `getattr(config, "dim", 128)`

    def part_of(self, key: str) -> tuple[str, str] | None:
        """(part, name within the part) of an on-disk key; None if the layout does not name it."""
        return next(
            ((part, key[len(prefix) :]) for prefix, part in self.parts if key.startswith(prefix)),
            None,
        )

    def ignored(self, key: str) -> bool:
        return bool(self.ignored_prefixes) and key.startswith(self.ignored_prefixes)


QWEN3_5_COLPALI = Qwen3_5Layout(
    name="colpali-engine ColQwen3_5",
    config_model_type="qwen3_5",
    parts=(
        ("visual.", "visual"),
        ("language_model.", "language_model"),
        ("custom_text_proj.", "projection"),
    ),
    ignored_prefixes=("mtp.",),
)
LAYOUTS = (QWEN3_5_COLPALI,)
PARTS = ("visual", "language_model", "projection")


def layout_of(config: Mapping[str, Any]) -> Qwen3_5Layout | None:
    return next((x for x in LAYOUTS if config.get("model_type") == x.config_model_type), None)


@dataclass(frozen=True)
class Qwen3_5Checkpoint:
    """A ColQwen3.5 folder's config and where each tensor is; no tensor read yet."""

    folder: Path
    config: dict[str, Any]
    layout: Qwen3_5Layout
    tensors: dict[str, dict[str, tuple[Path, str]]]  # part -> name -> (file, on-disk key)

    @property
    def text_config(self) -> dict[str, Any]:
        return self.config["text_config"]

    @property
    def vision_config(self) -> dict[str, Any]:
        return self.config["vision_config"]

    @property
    def embedding_dim(self) -> int:
        return int(self.config.get(self.layout.dim_key, self.layout.default_dim))

    def shape(self, part: str, name: str) -> tuple[int, ...]:
        from safetensors import safe_open

        path, key = self.tensors[part][name]
        with safe_open(str(path), "pt") as f:
            return tuple(f.get_slice(key).get_shape())

    def read(self, part: str, name: str):
        """One tensor, read from its file alone (module docstring)."""
        from safetensors import safe_open

        path, key = self.tensors[part][name]
        with safe_open(str(path), "pt") as f:
            return f.get_tensor(key)

    def state_dict(self, part: str) -> dict[str, Any]:
        """Every tensor of `part` under its name within the part (reads them all)."""
        return {name: self.read(part, name) for name in self.tensors[part]}

    def load_into(self, module, part: str) -> None:
        """Copy `part`'s tensors into `module`'s parameters and buffers of the same names,
        refusing a missing, unexpected or mis-shaped tensor (ExportError naming them)."""
        import torch

        params = module.state_dict()  # shares storage with the parameters
        found = self.tensors[part]
        missing = sorted(k for k in params if k not in found)
        unexpected = sorted(found[k][1] for k in found if k not in params)
        misfit = [
            f"{found[k][1]} {self.shape(part, k)}, expected {tuple(params[k].shape)}"
            for k in found
            if k in params and self.shape(part, k) != tuple(params[k].shape)
        ]
        problems = []
        if missing:
            problems.append(f"{len(missing)} missing {part} tensor(s): {missing[:10]}")
        if unexpected:
            problems.append(f"{len(unexpected)} unexpected {part} tensor(s): {unexpected[:10]}")
        if misfit:
            problems.append(f"{len(misfit)} mis-shaped tensor(s): {misfit[:5]}")
        if problems:
            raise ExportError(
                f"{self.folder}: refusing a partial checkpoint, it would export random "
                "layers: " + "; ".join(problems)
            )
        with torch.no_grad():
            for name in found:
                tensor = self.read(part, name)
                params[name].copy_(tensor)
                del tensor


def read_checkpoint(folder: str | Path) -> Qwen3_5Checkpoint:
    """The folder's config and tensor locations, or ExportError naming what does not fit."""
    from safetensors import safe_open

    folder = Path(folder)
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ExportError(f"{path}: unreadable ({e})") from e
    layout = layout_of(config)
    if layout is None:
        raise ExportError(
            f"{path}: model_type {config.get('model_type')!r} is no ColQwen3.5 layout colembed "
            f"reads ({', '.join(repr(x.config_model_type) for x in LAYOUTS)})"
        )
    for key in ("text_config", "vision_config"):
        if not isinstance(config.get(key), dict):
            raise ExportError(f"{path}: a {layout.config_model_type} config needs a {key} object")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ExportError(f"{folder}: no *.safetensors weights")
    tensors: dict[str, dict[str, tuple[Path, str]]] = {part: {} for part in PARTS}
    unknown, doubled = [], []
    for file in files:
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                found = layout.part_of(key)
                if found is None:
                    if not layout.ignored(key):
                        unknown.append(key)
                elif found[1] in tensors[found[0]]:
                    doubled.append(key)
                else:
                    tensors[found[0]][found[1]] = (file, key)
    problems = []
    if unknown:
        problems.append(
            f"{len(unknown)} tensor(s) the {layout.name} layout does not name "
            f"(keys start with {[p for p, _ in layout.parts]}): {unknown[:5]}"
        )
    if doubled:
        problems.append(f"{len(doubled)} tensor(s) stored twice: {doubled[:5]}")
    if "weight" not in tensors["projection"]:
        problems.append("no projection weight (custom_text_proj.weight)")
    if problems:
        raise ExportError(f"{folder}: not a {layout.name} checkpoint: " + "; ".join(problems))
    checkpoint = Qwen3_5Checkpoint(folder=folder, config=config, layout=layout, tensors=tensors)
    width = checkpoint.shape("projection", "weight")[0]
    if width != checkpoint.embedding_dim:
        raise ExportError(
            f"{path}: {layout.dim_key} {config.get(layout.dim_key, layout.default_dim)!r} "
            f"disagrees with the projection's {width} rows"
        )
    return checkpoint


# Qwen3VLVisionConfig's fields that a Qwen3.5 vision config states (the rest are transformers
# 5.x's bookkeeping: model_type, dtype, rope_parameters, which `load_vision_tower` reads itself).
_VISION_FIELDS = (
    "depth",
    "hidden_size",
    "hidden_act",
    "intermediate_size",
    "num_heads",
    "in_channels",
    "patch_size",
    "spatial_merge_size",
    "temporal_patch_size",
    "out_hidden_size",
    "num_position_embeddings",
    "initializer_range",
)


def vision_tower_config(checkpoint: Qwen3_5Checkpoint):
    """4.57.1's `Qwen3VLVisionConfig` for the checkpoint's tower: its own numbers, no DeepStack."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

    from colembed.families import COLQWEN3_5

    vision = checkpoint.vision_config
    where = str(checkpoint.folder / "config.json")
    COLQWEN3_5.extras(vision, where)  # refuses DeepStack layers and a non-square position table
    if vision.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ExportError(
            f"{where}: vision_config.hidden_act {vision['hidden_act']!r}; Qwen3.5's tower "
            "uses gelu_pytorch_tanh"
        )
    fields = {k: vision[k] for k in _VISION_FIELDS if k in vision}
    return Qwen3VLVisionConfig(**fields, deepstack_visual_indexes=[])


def build_vision_tower(checkpoint: Qwen3_5Checkpoint, *, empty: bool = False):
    """The checkpoint's vision tower as 4.57.1's `Qwen3VLVisionModel` (no DeepStack), fp32, eval,
    with the config's vision rotary base and its weights not initialised: with `empty` its
    parameters are on the meta device (no memory: the streamed export's stand-in), else allocated
    for `load_vision_tower` to fill. The rotary table (a buffer) is computed either way."""
    import contextlib

    import torch
    from transformers.integrations.accelerate import init_empty_weights
    from transformers.modeling_utils import no_init_weights
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    from colembed.families import COLQWEN3_5

    config = vision_tower_config(checkpoint)
    theta = COLQWEN3_5.vision_rope_theta(
        checkpoint.vision_config, str(checkpoint.folder / "config.json")
    )
    context = init_empty_weights(include_buffers=False) if empty else contextlib.nullcontext()
    with context, no_init_weights():  # every tensor is overwritten or refused as missing
        tower = Qwen3VLVisionModel(config).to(torch.float32)
    rotary = tower.rotary_pos_emb
    dim = 2 * rotary.inv_freq.numel()
    with torch.no_grad():  # 4.57.1's formula with the config's base (5.x's is the same)
        rotary.inv_freq.copy_(1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)))
    return tower.eval()


def load_vision_tower(checkpoint: Qwen3_5Checkpoint):
    """`build_vision_tower` with every `visual` tensor of the checkpoint copied in."""
    tower = build_vision_tower(checkpoint)
    checkpoint.load_into(tower, "visual")
    return tower


def load_projection(checkpoint: Qwen3_5Checkpoint):
    """colpali-engine's `custom_text_proj`: Linear(text hidden, dim), with its bias."""
    import torch

    width, hidden = checkpoint.shape("projection", "weight")
    projection = torch.nn.Linear(hidden, width, bias="bias" in checkpoint.tensors["projection"])
    checkpoint.load_into(projection, "projection")
    return projection.eval()


__all__ = [
    "LAYOUTS",
    "QWEN3_5_COLPALI",
    "Qwen3_5Checkpoint",
    "Qwen3_5Layout",
    "build_vision_tower",
    "layout_of",
    "load_projection",
    "load_vision_tower",
    "read_checkpoint",
    "vision_tower_config",
]
