"""Host-side preprocessing in numpy: the integer and layout work ColQwen2Processor does, exactly.

- `config`: `PreprocessConfig`, every constant, read from the manifest (the exporter reads it from a
  checkpoint: `colembed_export.families.preprocess_config`).
- `text`: `TextEncoder` (query ids, page prompt ids, token counts) and `pad_batch`.
- `images`: `load_image`, `smart_resize`, `resized_grid`, `prepare_image` -> `PreparedImage`.
- `positions`: `mrope_position_ids` (language model) and `vision_rotary_tables` (vision tower).

The reference is transformers 4.57.1 (`ColQwen2Processor` with the PIL `Qwen2VLImageProcessor`,
`Qwen2VLModel.get_rope_index`, the vision tower's `rot_pos_emb`); see docs in each module for the
deliberate deviations. Imports numpy, tokenizers and PIL only; never torch or transformers.
"""

from __future__ import annotations

from .config import PreprocessConfig
from .images import (
    PreparedImage,
    load_image,
    num_image_tokens,
    prepare_image,
    resized_grid,
    smart_resize,
)
from .positions import mrope_position_ids, vision_rotary_tables
from .text import TextEncoder, pad_batch

__all__ = [
    "PreparedImage",
    "PreprocessConfig",
    "TextEncoder",
    "load_image",
    "mrope_position_ids",
    "num_image_tokens",
    "pad_batch",
    "prepare_image",
    "resized_grid",
    "smart_resize",
    "vision_rotary_tables",
]
