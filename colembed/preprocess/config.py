"""Every preprocessing constant of a ColQwen2 checkpoint, read once from its files.

Owns `PreprocessConfig`: the prompt templates, the token ids, the pixel bounds, the patch geometry,
the normalisation constants and the vision rotary constants that `text.py`, `images.py` and
`positions.py` need. It is built from a Hugging Face ColQwen2 folder (`from_checkpoint`) or from
the manifest (`from_dict`), and is the only place these numbers live.

Where each value comes from (what the pinned reference, transformers 4.57.1, reads):

- `processor_config.json`: `query_prefix`, `visual_prompt_prefix` (the page prompt); when absent,
  the defaults of `ColQwen2Processor.__init__`.
- `tokenizer_config.json` (else `special_tokens_map.json`): the pad token, which is also the query
  augmentation token (`ColQwen2Processor.query_augmentation_token`); the image token string
  (`extra_special_tokens.image_token`, else the processor's default).
- `tokenizer.json`: the ids of those tokens, looked up by name.
- `config.json` (`vlm_config` for ColQwen2; a bare Qwen-VL config, as colpali-engine's ColQwen2.5
  stores it, is read as is): `image_token_id` and `vision_start_token_id` (checked against the
  tokenizer), and `vision_config` for the vision head dim and the patch geometry (checked against
  the image processor's). The backbone's model_type picks the family (`colembed.families`), whose
  declaration says which key is the vision width: Qwen2-VL's `embed_dim`, Qwen2.5-VL's
  `hidden_size` (Qwen2-VL's `hidden_size` is the merger's output; never one for the other).
- `preprocessor_config.json`: `min_pixels`/`max_pixels` (or `size.shortest_edge`/`longest_edge`),
  patch/merge/temporal sizes, mean, std, rescale factor.

Deliberate deviations from the reference, both about malformed or unusual folders:

- A `preprocessor_config.json` with only `size` (no `min_pixels`/`max_pixels`): transformers 4.57.1
  `Qwen2VLImageProcessor.__init__` overwrites a valid `size` with its defaults (3136 / 1003520)
  before applying `min_pixels`/`max_pixels`, so the reference silently ignores `size`. colembed
  honours `size` (what the file says and what reference.md specifies).
- No pixel bounds at all: the reference falls back to Qwen2-VL's defaults (up to 1280 image tokens,
  not ColQwen2's trained 768); colembed refuses the folder instead of guessing.

Imports only the standard library, PIL (for the resampling enum) and colembed's errors (its families
lazily, in `from_checkpoint`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from PIL import Image

from ..errors import InputError, InputTypeError, ManifestError, ModelFolderError
from ..layout import TOKENIZER_FILE

# Upstream defaults, used only when a checkpoint file leaves the value out (exactly when the
# reference would use them too). transformers 4.57.1:
#   ColQwen2Processor.__init__: query_prefix, visual_prompt_prefix, image_token.
#   ColQwen2Processor.__call__: `self.query_augmentation_token * 10`.
#   Qwen2VLImageProcessor.__init__: patch/merge/temporal sizes, rescale factor, OPENAI_CLIP mean/std.
#   VisionRotaryEmbedding.__init__: theta (the vision tower never reads it from the config).
UPSTREAM_QUERY_PREFIX = "Query: "
UPSTREAM_PAGE_PROMPT = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the image.<|im_end|>"
    "<|endoftext|>"
)
UPSTREAM_IMAGE_TOKEN = "<|image_pad|>"
UPSTREAM_VISION_START_TOKEN = "<|vision_start|>"
QUERY_AUGMENTATION_COUNT = 10
UPSTREAM_IMAGE_PROCESSOR_DEFAULTS: dict[str, Any] = {
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "rescale_factor": 1 / 255,
    "image_mean": (0.48145466, 0.4578275, 0.40821073),
    "image_std": (0.26862954, 0.26130258, 0.27577711),
}
VISION_ROPE_THETA = 10000.0
RGB_CHANNELS = 3

# The only preprocessing colembed implements; a folder asking for anything else is refused.
_REQUIRED_FLAGS = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")
_REQUIRED_RESAMPLE = int(Image.Resampling.BICUBIC)


@dataclass(frozen=True)
class PreprocessConfig:
    """Constants of ColQwen2 preprocessing; JSON-able via `to_dict`/`from_dict` (the manifest)."""

    query_prefix: str
    query_augmentation_token: str
    query_augmentation_count: int
    page_prompt: str
    image_token: str
    image_token_id: int
    vision_start_token_id: int
    pad_token_id: int
    min_pixels: int
    max_pixels: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float
    vision_head_dim: int
    vision_rope_theta: float

    def __post_init__(self) -> None:
        problems = _validate(self)
        if problems:
            raise ValueError("invalid PreprocessConfig: " + "; ".join(problems))

    # -- derived numbers -------------------------------------------------------------------------

    @property
    def patch_dim(self) -> int:
        """Values per vision patch: channels x temporal x patch x patch (1176 for Qwen2-VL)."""
        return RGB_CHANNELS * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def resize_factor(self) -> int:
        """Side of one image token in pixels (patch x merge = 28); resized sides are multiples."""
        return self.patch_size * self.merge_size

    @property
    def pixels_per_image_token(self) -> int:
        return self.resize_factor**2

    @property
    def max_image_tokens(self) -> int:
        """Most image tokens a page gets under `max_pixels` (768 for ColQwen2's trained budget)."""
        return self.max_pixels // self.pixels_per_image_token

    @property
    def min_image_tokens(self) -> int:
        """Fewest image tokens a `max_pixels` budget may allow without dropping below `min_pixels`."""
        return -(-self.min_pixels // self.pixels_per_image_token)

    def with_max_image_tokens(self, k: int | None) -> PreprocessConfig:
        """The same config with `max_pixels = k * (patch*merge)**2`; `None` leaves it unchanged.

        Smart resize then yields at most k image tokens for any page whose aspect ratio leaves both
        sides above one token (the reference clamps a side to one token, 28 px, which can exceed
        the budget for extreme aspect ratios; colembed keeps the reference's arithmetic).
        """
        if k is None:
            return self
        if isinstance(k, bool) or not isinstance(k, int):
            raise InputTypeError(f"max image tokens must be an int or None, got {type(k).__name__}", item=k)
        if k < self.min_image_tokens:
            raise InputError(
                f"max image tokens {k} is below this model's minimum of {self.min_image_tokens} "
                f"(min_pixels {self.min_pixels} / {self.pixels_per_image_token} pixels per token)",
                item=k,
            )
        return replace(self, max_pixels=k * self.pixels_per_image_token)

    # -- serialisation ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types only (tuples become lists)."""
        out = asdict(self)
        out["image_mean"] = list(self.image_mean)
        out["image_std"] = list(self.image_std)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PreprocessConfig:
        """Inverse of `to_dict`; refuses missing or unknown keys (a manifest from another version)."""
        if not isinstance(d, dict):
            raise ManifestError(f"preprocess: expected a JSON object, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        missing, unknown = sorted(names - d.keys()), sorted(d.keys() - names)
        if missing or unknown:
            raise ManifestError(f"preprocess: missing keys {missing}, unknown keys {unknown}")
        values = {f.name: _typed(d[f.name], f.type, f"preprocess.{f.name}") for f in fields(cls)}
        try:
            return cls(**values)
        except ValueError as e:
            raise ManifestError(f"preprocess: {e}") from e

    # -- reading a checkpoint folder -------------------------------------------------------------

    @classmethod
    def from_checkpoint(cls, folder: str | Path) -> PreprocessConfig:
        """Read a Hugging Face ColQwen2 folder (config.json, preprocessor_config.json, tokenizer files)."""
        from ..families import family_of_backbone

        folder = Path(folder)
        raw_config = _read_json(folder / "config.json")
        family = family_of_backbone(raw_config, folder / "config.json")
        model_config = _vlm_config(raw_config)
        image_config = _read_json(folder / "preprocessor_config.json")
        processor_config = _read_json(folder / "processor_config.json", required=False)
        tokenizer_config = _read_json(folder / "tokenizer_config.json", required=False)
        special_tokens = _read_json(folder / "special_tokens_map.json", required=False)
        tokenizer = _load_tokenizer(folder / TOKENIZER_FILE)

        pad_token = _pad_token(tokenizer_config, special_tokens, folder)
        image_token = _image_token(tokenizer_config)
        vision_config = model_config.get("vision_config", {})
        preprocessor_path = folder / "preprocessor_config.json"
        _check_supported_pipeline(image_config, preprocessor_path)
        min_pixels, max_pixels = _pixel_bounds(image_config, preprocessor_path)
        defaults = UPSTREAM_IMAGE_PROCESSOR_DEFAULTS
        values = dict(
            query_prefix=_value_or(processor_config.get("query_prefix"), UPSTREAM_QUERY_PREFIX),
            query_augmentation_token=pad_token,
            query_augmentation_count=QUERY_AUGMENTATION_COUNT,
            page_prompt=_value_or(processor_config.get("visual_prompt_prefix"), UPSTREAM_PAGE_PROMPT),
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
            vision_rope_theta=VISION_ROPE_THETA,
            **_patch_geometry(image_config, vision_config, folder),
        )
        try:
            return cls(**values)
        except ValueError as e:
            raise ModelFolderError(str(e), path=folder) from e


def _typed(value: Any, annotation: str, where: str) -> Any:
    """A JSON value of a field annotated `str`, `int`, `float` or a tuple of floats, or
    ManifestError naming the field (bool is not an int; an int is a float)."""
    if annotation.startswith("tuple"):
        if not isinstance(value, list) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            raise ManifestError(f"{where}: expected a list of numbers, got {value!r:.60}")
        return tuple(float(v) for v in value)
    kind = {"str": str, "int": int, "float": (int, float)}[annotation]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ManifestError(f"{where}: expected {annotation}, got {type(value).__name__} {value!r:.60}")
    return float(value) if annotation == "float" else value


# -- helpers for from_checkpoint -----------------------------------------------------------------


def _read_json(path: Path, *, required: bool = True) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelFolderError("missing file (is this a Hugging Face ColQwen2 folder?)", path=path)
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
    pad = _token_text(tokenizer_config.get("pad_token")) or _token_text(special_tokens.get("pad_token"))
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
    return UPSTREAM_IMAGE_TOKEN


def _token_id(tokenizer, token: str, model_config: dict, key: str, folder: Path) -> int:
    """Id of `token` from the tokenizer; must agree with `model_config[key]` when the config has it."""
    from_tokenizer = tokenizer.token_to_id(token)
    from_config = model_config.get(key)
    if from_tokenizer is None:
        raise ModelFolderError(f"token {token!r} is not in {TOKENIZER_FILE}", path=folder / TOKENIZER_FILE)
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
        value = image_config.get(key, vision_config.get(vision_key, UPSTREAM_IMAGE_PROCESSOR_DEFAULTS[key]))
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
            f"resample={resample}; colembed implements PIL BICUBIC ({_REQUIRED_RESAMPLE}) only", path=path
        )


def _validate(config: PreprocessConfig) -> list[str]:
    """Every problem with a config, not just the first."""
    problems = []
    for name in ("patch_size", "merge_size", "temporal_patch_size", "vision_head_dim", "min_pixels"):
        if getattr(config, name) < 1:
            problems.append(f"{name} must be >= 1, got {getattr(config, name)}")
    for name in ("image_token_id", "vision_start_token_id", "pad_token_id"):
        if getattr(config, name) < 0:
            problems.append(f"{name} must be >= 0, got {getattr(config, name)}")
    for name in ("rescale_factor", "vision_rope_theta"):
        if not getattr(config, name) > 0:
            problems.append(f"{name} must be > 0, got {getattr(config, name)}")
    if config.max_pixels < config.min_pixels:
        problems.append(f"max_pixels {config.max_pixels} < min_pixels {config.min_pixels}")
    if len(config.image_mean) != RGB_CHANNELS or len(config.image_std) != RGB_CHANNELS:
        problems.append("image_mean and image_std need one value per RGB channel")
    if any(s == 0 for s in config.image_std):
        problems.append("image_std must not contain 0")
    if config.query_augmentation_count < 0:
        problems.append("query_augmentation_count must be >= 0")
    if config.page_prompt.count(config.image_token) != 1:
        problems.append(f"page_prompt must contain {config.image_token!r} exactly once")
    if config.vision_head_dim % 4:
        problems.append(f"vision_head_dim {config.vision_head_dim} must divide by 4 (2-D rotary halves)")
    return problems


__all__ = ["PreprocessConfig", "QUERY_AUGMENTATION_COUNT", "VISION_ROPE_THETA"]
