"""The preprocessing constants of a ColQwen2-family model: one type, its derived numbers, its checks.

Owns `PreprocessConfig`: the prompt templates, the token ids, the pixel bounds, the patch geometry,
the normalisation constants and the vision rotary constants that `text.py`, `images.py` and
`positions.py` need, and the only place these numbers live. The runtime builds it from the
manifest (`from_dict`); the exporter reads it from a checkpoint's files
(`colembed_export.families.preprocess_config.read_preprocess_config`, which says where each value comes
from) and writes it into the manifest (`to_dict`).

Imports only the standard library and colembed's errors.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from ..errors import InputError, InputTypeError, ManifestError

# transformers 4.57.1 Qwen2VLImageProcessor.__init__'s defaults (the image pipeline's own: the
# checkpoint reader fills what a folder leaves out from them, `images.py` defaults to merge_size).
UPSTREAM_IMAGE_PROCESSOR_DEFAULTS: dict[str, Any] = {
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "rescale_factor": 1 / 255,
    "image_mean": (0.48145466, 0.4578275, 0.40821073),
    "image_std": (0.26862954, 0.26130258, 0.27577711),
}
RGB_CHANNELS = 3


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
    # TomoroAI's ColQwen3 processor strips the query text before adding prefix and suffix
    # (colembed_export.families.qwen3.layouts); every other processor keeps it as given. Written to the
    # manifest only when set, so other folders' manifests are unchanged.
    query_strip: bool = False

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
            raise InputTypeError(
                f"max image tokens must be an int or None, got {type(k).__name__}", item=k
            )
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
        for name in _WRITTEN_WHEN_SET:
            if not out[name]:
                del out[name]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PreprocessConfig:
        """Inverse of `to_dict`; refuses missing or unknown keys (a manifest from another version)."""
        if not isinstance(d, dict):
            raise ManifestError(f"preprocess: expected a JSON object, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        missing = sorted(names - d.keys() - set(_WRITTEN_WHEN_SET))
        unknown = sorted(d.keys() - names)
        if missing or unknown:
            raise ManifestError(f"preprocess: missing keys {missing}, unknown keys {unknown}")
        values = {
            f.name: _typed(d[f.name], f.type, f"preprocess.{f.name}")
            for f in fields(cls)
            if f.name in d
        }
        try:
            return cls(**values)
        except ValueError as e:
            raise ManifestError(f"preprocess: {e}") from e


# Fields with a default that `to_dict` leaves out when they hold it (older manifests lack them).
_WRITTEN_WHEN_SET = ("query_strip",)


def _typed(value: Any, annotation: str, where: str) -> Any:
    """A JSON value of a field annotated `str`, `int`, `float`, `bool` or a tuple of floats, or
    ManifestError naming the field (bool is not an int; an int is a float)."""
    if annotation == "bool":
        if not isinstance(value, bool):
            raise ManifestError(f"{where}: expected bool, got {type(value).__name__} {value!r:.60}")
        return value
    if annotation.startswith("tuple"):
        if not isinstance(value, list) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
        ):
            raise ManifestError(f"{where}: expected a list of numbers, got {value!r:.60}")
        return tuple(float(v) for v in value)
    kind = {"str": str, "int": int, "float": (int, float)}[annotation]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ManifestError(
            f"{where}: expected {annotation}, got {type(value).__name__} {value!r:.60}"
        )
    return float(value) if annotation == "float" else value


def _validate(config: PreprocessConfig) -> list[str]:
    """Every problem with a config, not just the first."""
    problems = []
    for name in (
        "patch_size",
        "merge_size",
        "temporal_patch_size",
        "vision_head_dim",
        "min_pixels",
    ):
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
        problems.append(
            f"vision_head_dim {config.vision_head_dim} must divide by 4 (2-D rotary halves)"
        )
    return problems


__all__ = ["PreprocessConfig", "RGB_CHANNELS", "UPSTREAM_IMAGE_PROCESSOR_DEFAULTS"]
