"""The model families colembed serves, declared as data: what differs between ColQwen2 and 2.5.

Both families share everything on the host and in the text graph (prompts, tokens, pixels,
positions, rotary tables, feature placement, scorer; docs/reference-colqwen2_5.md). They differ in
how a checkpoint names its vision numbers, in the image graph's attention and in the extra per-grid
inputs that attention needs. Each difference is one field of a frozen `Family`, read by
the exporter's checkpoint reader (`colembed_export.families.preprocess_config`: which width to read), by the manifest (the folder names its
family and its `VisionAttention`), by the runtime (which contract to check, which host inputs to
make per grid) and by the exporter (`colembed_export.families` adds the torch side).

| declared            | colqwen2                  | colqwen2.5                                   |
|---------------------|---------------------------|----------------------------------------------|
| backbone model_type | qwen2_vl                  | qwen2_5_vl                                   |
| checkpoint layouts  | colqwen2/qwen2_vl         | colqwen2/qwen2_5_vl; qwen2_5_vl (colpali)    |
| vision width        | embed_dim                 | hidden_size                                  |
| merger output, MLP  | hidden_size, mlp_ratio    | out_hidden_size, intermediate_size           |
| vision attention    | full                      | windowed (`window_size` px, from the config) |
| extra grid inputs   | none                      | `window_layout(grid, ...).graph_inputs()`    |
| transparency key    | dropped                   | dropped (ColQwen3: composited onto white)    |

ColQwen3 (Qwen3-VL, docs/reference-colqwen3.md) adds two declared traits, carried by a folder's
`VisionExtras` (manifest `vision_extras`, numbers from the checkpoint): the tower's learned position
table interpolated per grid (host-made indices and weights, `preprocess.vision_positions`, two more
image-graph inputs) and DeepStack (the image graph also returns `deepstack_layers` merged features
that the text graph adds to its first layers at image-token positions: one more output and one
more input). Its query prefix default is "" (colpali-engine's ColQwen3Processor), ColQwen2's
"Query: ". Two checkpoint layouts: colpali-engine's bare `qwen3_vl` config and TomoroAI's
`colqwen3` one (which names no backbone of its own, so `family_of_backbone` reads the declared
layouts first); what differs between them is the exporter's `layouts_qwen3`.

ColQwen3.5 (Qwen3.5, docs/reference-colqwen3_5.md) has Qwen3-VL's tower without DeepStack:
`vision_extras` with `deepstack` false (manifest `deepstack_layers` 0, so neither the DeepStack
output nor its text input exists), colpali-engine's bare `qwen3_5` layout, and its processor's own
query augmentation token (`query_augmentation_token`).

Torch-free: the standard library and colembed's contracts and errors at import (the registry reads
family names); numpy through `preprocess.windows` / `preprocess.vision_positions` only when a
family's extra graph inputs are declared or made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from .contracts import GraphContract, TensorSpec, text_contract, vision_contract
from .errors import ColembedError, ManifestError, ModelFolderError

if TYPE_CHECKING:
    import numpy as np

FULL = "full"
WINDOWED = "windowed"
ATTENTION_KINDS = (FULL, WINDOWED)
# The vision rotary base of every Qwen-VL tower as transformers 4.57.1 builds it.
VISION_ROPE_THETA = 10000.0


def _extra_inputs(kind: str) -> tuple[TensorSpec, ...]:
    """The image graph's inputs beyond Qwen2-VL's (pixels, rotary tables), per attention kind.
    (Imported here, not at the top: the registry reads family names without numpy.)"""
    if kind == FULL:
        return ()
    from .preprocess.windows import WINDOW_INPUTS

    return WINDOW_INPUTS


def _extras_contracts(extras: "VisionExtras | None", text_hidden: int):
    """(vision inputs, vision outputs, text inputs) that a folder's `VisionExtras` adds."""
    if extras is None:
        return (), (), ()
    from .preprocess.vision_positions import POSITION_INPUTS

    layers = extras.deepstack_layers
    if not layers:  # a tower without DeepStack (Qwen3.5): positions only
        return POSITION_INPUTS, (), ()
    return (
        POSITION_INPUTS,
        (
            TensorSpec(
                "deepstack_features", "float32", ("images", layers, "merged_tokens", text_hidden)
            ),
        ),
        (TensorSpec("deepstack_features", "float32", (layers, "image_rows", text_hidden)),),
    )


@dataclass(frozen=True)
class VisionExtras:
    """What Qwen3-VL's tower adds to Qwen2-VL's (manifest `vision_extras`): a learned position
    table of `position_grid_side`**2 entries, bilinearly interpolated to each grid, and
    `deepstack_layers` DeepStack features added to the first language layers (0: none, Qwen3.5's
    tower, whose graphs then have no DeepStack output or input)."""

    position_grid_side: int
    deepstack_layers: int

    def __post_init__(self) -> None:
        for name, least in (("position_grid_side", 1), ("deepstack_layers", 0)):
            value = getattr(self, name)
            if type(value) is not int or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r:.40}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "position_grid_side": self.position_grid_side,
            "deepstack_layers": self.deepstack_layers,
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "vision_extras") -> VisionExtras:
        if not isinstance(d, dict):
            raise ManifestError(f"{where}: expected a JSON object, got {type(d).__name__}")
        keys = {"position_grid_side", "deepstack_layers"}
        if set(d) != keys:
            raise ManifestError(f"{where}: expected keys {sorted(keys)}, got {sorted(d)}")
        try:
            return cls(**d)
        except ValueError as e:
            raise ManifestError(f"{where}: {e}") from None

    def grid_inputs(self, grid: tuple[int, int, int], *, merge_size: int) -> tuple[np.ndarray, ...]:
        """The position-table inputs for one grid (index, weight), in contract order."""
        from .preprocess.vision_positions import interpolated_positions

        return interpolated_positions(
            grid, merge_size=merge_size, grid_side=self.position_grid_side
        )


class UnknownFamilyError(ColembedError, ValueError):
    """A family name or checkpoint backbone colembed does not declare."""


@dataclass(frozen=True)
class VisionAttention:
    """How the image graph attends: `full` (within an image) or `windowed` (within windows of
    `window_size` pixels a side, except the full-attention blocks baked into the graph)."""

    kind: str
    window_size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ATTENTION_KINDS:
            raise ValueError(f"kind {self.kind!r} is not one of {list(ATTENTION_KINDS)}")
        if self.kind == WINDOWED and not (type(self.window_size) is int and self.window_size > 0):
            raise ValueError(
                f"windowed attention needs a positive int window_size, got {self.window_size!r}"
            )
        if self.kind == FULL and self.window_size is not None:
            raise ValueError("full attention has no window_size")

    @property
    def extra_inputs(self) -> tuple[TensorSpec, ...]:
        """The image graph's inputs beyond pixels and rotary tables, in contract order."""
        return _extra_inputs(self.kind)

    def grid_inputs(
        self, grid: tuple[int, int, int], *, merge_size: int, patch_size: int
    ) -> tuple[np.ndarray, ...]:
        """The extra inputs for one image grid (same-grid images share them), in contract order."""
        if self.kind == FULL:
            return ()
        from .preprocess.windows import window_layout

        layout = window_layout(
            grid, merge_size=merge_size, patch_size=patch_size, window_size=self.window_size
        )  # type: ignore[arg-type]
        made = layout.graph_inputs()
        return tuple(made[spec.name] for spec in self.extra_inputs)

    def to_dict(self) -> dict[str, Any]:
        return (
            {"kind": self.kind}
            if self.kind == FULL
            else {"kind": self.kind, "window_size": self.window_size}
        )

    @classmethod
    def from_dict(cls, d: Any, where: str = "vision_attention") -> VisionAttention:
        """Strict: an object with a known `kind`, `window_size` exactly when windowed."""
        if not isinstance(d, dict):
            raise ManifestError(f"{where}: expected a JSON object, got {type(d).__name__}")
        unknown = sorted(set(d) - {"kind", "window_size"})
        if unknown:
            raise ManifestError(f"{where}: unknown keys {unknown}")
        if not isinstance(d.get("kind"), str):
            raise ManifestError(
                f"{where}.kind: expected one of {list(ATTENTION_KINDS)}, got {d.get('kind')!r:.40}"
            )
        try:
            return cls(kind=d["kind"], window_size=d.get("window_size"))
        except ValueError as e:
            raise ManifestError(f"{where}: {e}") from None


@dataclass(frozen=True)
class VisionConfigNames:
    """What a family's `vision_config` calls its numbers (Qwen2-VL's `hidden_size` is the merger's
    output, Qwen2.5-VL's the tower's width: never read one for the other)."""

    width: str
    merger_out: str
    mlp: str
    mlp_is_ratio: bool  # Qwen2-VL stores a ratio of the width, Qwen2.5-VL the gated MLP's width
    heads: str = "num_heads"
    depth: str = "depth"


@dataclass(frozen=True)
class Family:
    """One model family: everything colembed's torch-free half declares about it."""

    name: str
    display_name: str  # in messages
    backbone: str  # the Qwen-VL config's model_type
    checkpoint_layouts: tuple[tuple[str, str | None], ...]  # (config model_type, vlm_config's)
    vision_names: VisionConfigNames
    attention_kind: str
    default_query_prefix: str = "Query: "  # when processor_config.json gives none
    vision_extras: bool = False  # Qwen3-VL, Qwen3.5: learned positions (`VisionExtras`)
    # Whether the tower has DeepStack mergers (Qwen3-VL: `deepstack_visual_indexes` non-empty);
    # Qwen3.5's tower is Qwen3-VL's without them (the config's list empty or absent).
    deepstack: bool = False
    # The query augmentation token when the family's processor declares its own (colpali-engine's
    # ColQwen3_5Processor: a class constant); None: the tokenizer's pad token, ColQwen2Processor's.
    query_augmentation_token: str | None = None
    # Whether the family's pinned reference reads the vision rotary base from the config
    # (transformers 5.x: `vision_config.rope_parameters`); 4.57.1's towers fix it at 10000.
    vision_rope_from_config: bool = False
    # How its pinned reference makes a decoded page RGB (preprocess/images.py TRANSPARENCY_RULES):
    # "dropped" (transformers 4.57.1: `convert("RGB")`) or "on white" (transformers 5.x
    # composites a page still carrying a transparency key onto white).
    transparency: str = "dropped"
    # The longest sequence the family's text graph computes exactly; None: no bound of its own.
    # Qwen3.5's Gated DeltaNet scan covers 64 x 4 x 2**6 tokens as exported (equal to
    # colembed_export.families.qwen3_5.delta_net.max_tokens(), held equal by a test); the runtime
    # refuses a page budget or a page whose prompt is longer, rather than return wrong vectors.
    max_text_tokens: int | None = None

    def _vision_value(self, vision_config: Mapping[str, Any], key: str, source: str) -> int:
        value = vision_config.get(key)
        if type(value) is not int or value < 1:
            raise ModelFolderError(
                f"vision_config.{key} must be a positive int for a {self.name} "
                f"checkpoint, got {value!r:.40}",
                path=source,
            )
        return value

    def vision_head_dim(self, vision_config: Mapping[str, Any], source: str = "config.json") -> int:
        width = self._vision_value(vision_config, self.vision_names.width, source)
        heads = self._vision_value(vision_config, self.vision_names.heads, source)
        if width % heads:
            raise ModelFolderError(
                f"vision_config.{self.vision_names.width} {width} does not divide by {heads} heads",
                path=source,
            )
        return width // heads

    def vision_rope_theta(
        self, vision_config: Mapping[str, Any], source: str = "config.json"
    ) -> float:
        """The vision tower's rotary base. transformers 5.x writes it as
        `vision_config.rope_parameters` (`rope_type` "axial", `rope_theta`). A family whose pinned
        reference reads it uses it; one whose reference fixes the base at
        `VISION_ROPE_THETA` refuses any other value instead of exporting a model that is not
        the one the checkpoint was trained as."""
        params = vision_config.get("rope_parameters")
        if params is None:
            params = (
                {"rope_theta": vision_config["rope_theta"]} if "rope_theta" in vision_config else {}
            )
        if not isinstance(params, Mapping):
            raise ModelFolderError(
                f"vision_config.rope_parameters must be an object, got {params!r:.40}", path=source
            )
        kind = params.get("rope_type", "axial")
        if kind not in ("axial", "default"):
            raise ModelFolderError(
                f"vision_config.rope_parameters.rope_type {kind!r} is not "
                "supported (the vision towers' rotary is axial)",
                path=source,
            )
        theta = params.get("rope_theta", VISION_ROPE_THETA)
        if (
            isinstance(theta, bool)
            or not isinstance(theta, (int, float))
            or not math.isfinite(theta)
            or theta <= 1
        ):
            raise ModelFolderError(
                "vision_config.rope_parameters.rope_theta must be a number "
                f"above 1, got {theta!r:.40}",
                path=source,
            )
        if not self.vision_rope_from_config and float(theta) != VISION_ROPE_THETA:
            raise ModelFolderError(
                f"vision_config.rope_parameters.rope_theta is {theta}, but {self.display_name}'s "
                f"pinned reference fixes the vision rotary base at {VISION_ROPE_THETA:g}; "
                "refusing to export a tower that differs from it",
                path=source,
            )
        return float(theta)

    def vision_numbers(
        self, vision_config: Mapping[str, Any], source: str = "config.json"
    ) -> dict[str, Any]:
        """The manifest's vision architecture numbers (`vision_*`), by this family's names."""
        names = self.vision_names
        width = self._vision_value(vision_config, names.width, source)
        mlp = vision_config.get(names.mlp)
        if names.mlp_is_ratio:
            if isinstance(mlp, bool) or not isinstance(mlp, (int, float)) or not mlp > 0:
                raise ModelFolderError(
                    f"vision_config.{names.mlp} must be a positive number, got {mlp!r:.40}",
                    path=source,
                )
            ratio = float(mlp)
        else:
            ratio = self._vision_value(vision_config, names.mlp, source) / width
        return {
            "vision_depth": self._vision_value(vision_config, names.depth, source),
            "vision_embed_dim": width,
            "vision_heads": self._vision_value(vision_config, names.heads, source),
            "vision_mlp_ratio": ratio,
        }

    def merger_width(self, vision_config: Mapping[str, Any], source: str = "config.json") -> int:
        """The width of the tower's merged features (must be the language model's hidden size)."""
        return self._vision_value(vision_config, self.vision_names.merger_out, source)

    def vision_attention(
        self, vision_config: Mapping[str, Any], source: str = "config.json"
    ) -> VisionAttention:
        """The attention this family's tower runs, from the checkpoint's vision config."""
        if self.attention_kind == FULL:
            return VisionAttention(FULL)
        return VisionAttention(WINDOWED, self._vision_value(vision_config, "window_size", source))

    def extras(
        self, vision_config: Mapping[str, Any], source: str = "config.json"
    ) -> VisionExtras | None:
        """The folder's `VisionExtras` from the checkpoint's vision config (None if the family
        has none): the position table's side and the number of DeepStack layers."""
        if not self.vision_extras:
            return None
        entries = self._vision_value(vision_config, "num_position_embeddings", source)
        side = int(round(entries**0.5))
        if side * side != entries:
            raise ModelFolderError(
                f"vision_config.num_position_embeddings {entries} is not a square", path=source
            )
        layers = vision_config.get("deepstack_visual_indexes", None if self.deepstack else [])
        if not isinstance(layers, list) or bool(layers) != self.deepstack:
            raise ModelFolderError(
                f"vision_config.deepstack_visual_indexes must be a "
                f"{'non-empty list' if self.deepstack else 'empty list (or absent)'} for a "
                f"{self.name} checkpoint, got {layers!r:.40}",
                path=source,
            )
        return VisionExtras(position_grid_side=side, deepstack_layers=len(layers))

    def contracts(
        self,
        *,
        patch_dim: int,
        vision_head_dim: int,
        text_hidden: int,
        embedding_dim: int,
        extras: VisionExtras | None = None,
    ) -> dict[str, GraphContract]:
        """The family's two graphs by role: the exporter writes these, the runtime checks a
        folder's manifest against them."""
        if (extras is not None) != self.vision_extras:
            raise ValueError(
                f"{self.name} {'needs' if self.vision_extras else 'has no'} vision extras"
            )
        vision_in, vision_out, text_in = _extras_contracts(extras, text_hidden)
        base = vision_contract(patch_dim, vision_head_dim, text_hidden)
        vision = GraphContract(
            role=base.role,
            outputs=base.outputs + vision_out,
            inputs=base.inputs + _extra_inputs(self.attention_kind) + vision_in,
        )
        text = text_contract(text_hidden, embedding_dim)
        text = GraphContract(role=text.role, inputs=text.inputs + text_in, outputs=text.outputs)
        return {"vision": vision, "text": text}


COLQWEN2 = Family(
    name="colqwen2",
    display_name="ColQwen2",
    backbone="qwen2_vl",
    checkpoint_layouts=(("colqwen2", "qwen2_vl"),),
    vision_names=VisionConfigNames(
        width="embed_dim", merger_out="hidden_size", mlp="mlp_ratio", mlp_is_ratio=True
    ),
    attention_kind=FULL,
)
# Qwen2.5-VL's names, which Qwen3-VL kept: `hidden_size` the tower's width, the gated MLP's width.
QWEN2_5_VL_VISION_NAMES = VisionConfigNames(
    width="hidden_size", merger_out="out_hidden_size", mlp="intermediate_size", mlp_is_ratio=False
)
COLQWEN2_5 = Family(
    name="colqwen2.5",
    display_name="ColQwen2.5",
    backbone="qwen2_5_vl",
    # transformers' retrieval layout, and colpali-engine's published one (a bare qwen2_5_vl config)
    checkpoint_layouts=(("colqwen2", "qwen2_5_vl"), ("qwen2_5_vl", None)),
    vision_names=QWEN2_5_VL_VISION_NAMES,
    attention_kind=WINDOWED,
)
COLQWEN3 = Family(
    name="colqwen3",
    display_name="ColQwen3",
    backbone="qwen3_vl",
    # colpali-engine 0.3.18's layout: a bare qwen3_vl config (`architectures: ["ColQwen3"]`);
    # TomoroAI's remote code: a `colqwen3` config, a Qwen3VLConfig subclass (not nested)
    checkpoint_layouts=(("qwen3_vl", None), ("colqwen3", None)),
    vision_names=QWEN2_5_VL_VISION_NAMES,
    attention_kind=FULL,
    default_query_prefix="",  # colpali-engine >= 0.3.13 `BaseVisualRetrieverProcessor.query_prefix`
    vision_extras=True,
    deepstack=True,
    vision_rope_from_config=True,  # colpali-engine 0.3.18 on transformers 5.x
    transparency="on white",  # its reference runs on transformers 5.x (docs/reference-colqwen3.md)
)
COLQWEN3_5 = Family(
    name="colqwen3.5",
    display_name="ColQwen3.5",
    backbone="qwen3_5",
    # colpali-engine 0.3.18's layout: a bare qwen3_5 config (`architectures: ["ColQwen3_5"]`)
    checkpoint_layouts=(("qwen3_5", None),),
    vision_names=QWEN2_5_VL_VISION_NAMES,
    attention_kind=FULL,
    default_query_prefix="",  # colpali-engine's BaseVisualRetrieverProcessor.query_prefix
    vision_extras=True,  # Qwen3-VL's learned position table, no DeepStack
    vision_rope_from_config=True,  # transformers 5.x reads vision_config.rope_parameters
    transparency="on white",  # its reference runs on transformers 5.x
    query_augmentation_token="<|endoftext|>",  # ColQwen3_5Processor.query_augmentation_token
    max_text_tokens=16_384,
)
FAMILIES: Mapping[str, Family] = {f.name: f for f in (COLQWEN2, COLQWEN2_5, COLQWEN3, COLQWEN3_5)}
# What a manifest that names no family holds: every folder the first release (format 1 without
# `family`) wrote, since its exporter refused every backbone but Qwen2-VL.
LEGACY_FAMILY = COLQWEN2


def get_family(name: str) -> Family:
    """The family called `name`; UnknownFamilyError listing the known ones."""
    if name not in FAMILIES:
        raise UnknownFamilyError(
            f"unknown model family {name!r}; colembed serves {sorted(FAMILIES)}"
        )
    return FAMILIES[name]


def checkpoint_model_types(config: Mapping[str, Any]) -> tuple[Any, Any]:
    """(config model_type, vlm_config model_type or None) of a checkpoint's config.json."""
    nested = config.get("vlm_config")
    return config.get("model_type"), nested.get("model_type") if isinstance(nested, dict) else None


def family_of_backbone(config: Mapping[str, Any], source: str = "config.json") -> Family:
    """The family of a checkpoint (or bare Qwen-VL) config, by its backbone's model_type: the
    nested `vlm_config` when there is one, else the config itself; a checkpoint layout a family
    declares whose config names no backbone (TomoroAI's `colqwen3`) is that family's. Never
    guessed."""
    declared = family_of_checkpoint(config)
    if declared is not None:
        return declared
    top, nested = checkpoint_model_types(config)
    backbone = nested if nested is not None else top
    for family in FAMILIES.values():
        if family.backbone == backbone:
            return family
    raise ModelFolderError(
        f"backbone model_type {backbone!r} is none of colembed's families "
        f"({ {f.backbone: f.name for f in FAMILIES.values()} })",
        path=source,
    )


def family_of_checkpoint(config: Mapping[str, Any]) -> Family | None:
    """The family whose declared checkpoint layouts include this config's, or None."""
    layout = checkpoint_model_types(config)
    return next((f for f in FAMILIES.values() if layout in f.checkpoint_layouts), None)


__all__ = [
    "COLQWEN2",
    "COLQWEN2_5",
    "COLQWEN3",
    "COLQWEN3_5",
    "FAMILIES",
    "VisionExtras",
    "FULL",
    "Family",
    "LEGACY_FAMILY",
    "UnknownFamilyError",
    "VisionAttention",
    "VisionConfigNames",
    "WINDOWED",
    "checkpoint_model_types",
    "family_of_backbone",
    "family_of_checkpoint",
    "get_family",
]
