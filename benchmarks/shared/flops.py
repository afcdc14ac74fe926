"""FLOPs of ColQwen2, ColQwen2.5 and ColQwen3 work, counted from the architecture and the shapes (2 FLOPs per multiply-add).

Only matrix products are counted (linear layers and the two attention products); norms, rotary,
activations and softmax are O(width) per token and below 1% of the total at these widths. The
architecture comes from a model folder's manifest (`architecture`) or an `ArchitectureSpec`; the
patch geometry (values per patch, patches per image token) from the model's `PreprocessConfig`,
never from literals. Check against docs/reference.md: a letter page at 150 dpi (2976 patches, 744
image tokens) on the real 2B shapes is about 5.3 TFLOP in the vision tower and 2.1 TFLOP in the
language model; a 25-token query about 66 GFLOP
(`python -m benchmarks.shared.flops MODEL_FOLDER --vision-depth 32 --text-layers 28` on any export of
Qwen2-VL-2B widths, e.g. the one bench_embed.py builds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class Shapes:
    """The architecture numbers FLOP counting needs."""

    vision_depth: int
    vision_embed_dim: int
    vision_mlp_ratio: float
    text_layers: int
    text_hidden: int
    text_heads: int
    text_kv_heads: int
    text_head_dim: int  # declared, not hidden / heads: Qwen3-VL-4B's 128 is not 2560 / 32
    text_intermediate: int
    embedding_dim: int
    patch_dim: int  # values per vision patch (PreprocessConfig.patch_dim)
    merge: int  # patches per image token (PreprocessConfig.merge_size ** 2)
    # ColQwen2.5 (Qwen2.5-VL tower): gated MLP (three matrices), and all blocks but `full_blocks`
    # attend within windows of `window_patches` patches. Defaults: Qwen2-VL's tower.
    gated_mlp: bool = False
    window_patches: int | None = None
    full_blocks: int = 0
    # ColQwen3 (Qwen3-VL's DeepStack): this many more mergers, each of the final merger's shapes,
    # turn the outputs of as many vision blocks into features that are added to the hidden state
    # of the first language layers at image-token positions. The mergers are matrix work and
    # counted; the additions are O(width) per image token and not (as norms are not). From the
    # manifest's `vision_extras` (families.VisionExtras); 0: no DeepStack.
    deepstack_layers: int = 0

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any]) -> "Shapes":
        """From a model folder's manifest (as a dict): its architecture and its preprocessing."""
        from colembed.manifest import Architecture
        from colembed.preprocess.config import PreprocessConfig

        a = Architecture.from_dict(manifest["architecture"])
        config = PreprocessConfig.from_dict(manifest["preprocess"])
        attention = manifest.get("vision_attention") or {}
        windowed = attention.get("kind") == "windowed"
        side = attention.get("window_size", 0) // config.patch_size if windowed else 0
        extras = manifest.get("vision_extras") or {}
        return cls(
            a.vision_depth,
            a.vision_embed_dim,
            a.vision_mlp_ratio,
            a.text_layers,
            a.text_hidden,
            a.text_heads,
            a.text_kv_heads,
            a.text_head_dim,
            a.text_intermediate,
            a.embedding_dim,
            config.patch_dim,
            config.merge_size**2,
            gated_mlp=windowed,
            window_patches=side * side if windowed else None,
            deepstack_layers=int(extras.get("deepstack_layers", 0)),
        )

    @classmethod
    def from_spec(cls, spec: Any, config: Any) -> "Shapes":
        """From a tiny-checkpoint `ArchitectureSpec` and the checkpoint's PreprocessConfig."""
        return cls(
            spec.vision_depth,
            spec.vision_embed_dim,
            spec.vision_mlp_ratio,
            spec.text_layers,
            spec.text_hidden,
            spec.text_heads,
            spec.text_kv_heads,
            spec.text_head_dim,
            spec.text_intermediate,
            spec.embedding_dim,
            config.patch_dim,
            config.merge_size**2,
        )


def vision_flops(s: Shapes, patches: int) -> float:
    """One image of `patches` patches through the vision tower (attention within the image)."""
    d, p = s.vision_embed_dim, patches
    mlp = round(d * s.vision_mlp_ratio)
    embed = 2 * p * s.patch_dim * d
    linear = 2 * p * (3 * d * d + d * d + (3 if s.gated_mlp else 2) * d * mlp)
    return float(
        embed + s.vision_depth * linear + (1 + s.deepstack_layers) * merger_flops(s, patches)
    ) + vision_attention_flops(s, patches)


def merger_flops(s: Shapes, patches: int) -> float:
    """One patch merger (the final one, or a DeepStack one: the same shapes) over an image of
    `patches` patches: `merge` patches' features concatenated, a square linear, a linear to the
    language model's width."""
    merged, wide = patches // s.merge, s.merge * s.vision_embed_dim
    return float(2 * merged * wide * wide + 2 * merged * wide * s.text_hidden)


def vision_attention_flops(s: Shapes, patches: int) -> float:
    """The attention products (q.k, p.v: activation x activation, no weights) of `vision_flops`."""
    d, p = s.vision_embed_dim, patches
    attention = 2 * 2 * p * p * d  # q.k and p.v over all heads
    windowed = s.vision_depth - s.full_blocks if s.window_patches else 0
    within = 2 * 2 * p * min(p, s.window_patches or p) * d  # at most a window's keys per patch
    return float((s.vision_depth - windowed) * attention + windowed * within)


def text_flops(s: Shapes, tokens: int) -> float:
    """One sequence of `tokens` real tokens through the language model and the projection.

    Attention is counted over the full (tokens x tokens) product, as eager kernels compute it.
    q and o are hidden x (heads x head dim), k and v hidden x (kv heads x head dim): with Qwen3's
    declared head dim these are not square (Qwen3-VL-4B: 2560 x 4096).
    """
    h, t = s.text_hidden, tokens
    q, kv = s.text_heads * s.text_head_dim, s.text_kv_heads * s.text_head_dim
    linear = 2 * t * (2 * h * q + 2 * h * kv + 3 * h * s.text_intermediate)
    return float(s.text_layers * linear + 2 * t * h * s.embedding_dim) + text_attention_flops(
        s, tokens
    )


def text_attention_flops(s: Shapes, tokens: int) -> float:
    """The attention products of `text_flops` (full tokens x tokens, as eager kernels compute),
    over every query head's width (heads x head dim)."""
    return float(s.text_layers * 2 * 2 * tokens * tokens * s.text_heads * s.text_head_dim)


def page_flops(s: Shapes, image_tokens: int, sequence_tokens: int) -> dict[str, float]:
    vision = vision_flops(s, image_tokens * s.merge)
    text = text_flops(s, sequence_tokens)
    attention = vision_attention_flops(s, image_tokens * s.merge) + text_attention_flops(
        s, sequence_tokens
    )
    return {
        "vision": vision,
        "text": text,
        "total": vision + text,
        "attention": attention,
        "weight_gemms": vision + text - attention,
    }


if __name__ == "__main__":
    import argparse
    import dataclasses
    import json
    from pathlib import Path

    from colembed.layout import MANIFEST_NAME

    parser = argparse.ArgumentParser(description="FLOPs of a letter page and a query")
    parser.add_argument("folder", type=Path, help="an exported model folder (its manifest)")
    parser.add_argument("--vision-depth", type=int, help="override the folder's vision depth")
    parser.add_argument("--text-layers", type=int, help="override the folder's language depth")
    args = parser.parse_args()
    shapes = Shapes.from_manifest(json.loads((args.folder / MANIFEST_NAME).read_text()))
    shapes = dataclasses.replace(
        shapes,
        vision_depth=args.vision_depth or shapes.vision_depth,
        text_layers=args.text_layers or shapes.text_layers,
    )
    page = page_flops(shapes, 744, 744 + 20)
    print(
        f"letter page, 150 dpi, 744 image tokens: vision {page['vision'] / 1e12:.2f} TFLOP, "
        f"language {page['text'] / 1e12:.2f} TFLOP"
    )
    print(f"25-token query: {text_flops(shapes, 25) / 1e9:.1f} GFLOP")
