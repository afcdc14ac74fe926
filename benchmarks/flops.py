"""FLOPs of ColQwen2 work, counted from the architecture and the shapes (2 FLOPs per multiply-add).

Only matrix products are counted (linear layers and the two attention products); norms, rotary,
activations and softmax are O(width) per token and below 1% of the total at these widths. The
architecture comes from a model folder's manifest (`architecture`) or an `ArchitectureSpec`; both
spell the same numbers. Check against reference.md: a letter page at 150 dpi (2976 patches, 744
image tokens) on the real 2B shapes is about 5.3 TFLOP in the vision tower and 2.1 TFLOP in the
language model; a 25-token query about 66 GFLOP (`python benchmarks/flops.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

PATCH_DIM = 3 * 2 * 14 * 14  # channels x temporal patch x patch x patch = 1176
MERGE = 4  # 2 x 2 patches per image token


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
    text_intermediate: int
    embedding_dim: int

    @classmethod
    def from_manifest(cls, architecture: Mapping[str, Any]) -> "Shapes":
        a = architecture
        return cls(int(a["vision_depth"]), int(a["vision_embed_dim"]), float(a["vision_mlp_ratio"]),
                   int(a["text_layers"]), int(a["text_hidden"]), int(a["text_heads"]),
                   int(a["text_kv_heads"]), int(a["text_intermediate"]), int(a["embedding_dim"]))

    @classmethod
    def from_spec(cls, spec: Any) -> "Shapes":
        return cls(spec.vision_depth, spec.vision_embed_dim, spec.vision_mlp_ratio, spec.text_layers,
                   spec.text_hidden, spec.text_heads, spec.text_kv_heads, spec.text_intermediate,
                   spec.embedding_dim)


def vision_flops(s: Shapes, patches: int) -> float:
    """One image of `patches` patches through the vision tower (attention within the image)."""
    d, p = s.vision_embed_dim, patches
    mlp = int(d * s.vision_mlp_ratio)
    embed = 2 * p * PATCH_DIM * d
    linear = 2 * p * (3 * d * d + d * d + 2 * d * mlp)
    attention = 2 * 2 * p * p * d  # q.k and p.v over all heads
    merged = p // MERGE
    merger = 2 * merged * (MERGE * d) * (MERGE * d) + 2 * merged * (MERGE * d) * s.text_hidden
    return float(embed + s.vision_depth * (linear + attention) + merger)


def text_flops(s: Shapes, tokens: int) -> float:
    """One sequence of `tokens` real tokens through the language model and the projection.

    Attention is counted over the full (tokens x tokens) product, as eager kernels compute it.
    """
    h, t = s.text_hidden, tokens
    kv = s.text_kv_heads * (h // s.text_heads)
    linear = 2 * t * (2 * h * h + 2 * h * kv + 3 * h * s.text_intermediate)
    attention = 2 * 2 * t * t * h
    return float(s.text_layers * (linear + attention) + 2 * t * h * s.embedding_dim)


def page_flops(s: Shapes, image_tokens: int, sequence_tokens: int) -> dict[str, float]:
    vision = vision_flops(s, image_tokens * MERGE)
    text = text_flops(s, sequence_tokens)
    return {"vision": vision, "text": text, "total": vision + text}


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "export"))
    from tiny import PRESETS  # noqa: E402  (export/tiny.py; no torch at import time)

    shapes = Shapes.from_spec(PRESETS["qwen2-vl-2b"])
    page = page_flops(shapes, 744, 744 + 20)
    print(f"letter page, 150 dpi, 744 image tokens: vision {page['vision'] / 1e12:.2f} TFLOP, "
          f"language {page['text'] / 1e12:.2f} TFLOP")
    print(f"25-token query: {text_flops(shapes, 25) / 1e9:.1f} GFLOP")
