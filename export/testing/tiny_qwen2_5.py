"""Random-weight ColQwen2.5 checkpoints of the real architecture, for tests and benchmarks.

The ColQwen2.5 counterpart of `testing/tiny_qwen2.py` (which it reuses for the tokenizer and pixel bounds): a
Qwen2.5-VL backbone (windowed vision attention with a few full-attention blocks, RMSNorm, gated
SiLU MLPs, RMSNorm merger) plus ColQwen's 128-wide projection, at small widths and depths.

Two on-disk layouts of the same weights (`build_checkpoint_2_5` writes the second,
`to_colpali_layout` converts it to the first) (docs/reference-colqwen2_5.md says why both exist):

- `"colpali"`: what the published `vidore/colqwen2.5-base` (the base of the `vidore/colqwen2.5-v0.2`
  adapter) stores, i.e. what colpali-engine 0.3.12 `ColQwen2_5.save_pretrained` writes under
  transformers 4.57.1: a bare `qwen2_5_vl` config.json (`architectures: ["ColQwen2_5"]`) and the
  keys `model.*` (language model), `visual.*` and `custom_text_proj.*`; no `lm_head`.
- `"transformers"`: transformers' own retrieval layout (`ColQwen2ForRetrieval` over a Qwen2.5-VL
  config, as community conversions such as `*/colqwen2.5-v0.2-hf` store it): `vlm.model.*`,
  `vlm.lm_head`, `embedding_proj_layer.*` and a `colqwen2` config nesting `vlm_config`.

Everything written here has **random weights**: only shapes and agreement with the reference mean
anything.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from typing import Any, Callable

from ..families.qwen2_5.layouts import WEIGHTS_INDEX, to_colpali_key

from .shared import (
    TINY_INFO,
    apply_edit,
    make_folder,
    perturb_vectors,
    resolve_preset,
    stress_edit,
    write_tiny_info,
)
from .tiny_qwen2 import (
    TRAINING_MAX_PIXELS,
    TRAINING_MIN_PIXELS,
    ArchitectureSpec,
    StressTraits,
    build_config,
    inject_text_traits,
    inject_vision_traits,
    save_processor,
)

PATCH_SIZE = 14
MERGE_SIZE = 2


@dataclass(frozen=True)
class Qwen2_5Spec(ArchitectureSpec):
    """`ArchitectureSpec` plus what Qwen2.5-VL's vision tower adds.

    `window_size` is in pixels (the reference's unit): a window is `window_size / (patch * merge)`
    merged tokens on a side. `fullatt_block_indexes` are the blocks with full attention; every
    other block attends within windows. `vision_intermediate` replaces Qwen2-VL's `mlp_ratio`
    (the gated MLP's width is not a ratio of the embed dim in the real model: 3420 for 1280).
    """

    vision_intermediate: int = 64
    window_size: int = 56
    fullatt_block_indexes: tuple[int, ...] = (1,)
    tie_word_embeddings: bool = False

    def check(self) -> None:
        super().check()
        factor = PATCH_SIZE * MERGE_SIZE
        if self.window_size % factor or self.window_size < factor:
            raise ValueError(
                f"{self.name}: window_size {self.window_size} must be a multiple of {factor}"
            )
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.vision_depth]
        if bad:
            raise ValueError(
                f"{self.name}: fullatt_block_indexes {bad} outside depth {self.vision_depth}"
            )


PRESETS_2_5: dict[str, Qwen2_5Spec] = {
    # Windows of 2x2 merged tokens (4x4 patches); block 1 of 3 is full attention.
    "tiny-2.5": Qwen2_5Spec(name="tiny-2.5", vision_depth=3, vision_intermediate=64),
    # Other widths and heads, windows of 4x4 merged tokens (the real model's 112 px), full
    # attention first and last, GQA 3:1, a 64-dim projection, tied word embeddings as in the 3B.
    "tiny-2.5-alt": Qwen2_5Spec(
        name="tiny-2.5-alt",
        vision_depth=4,
        vision_embed_dim=48,
        vision_heads=3,
        vision_intermediate=80,
        window_size=112,
        fullatt_block_indexes=(0, 3),
        text_layers=3,
        text_hidden=96,
        text_heads=3,
        text_kv_heads=1,
        text_intermediate=160,
        mrope_section=(4, 6, 6),
        embedding_dim=64,
        tie_word_embeddings=True,
    ),
    # Qwen2.5-VL-3B widths, heads, windows and vocabulary; reduce depth for benchmarks with
    # `replace(spec, vision_depth=..., text_layers=..., fullatt_block_indexes=...)`.
    "qwen2.5-vl-3b": Qwen2_5Spec(
        name="qwen2.5-vl-3b",
        vision_depth=32,
        vision_embed_dim=1280,
        vision_heads=16,
        vision_intermediate=3420,
        window_size=112,
        fullatt_block_indexes=(7, 15, 23, 31),
        text_layers=36,
        text_hidden=2048,
        text_heads=16,
        text_kv_heads=2,
        text_intermediate=11008,
        mrope_section=(16, 24, 24),
        embedding_dim=128,
        tie_word_embeddings=True,
    ),
}

# Qwen2.5-VL-7B widths (the backbone of nomic-ai/colnomic-embed-multimodal-7b): the same
# vision tower as the 3B except the merger's output (3584), a 28-layer language model with
# GQA 7:1, untied word embeddings and Qwen2.5-VL-7B's padded vocabulary (152064 rows; the
# tokenizer's ids all index it). docs/models-colqwen2_5.md.
PRESETS_2_5["qwen2.5-vl-7b"] = replace(
    PRESETS_2_5["qwen2.5-vl-3b"],
    name="qwen2.5-vl-7b",
    text_layers=28,
    text_hidden=3584,
    text_heads=28,
    text_kv_heads=4,
    text_intermediate=18944,
    vocab_size=152064,
    tie_word_embeddings=False,
)


def build_vlm_config(spec: Qwen2_5Spec):
    """The `Qwen2_5_VLConfig` of the real architecture at the spec's sizes."""
    from transformers import Qwen2_5_VLConfig

    # The language model is Qwen2-VL's with another model_type: testing/tiny_qwen2.py's mapping of the spec.
    text_config = build_config(spec).vlm_config.text_config.to_dict()
    text_config.update(model_type="qwen2_5_vl_text", tie_word_embeddings=spec.tie_word_embeddings)
    return Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config={
            "depth": spec.vision_depth,
            "hidden_size": spec.vision_embed_dim,
            "intermediate_size": spec.vision_intermediate,
            "num_heads": spec.vision_heads,
            "out_hidden_size": spec.text_hidden,
            "window_size": spec.window_size,
            "fullatt_block_indexes": list(spec.fullatt_block_indexes),
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        tie_word_embeddings=spec.tie_word_embeddings,
    )


def build_model(spec: Qwen2_5Spec | str = "tiny-2.5", *, seed: int = 0):
    """A random-weight `ColQwen2ForRetrieval` over a Qwen2.5-VL config, fp32, eval mode.

    Norm weights and biases are perturbed away from 1 and 0 so that a graph that dropped one
    would show up in parity tests (random init leaves them exact).
    """
    import torch
    from transformers import ColQwen2Config, ColQwen2ForRetrieval

    spec = resolve_preset(spec, PRESETS_2_5, "ColQwen2.5")
    torch.manual_seed(seed)
    config = ColQwen2Config(vlm_config=build_vlm_config(spec), embedding_dim=spec.embedding_dim)
    model = ColQwen2ForRetrieval(config).to(torch.float32).eval()
    perturb_vectors(model, seed)
    return model


def build_checkpoint_2_5(
    out_dir: str | Path,
    spec: Qwen2_5Spec | str = "tiny-2.5",
    *,
    seed: int = 0,
    min_pixels: int = TRAINING_MIN_PIXELS,
    max_pixels: int = TRAINING_MAX_PIXELS,
    edit: Callable[[Any], dict[str, Any]] | None = None,
) -> Path:
    """Write a random-weight ColQwen2.5 checkpoint folder in the transformers layout; return it.

    Deterministic for a given spec and seed. The folder also holds the real Qwen tokenizer files
    (byte-identical) and a Qwen2-VL image processor config with ColQwen's training pixel bounds.
    `to_colpali_layout` rewrites it in the published layout. `edit(model)` changes the weights
    before saving (the stress traits); what it returns is recorded in colembed_tiny.json.
    """
    spec = resolve_preset(spec, PRESETS_2_5, "ColQwen2.5")
    out = make_folder(out_dir)
    model = build_model(spec, seed=seed)
    edited = apply_edit(edit, model)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="2GB")  # bounds RSS at 3B
    save_processor(out, min_pixels=min_pixels, max_pixels=max_pixels)
    write_tiny_info(out, seed=seed, spec=spec, edited=edited, layout="transformers")
    return out


# ------------------------------------------------------------------------------ stress checkpoint
@dataclass(frozen=True)
class Qwen2_5StressTraits(StressTraits):
    """`StressTraits` (text traits as for ColQwen2) plus what Qwen2.5-VL's gated vision MLP adds.

    The vision tower here has RMSNorms and gated SiLU MLPs. Its residual stream runs at
    `vision_typical` per element with two channels offset up to `vision_peak` (above fp16's
    65504), each RMSNorm compensating; in every block one MLP intermediate channel carries
    `silu(gate) * up` = `mlp_peak` (above 65504): the down-projection's input, the overflow point
    of fp16 Qwen2.5-VL vision towers (shared/seeds), with the down-projection's column scaled so
    its output stays at the residual's size, as trained weights do. Image features reach
    `feature_peak`. Limits as `StressTraits`: constant across tokens, magnitudes set on a probe.
    """

    mlp_peak: float = 200_000.0

    def mlp_channel(self, intermediate: int) -> int:
        return intermediate // 3


def _inject_vision_traits_2_5(model: Any, traits: Qwen2_5StressTraits) -> dict[str, Any]:
    import math

    visual = model.vlm.model.visual
    dim = visual.config.hidden_size

    def add_mlp_outliers(visual: Any) -> None:
        for block in visual.blocks:
            c = traits.mlp_channel(block.mlp.gate_proj.out_features)
            root = math.sqrt(traits.mlp_peak)  # silu(root) * root ~ mlp_peak on every token
            for linear in (block.mlp.gate_proj, block.mlp.up_proj):
                linear.weight[c].zero_()
                linear.bias[c] = root
            column = block.mlp.down_proj.weight[:, c]
            column.mul_(traits.vision_typical / (traits.mlp_peak * column.abs().max()))

    def compensate(norm: Any, sigma: float, seen: float, channels: list, others: list) -> None:
        # Each RMSNorm sees i sublayers' offsets: its RMS grows; the other channels' weights undo
        # it, the offset channels get a small weight (as trained norms do for their massive
        # channels).
        norm.weight[others] *= math.sqrt(sigma**2 + 2 * seen**2 / dim) / sigma
        norm.weight[channels] = traits.small_norm_weight

    report = inject_vision_traits(
        visual,
        dim,
        traits,
        side=8,
        writers=lambda block: (block.attn.proj, block.mlp.down_proj),
        compensate=compensate,
        edit_blocks=add_mlp_outliers,
    )
    return {
        **report,
        "mlp_outlier_channel": traits.mlp_channel(visual.blocks[0].mlp.gate_proj.out_features),
    }


def build_stress_checkpoint_2_5(
    out_dir: str | Path,
    spec: Qwen2_5Spec | str = "tiny-2.5",
    *,
    seed: int = 0,
    traits: Qwen2_5StressTraits = Qwen2_5StressTraits(),
) -> Path:
    """`build_checkpoint_2_5` plus trained-model activation traits (`Qwen2_5StressTraits`)."""

    edit = stress_edit(traits, inject_text_traits, _inject_vision_traits_2_5)
    return build_checkpoint_2_5(out_dir, spec, seed=seed, edit=edit)


def colpali_state_dict(state_dict: dict, *, with_head: bool = False) -> dict:
    """The published (colpali-engine) key names for a `ColQwen2ForRetrieval` state dict; the LM
    head only `with_head` (0.3.12's ColQwen2_5 is a headless Qwen2_5_VLModel; before transformers
    4.52 an untied head was saved)."""
    out = {}
    for key, value in state_dict.items():
        new = to_colpali_key(key)
        if new is not None and (with_head or not new.startswith("lm_head.")):
            out[new] = value.detach().contiguous()
    return out


# Text-model keys the pre-4.52 flat Qwen2.5-VL config.json keeps at its top level.
_FLAT_TEXT_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_act",
    "max_position_embeddings",
    "max_window_layers",
    "rms_norm_eps",
    "rope_theta",
    "sliding_window",
    "use_sliding_window",
    "attention_dropout",
    "initializer_range",
    "tie_word_embeddings",
)
_FLAT_VISION_KEYS = (
    "depth",
    "hidden_size",
    "hidden_act",
    "intermediate_size",
    "num_heads",
    "in_channels",
    "out_hidden_size",
    "patch_size",
    "spatial_merge_size",
    "temporal_patch_size",
    "window_size",
    "fullatt_block_indexes",
    "tokens_per_second",
)


def flat_config(vlm_config: dict) -> dict:
    """The pre-4.52 form of a Qwen2.5-VL config.json (as Qwen/Qwen2.5-VL-*-Instruct shipped it and
    bases saved then store it): the text model's numbers at the top level, `rope_scaling` as
    {"type": "mrope", "mrope_section": ...}, `vision_config` nested; no `text_config`."""
    text, vision = vlm_config["text_config"], vlm_config["vision_config"]
    config = {k: text[k] for k in _FLAT_TEXT_KEYS if k in text}
    config["rope_scaling"] = {
        "type": "mrope",
        "mrope_section": list(text["rope_scaling"]["mrope_section"]),
    }
    config["vision_config"] = {k: vision[k] for k in _FLAT_VISION_KEYS if k in vision}
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        config[key] = vlm_config[key]
    config.update(model_type="qwen2_5_vl", tie_word_embeddings=text["tie_word_embeddings"])
    return config


def to_colpali_layout(
    src: str | Path, dst: str | Path, *, pre_4_52: bool = False, shards: int = 1
) -> Path:
    """Rewrite a transformers-layout folder (from `build_checkpoint_2_5`) in the colpali layout:
    same tensors, published names and config; processor and tokenizer files copied as they are.

    Default: what colpali-engine 0.3.12 writes (nested config, no LM head, one file).
    `pre_4_52`: what it wrote on transformers < 4.52 (`ColQwen2_5` on
    Qwen2_5_VLForConditionalGeneration), as `nomic-ai/colqwen2.5-7B-base` stores it: the flat
    config and, for untied embeddings, `lm_head.weight`. `shards` > 1 splits the weights over that
    many files plus `model.safetensors.index.json`, as every published base of real size is."""
    from safetensors.torch import load_file

    src, dst = Path(src), make_folder(dst)
    vlm_config = json.loads((src / "config.json").read_text())["vlm_config"]
    untied = not vlm_config["text_config"]["tie_word_embeddings"]
    state = colpali_state_dict(
        load_file(str(src / "model.safetensors")), with_head=pre_4_52 and untied
    )
    config = flat_config(vlm_config) if pre_4_52 else dict(vlm_config)
    _save_colpali_layout(state, config, dst, shards=shards)
    for path in src.iterdir():
        if path.name not in ("config.json", "model.safetensors", TINY_INFO):
            shutil.copyfile(path, dst / path.name)
    if (src / TINY_INFO).is_file():
        info = {
            **json.loads((src / TINY_INFO).read_text()),
            "layout": "colpali",
            "pre_4_52": pre_4_52,
            "shards": shards,
        }
        (dst / TINY_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return dst


def _save_colpali_layout(state_dict: dict, config: dict, out: Path, *, shards: int = 1) -> None:
    from safetensors.torch import save_file

    config = {**config, "architectures": ["ColQwen2_5"], "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if shards <= 1:
        save_file(state_dict, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    keys = sorted(state_dict)
    weight_map, size = {}, 0
    for n in range(shards):
        name = f"model-{n + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state_dict[k] for k in keys[n::shards]}
        save_file(part, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
        size += sum(v.numel() * v.element_size() for v in part.values())
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (out / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


__all__ = [
    "PRESETS_2_5",
    "Qwen2_5Spec",
    "Qwen2_5StressTraits",
    "build_stress_checkpoint_2_5",
    "build_checkpoint_2_5",
    "build_model",
    "build_vlm_config",
    "colpali_state_dict",
    "flat_config",
    "to_colpali_layout",
]
