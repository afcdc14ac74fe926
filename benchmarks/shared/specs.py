"""The benchmarks' models per family: real widths, heads and vocabulary at a chosen depth.

`--family` in bench_embed.py and bench_export.py picks a row of `FAMILY_PRESETS`; `reduced_spec`
builds the spec and `build` writes the random-weight checkpoint with the family's builder. For
ColQwen2.5 a reduced vision depth keeps both attention kinds: the real full-attention blocks that
fit, else the last block (block 0 stays windowed).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

# family -> its full-size preset (the published model's widths)
FAMILY_PRESETS = {
    "colqwen2": "qwen2-vl-2b",
    "colqwen2.5": "qwen2.5-vl-3b",
    "colqwen3": "qwen3-vl-4b",
    "colqwen3.5": "qwen3.5-4b",
}


def reduced_spec(family: str, preset: str, vision_depth: int, text_layers: int) -> Any:
    """The family's preset at `vision_depth` vision blocks and `text_layers` language layers.
    ColQwen3 keeps the DeepStack blocks that fit (else the last block), at most `text_layers`;
    ColQwen3.5 its first layers, one of them full attention (`tiny_qwen3_5.reduced`)."""
    if family == "colqwen3.5":
        from colembed_export.testing.tiny_qwen3_5 import PRESETS, reduced

        return reduced(PRESETS[preset], vision_depth, text_layers)
    if family == "colqwen3":
        from colembed_export.testing.tiny_qwen3 import PRESETS_3

        spec = PRESETS_3[preset]
        kept = tuple(i for i in spec.deepstack_layers if i < vision_depth) or (vision_depth - 1,)
        return dataclasses.replace(
            spec,
            vision_depth=vision_depth,
            text_layers=text_layers,
            deepstack_layers=kept[:text_layers],
        )
    if family == "colqwen2.5":
        from colembed_export.testing.tiny_qwen2_5 import PRESETS_2_5

        spec = PRESETS_2_5[preset]
        full = tuple(i for i in spec.fullatt_block_indexes if i < vision_depth) or (
            vision_depth - 1,
        )
        return dataclasses.replace(
            spec, vision_depth=vision_depth, text_layers=text_layers, fullatt_block_indexes=full
        )
    from colembed_export.testing.tiny_qwen2 import PRESETS

    return dataclasses.replace(PRESETS[preset], vision_depth=vision_depth, text_layers=text_layers)


def build(family: str, out: Path, spec: Any, *, stress: bool = False) -> Path:
    """Write the random-weight (or stress) checkpoint of `spec` with the family's builder
    (ColQwen3.5: written one tensor at a time, no stress form)."""
    if family == "colqwen3.5" and not stress:
        from colembed_export.testing.tiny_qwen3_5 import build_sharded_checkpoint

        return build_sharded_checkpoint(out, spec, seed=0)
    if family == "colqwen3":
        from colembed_export.testing.tiny_qwen3 import build_checkpoint_3, build_stress_checkpoint_3

        return (build_stress_checkpoint_3 if stress else build_checkpoint_3)(out, spec, seed=0)
    if family == "colqwen2.5":
        from colembed_export.testing.tiny_qwen2_5 import (
            build_checkpoint_2_5,
            build_stress_checkpoint_2_5,
        )

        return (build_stress_checkpoint_2_5 if stress else build_checkpoint_2_5)(out, spec, seed=0)
    from colembed_export.testing.tiny_qwen2 import build_checkpoint, build_stress_checkpoint

    return (build_stress_checkpoint if stress else build_checkpoint)(out, spec, seed=0)
