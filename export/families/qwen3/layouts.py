"""What the published ColQwen3 layouts call things on disk, and what their processors do
differently: declared data, read by `families/qwen3/checkpoint.py` (weights), `preprocess_config.py`
(prompts and pixel bounds) and `testing/tiny_qwen3.py` (the test replicas). Imports nothing of theirs.

Two layouts of the same architecture (a Qwen3-VL backbone plus a linear projection with bias,
L2-normalised, times the attention mask; docs/reference-colqwen3.md, docs/models-colqwen3.md):

- `COLPALI`: colpali-engine 0.3.18's `ColQwen3` (a `Qwen3VLModel` subclass): a bare `qwen3_vl`
  config, keys `model.visual.*`, `model.language_model.*`, `model.custom_text_proj.*` (or the
  same without `model.`), no LM head; the width is hard-coded 320. Its processor (colpali-engine
  `ColQwen3Processor`) writes `"" + query + "<|endoftext|>" * 10` (no strip) and reads the pixel
  bounds from `preprocessor_config.json`.
- `TOMORO`: TomoroAI's remote code (`tomoro-colqwen3-embed-4b` / `-8b`, `trust_remote_code`): a
  `colqwen3` config (a `Qwen3VLConfig` subclass: `text_config`, `vision_config` at the top, plus
  `embed_dim`, `padding_side`), the backbone a `Qwen3VLForConditionalGeneration` at `vlm.` (keys
  `vlm.model.visual.*`, `vlm.model.language_model.*`, `vlm.lm_head.*` when the word embeddings
  are untied: unused for embeddings) and the projection `embedding_proj_layer`. Its processor
  strips the query text (`str.strip`) before `"" + text + pad_token * 10`, writes a page as
  `visual_prompt_prefix + visual_prompt_suffix` (together ColQwen2's page prompt), and its
  `from_pretrained(max_num_visual_tokens=1280)` sets the image processor's longest edge to
  1280 * (patch * merge)**2 pixels whatever the file says (the caller may pass another value:
  `colembed.load(..., max_image_tokens=K)` is the same choice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class Qwen3Layout:
    """One on-disk ColQwen3 layout and its processor's differences.

    `backbone_prefixes`: on-disk key prefix -> `Qwen3VLModel` state-dict prefix (first match
    wins). `projection_prefixes`: on-disk prefixes of the projection's `weight` / `bias`.
    `ignored_prefixes`: tensors read by nothing that computes an embedding (an LM head).
    `dim_key`: the config key that states the projection's width (checked against the weight),
    None when the code hard-codes it. `query_strip`: the processor strips query text.
    `max_visual_tokens`: the processor's default image-token budget replacing the file's
    longest edge (None: the file's bounds hold). `page_prompt_parts`: see the field.
    """

    name: str
    config_model_type: str
    backbone_prefixes: tuple[tuple[str, str], ...]
    projection_prefixes: tuple[str, ...]
    ignored_prefixes: tuple[str, ...] = ()
    dim_key: str | None = None
    query_strip: bool = False
    max_visual_tokens: int | None = None
    # (prefix, suffix) defaults of a processor whose page prompt is `visual_prompt_prefix +
    # visual_prompt_suffix` (processor_config.json may set either); None: ColQwen2Processor's
    # whole prompt in `visual_prompt_prefix`
    page_prompt_parts: tuple[str, str] | None = None

    def backbone_key(self, key: str) -> str | None:
        """`key`'s name in `Qwen3VLModel`'s state dict (None: not a backbone tensor)."""
        return next(
            (new + key[len(old) :] for old, new in self.backbone_prefixes if key.startswith(old)),
            None,
        )

    def projection_key(self, key: str) -> str | None:
        """`weight` / `bias` for a projection tensor, else None."""
        for prefix in self.projection_prefixes:
            if key.startswith(prefix) and key[len(prefix) :] in ("weight", "bias"):
                return key[len(prefix) :]
        return None

    def ignored(self, key: str) -> bool:
        return key.startswith(self.ignored_prefixes) if self.ignored_prefixes else False


COLPALI = Qwen3Layout(
    name="colpali-engine ColQwen3",
    config_model_type="qwen3_vl",
    backbone_prefixes=(
        ("model.visual.", "visual."),
        ("model.language_model.", "language_model."),
        ("visual.", "visual."),
        ("language_model.", "language_model."),
    ),
    projection_prefixes=("model.custom_text_proj.", "custom_text_proj."),
)
TOMORO = Qwen3Layout(
    name="TomoroAI ColQwen3 (remote code)",
    config_model_type="colqwen3",
    backbone_prefixes=(
        ("vlm.model.visual.", "visual."),
        ("vlm.model.language_model.", "language_model."),
    ),
    projection_prefixes=("embedding_proj_layer.",),
    ignored_prefixes=("vlm.lm_head.",),
    dim_key="embed_dim",
    query_strip=True,
    max_visual_tokens=1280,
    page_prompt_parts=(
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the image.",
        "<|im_end|><|endoftext|>",
    ),
)
LAYOUTS = (COLPALI, TOMORO)


def layout_of(config: Mapping[str, Any]) -> Qwen3Layout | None:
    """The layout whose config model_type `config` has (None: no ColQwen3 layout)."""
    return next(
        (layout for layout in LAYOUTS if config.get("model_type") == layout.config_model_type), None
    )


__all__ = ["COLPALI", "LAYOUTS", "Qwen3Layout", "TOMORO", "layout_of"]
