"""Reading a checkpoint's preprocessing constants: a Hugging Face ColQwen2-family folder into the
runtime's `PreprocessConfig` (the exporter writes it into the manifest; the runtime never reads a
checkpoint).

Where each value comes from (what the pinned reference, transformers 4.57.1, reads):

- `processor_config.json`: `query_prefix`, `visual_prompt_prefix` (the page prompt; for a layout
  whose processor splits it, `visual_prompt_prefix + visual_prompt_suffix`); when absent, the
  defaults of `ColQwen2Processor.__init__` (or of the layout's processor).
- `tokenizer_config.json` (else `special_tokens_map.json`): the pad token, which is also the query
  augmentation token (`ColQwen2Processor.query_augmentation_token`) unless the family's processor
  declares its own (`Family.query_augmentation_token`, ColQwen3.5's); the image token string
  (`extra_special_tokens.image_token`, else transformers 5.x's top-level `image_token`, else the
  processor's default).
- `tokenizer.json`: the ids of those tokens, looked up by name.
- `config.json` (`vlm_config` for ColQwen2; a bare Qwen-VL config, as colpali-engine's ColQwen2.5
  stores it, is read as is): `image_token_id` and `vision_start_token_id` (checked against the
  tokenizer), and `vision_config` for the vision head dim and the patch geometry (checked against
  the image processor's). The backbone's model_type picks the family (`colembed.families`), whose
  declaration says which key is the vision width: Qwen2-VL's `embed_dim`, Qwen2.5-VL's
  `hidden_size` (Qwen2-VL's `hidden_size` is the merger's output; never one for the other).
- `preprocessor_config.json` (else `processor_config.json`'s `image_processor` object, where
  transformers 5.x saves it): `min_pixels`/`max_pixels` (or `size.shortest_edge`/`longest_edge`),
  patch/merge/temporal sizes, mean, std, rescale factor.
- the checkpoint layout (`layouts_qwen3`, by config.json's model_type): what a ColQwen3 layout's
  own processor does beyond the files. TomoroAI's strips queries (`query_strip`) and replaces the
  file's longest edge by its `max_num_visual_tokens` default (1280 image tokens).

Deliberate deviations from the reference, both about malformed or unusual folders:

- A `preprocessor_config.json` with only `size` (no `min_pixels`/`max_pixels`): transformers 4.57.1
  `Qwen2VLImageProcessor.__init__` overwrites a valid `size` with its defaults (3136 / 1003520)
  before applying `min_pixels`/`max_pixels`, so the reference silently ignores `size`. colembed
  honours `size` (what the file says and what reference.md specifies).
- No pixel bounds at all: the reference falls back to Qwen2-VL's defaults (up to 1280 image tokens,
  not ColQwen2's trained 768); colembed refuses the folder instead of guessing.

Imports the standard library, PIL (for the resampling enum), tokenizers and colembed; no torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from PIL import Image

from colembed.errors import ModelFolderError
from colembed.families import VISION_ROPE_THETA, family_of_backbone
from colembed.layout import TOKENIZER_FILE
from colembed.preprocess.config import UPSTREAM_IMAGE_PROCESSOR_DEFAULTS, PreprocessConfig

from .qwen3.layouts import layout_of

# Upstream defaults, used only when a checkpoint file leaves the value out (exactly when the
# reference would use them too). transformers 4.57.1:
#   ColQwen2Processor.__init__: query_prefix (declared per family, `Family.default_query_prefix`:
#   "Query: ", "" for ColQwen3 as colpali-engine's ColQwen3Processor), visual_prompt_prefix,
#   image_token.
#   ColQwen2Processor.__call__: `self.query_augmentation_token * 10`.
#   Qwen2VLImageProcessor.__init__: patch/merge/temporal sizes, rescale factor, OPENAI_CLIP mean/std
#     (UPSTREAM_IMAGE_PROCESSOR_DEFAULTS, kept by the runtime beside the type).
#   VisionRotaryEmbedding.__init__: theta (`colembed.families.VISION_ROPE_THETA`; a family whose
#     reference reads `vision_config.rope_parameters` takes it from there: `vision_rope_theta`).
UPSTREAM_PAGE_PROMPT = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the image.<|im_end|>"
    "<|endoftext|>"
)
UPSTREAM_IMAGE_TOKEN = "<|image_pad|>"
UPSTREAM_VISION_START_TOKEN = "<|vision_start|>"
QUERY_AUGMENTATION_COUNT = 10

# The only preprocessing colembed implements; a folder asking for anything else is refused.
_REQUIRED_FLAGS = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")
_REQUIRED_RESAMPLE = int(Image.Resampling.BICUBIC)


def read_preprocess_config(folder: str | Path) -> PreprocessConfig:
    """Read a Hugging Face ColQwen2 folder (config.json, preprocessor_config.json, tokenizer files)."""
    folder = Path(folder)
    raw_config = _read_json(folder / "config.json")
    family = family_of_backbone(raw_config, folder / "config.json")
    model_config = _vlm_config(raw_config)
    image_config, preprocessor_path = image_processor_config(folder)
    processor_config = _read_json(folder / "processor_config.json", required=False)
    tokenizer_config = _read_json(folder / "tokenizer_config.json", required=False)
    special_tokens = _read_json(folder / "special_tokens_map.json", required=False)
    tokenizer = _load_tokenizer(folder / TOKENIZER_FILE)

    pad_token = _pad_token(tokenizer_config, special_tokens, folder)
    if family.query_augmentation_token not in (None, pad_token):
        # the runtime pads with the augmentation token's id (preprocess/text.py checks both)
        raise ModelFolderError(
            f"{family.display_name}'s processor appends {family.query_augmentation_token!r} to "
            f"queries, but the tokenizer's pad token is {pad_token!r}; colembed needs them equal",
            path=folder / "tokenizer_config.json",
        )
    image_token = _image_token(tokenizer_config)
    vision_config = model_config.get("vision_config", {})
    _check_supported_pipeline(image_config, preprocessor_path)
    min_pixels, max_pixels = _pixel_bounds(image_config, preprocessor_path)
    geometry = _patch_geometry(image_config, vision_config, folder)
    layout = layout_of(raw_config)  # a ColQwen3 layout's processor differences, else None
    if layout is not None and layout.max_visual_tokens is not None:
        max_pixels = (
            layout.max_visual_tokens * (geometry["patch_size"] * geometry["merge_size"]) ** 2
        )
    defaults = UPSTREAM_IMAGE_PROCESSOR_DEFAULTS
    values = dict(
        query_prefix=_value_or(processor_config.get("query_prefix"), family.default_query_prefix),
        query_augmentation_token=_value_or(family.query_augmentation_token, pad_token),
        query_augmentation_count=QUERY_AUGMENTATION_COUNT,
        page_prompt=_page_prompt(processor_config, layout),
        image_token=image_token,
        image_token_id=_token_id(tokenizer, image_token, model_config, "image_token_id", folder),
        vision_start_token_id=_token_id(
            tokenizer, UPSTREAM_VISION_START_TOKEN, model_config, "vision_start_token_id", folder
        ),
        pad_token_id=_token_id(tokenizer, pad_token, {}, "pad_token_id", folder),
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        image_mean=tuple(float(v) for v in image_config.get("image_mean", defaults["image_mean"])),
        image_std=tuple(float(v) for v in image_config.get("image_std", defaults["image_std"])),
        rescale_factor=float(image_config.get("rescale_factor", defaults["rescale_factor"])),
        vision_head_dim=family.vision_head_dim(vision_config, folder / "config.json"),
        vision_rope_theta=family.vision_rope_theta(vision_config, str(folder / "config.json")),
        query_strip=bool(layout is not None and layout.query_strip),
        **geometry,
    )
    try:
        return PreprocessConfig(**values)
    except ValueError as e:
        raise ModelFolderError(str(e), path=folder) from e


def _page_prompt(processor_config: dict[str, Any], layout) -> str:
    """ColQwen2Processor's `visual_prompt_prefix` is the whole page prompt; a layout whose
    processor splits it (TomoroAI's: prefix + suffix) joins its two parts, each the file's or the
    processor's default."""
    if layout is None or layout.page_prompt_parts is None:
        return _value_or(processor_config.get("visual_prompt_prefix"), UPSTREAM_PAGE_PROMPT)
    prefix, suffix = layout.page_prompt_parts
    return _value_or(processor_config.get("visual_prompt_prefix"), prefix) + _value_or(
        processor_config.get("visual_prompt_suffix"), suffix
    )


def image_processor_config(folder: Path) -> tuple[dict[str, Any], Path]:
    """(the image processor's settings, the file they came from): `preprocessor_config.json`, or
    the `image_processor` object of `processor_config.json`, which is where transformers 5.x's
    `ProcessorMixin.save_pretrained` writes them (it writes no preprocessor_config.json)."""
    path = folder / "preprocessor_config.json"
    if path.is_file():
        return _read_json(path), path
    processor_path = folder / "processor_config.json"
    nested = _read_json(processor_path, required=False).get("image_processor")
    if isinstance(nested, dict):
        return nested, processor_path
    raise ModelFolderError(
        "no image processor settings: neither preprocessor_config.json nor an "
        "`image_processor` object in processor_config.json",
        path=folder,
    )


def _read_json(path: Path, *, required: bool = True) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelFolderError(
                "missing file (is this a Hugging Face ColQwen2 folder?)", path=path
            )
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFolderError(f"unreadable JSON: {e}", path=path) from e
    if not isinstance(data, dict):
        raise ModelFolderError("expected a JSON object at the top level", path=path)
    return data


def _vlm_config(config: dict[str, Any]) -> dict[str, Any]:
    """ColQwen2 nests the Qwen-VL config under `vlm_config`; a bare Qwen-VL config is accepted."""
    nested = config.get("vlm_config")
    return nested if isinstance(nested, dict) else config


def _load_tokenizer(path: Path):
    """The tokenizer itself, for `token_to_id` by name (the same lookup the reference's tokenizer does)."""
    from tokenizers import Tokenizer

    if not path.is_file():
        raise ModelFolderError("missing file (is this a Hugging Face ColQwen2 folder?)", path=path)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise ModelFolderError(f"unreadable tokenizer: {e}", path=path) from e


def _value_or(value: Any, default: Any) -> Any:
    """The reference replaces only a missing (None) value by its default; "" is kept."""
    return default if value is None else value


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pad_token(tokenizer_config: dict, special_tokens: dict, folder: Path) -> str:
    pad = _token_text(tokenizer_config.get("pad_token")) or _token_text(
        special_tokens.get("pad_token")
    )
    if pad is None:
        raise ModelFolderError(
            "no pad token in tokenizer_config.json or special_tokens_map.json; ColQwen2 uses it as "
            "the query augmentation token",
            path=folder,
        )
    return pad


def _image_token(tokenizer_config: dict) -> str:
    extra = tokenizer_config.get("extra_special_tokens")
    if isinstance(extra, dict) and _token_text(extra.get("image_token")):
        return _token_text(extra["image_token"])  # type: ignore[return-value]
    # transformers 5.x writes the named tokens at the top (`model_specific_special_tokens`)
    return _token_text(tokenizer_config.get("image_token")) or UPSTREAM_IMAGE_TOKEN


def _token_id(tokenizer, token: str, model_config: dict, key: str, folder: Path) -> int:
    """Id of `token` from the tokenizer; must agree with `model_config[key]` when the config has it."""
    from_tokenizer = tokenizer.token_to_id(token)
    from_config = model_config.get(key)
    if from_tokenizer is None:
        raise ModelFolderError(
            f"token {token!r} is not in {TOKENIZER_FILE}", path=folder / TOKENIZER_FILE
        )
    if from_config is not None and int(from_config) != from_tokenizer:
        raise ModelFolderError(
            f"config.json says {key}={from_config} but tokenizer.json maps {token!r} to {from_tokenizer}",
            path=folder / "config.json",
        )
    return from_tokenizer


def _pixel_bounds(image_config: dict, path: Path) -> tuple[int, int]:
    """`min_pixels`/`max_pixels` win over `size` (as in the reference when both are present)."""
    size = image_config.get("size") if isinstance(image_config.get("size"), dict) else {}
    low = image_config.get("min_pixels", size.get("shortest_edge"))
    high = image_config.get("max_pixels", size.get("longest_edge"))
    if low is None or high is None:
        raise ModelFolderError(
            "no pixel bounds: expected min_pixels/max_pixels or size.shortest_edge/longest_edge",
            path=path,
        )
    return int(low), int(high)


def _patch_geometry(image_config: dict, vision_config: dict, folder: Path) -> dict[str, int]:
    """Patch/merge/temporal sizes from the image processor, cross-checked with the vision tower."""
    pairs = {  # image processor key -> vision config key
        "patch_size": "patch_size",
        "merge_size": "spatial_merge_size",
        "temporal_patch_size": "temporal_patch_size",
    }
    out: dict[str, int] = {}
    for key, vision_key in pairs.items():
        value = image_config.get(
            key, vision_config.get(vision_key, UPSTREAM_IMAGE_PROCESSOR_DEFAULTS[key])
        )
        tower = vision_config.get(vision_key)
        if tower is not None and int(tower) != int(value):
            raise ModelFolderError(
                f"preprocessor_config.json {key}={value} disagrees with config.json "
                f"vision_config.{vision_key}={tower}",
                path=folder,
            )
        out[key] = int(value)
    return out


def _check_supported_pipeline(image_config: dict, path: Path) -> None:
    off = [flag for flag in _REQUIRED_FLAGS if image_config.get(flag, True) is not True]
    if off:
        raise ModelFolderError(
            f"colembed implements ColQwen2's image pipeline only; {off} are off", path=path
        )
    resample = image_config.get("resample", _REQUIRED_RESAMPLE)
    if resample != _REQUIRED_RESAMPLE:
        raise ModelFolderError(
            f"resample={resample}; colembed implements PIL BICUBIC ({_REQUIRED_RESAMPLE}) only",
            path=path,
        )


__all__ = [
    "QUERY_AUGMENTATION_COUNT",
    "VISION_ROPE_THETA",
    "image_processor_config",
    "read_preprocess_config",
]
