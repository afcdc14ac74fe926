"""Page images to vision patches in numpy, bit-identical to Qwen2VLImageProcessor (PIL, slow).

Owns decoding (`load_image`, `open_image`: the formats decoded, `IMAGE_FORMATS`, and the one pixel
limit, `pixel_limit`), the resized size (`smart_resize`, `resized_grid`: the one function
both preprocessing and token counting use) and patch extraction (`prepare_image`).

Mirrors transformers 4.57.1 `ColQwen2Processor.process_images` ->
`Qwen2VLImageProcessor._preprocess`, step for step, with the same arithmetic:

1. `image.convert("RGB")` unless already RGB (alpha dropped, not composited; EXIF not applied).
   That is ColQwen2 / 2.5's rule; ColQwen3's reference (transformers 5.x) also composites a page
   still carrying a transparency key onto white: each family declares its rule
   (`Family.transparency`, `to_rgb`).
2. `smart_resize` to multiples of patch*merge (28) within [min_pixels, max_pixels], then PIL
   `resize((w, h), BICUBIC)` on the uint8 RGB image (skipped when the size is unchanged: PIL would
   return an identical copy).
3. rescale and normalise: the reference computes `float32(float64(u8) * rescale_factor)` and then
   `(x - float32(mean)) / float32(std)` in float32. Both steps depend on the uint8 value and the
   channel only, so they are precomputed into a (3, 256) float32 table with exactly those
   operations and applied by lookup (max abs diff 0, measured).
4. patchify: one (1, T, 3, gh/m, m, p, gw/m, m, p) -> (0, 3, 6, 4, 7, 2, 1, 5, 8) layout, with the
   single frame duplicated along T (temporal_patch_size), done on uint8 before the lookup.
   Output `patches` is (gh*gw, 3*T*p*p) float32, rows grouped by m x m merge block, i.e. the
   reference's unpadded `pixel_values` rows for this image. `grid_thw = (1, gh, gw)`.

Deliberate deviation: transformers infers the channel axis from the array shape, so an RGB image
1 or 3 pixels tall, (1|3, W, 3), is read as channels-first: 1 px tall raises inside the
reference, 3 px tall is silently transposed into garbage. colembed always reads channels-last,
which equals the reference called with `input_data_format="channels_last"`.

Never imports torch or transformers.
"""

from __future__ import annotations

import io
import math
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import BinaryIO, Union

import numpy as np
from PIL import Image, UnidentifiedImageError

from ..errors import ImageError, InputTypeError
from .config import RGB_CHANNELS, UPSTREAM_IMAGE_PROCESSOR_DEFAULTS, PreprocessConfig

UINT8_LEVELS = 256
MAX_ASPECT_RATIO = 200  # smart_resize's limit in the reference
_RESAMPLE = Image.Resampling.BICUBIC

# What PIL's format plugins may raise on malformed data: not only OSError (corrupt multi-frame
# TIFFs give TypeError, KeyError and SyntaxError; other plugins struct.error, EOFError, IndexError,
# ZeroDivisionError). Any of them while decoding one page is that page's ImageError, so nothing
# escapes the per-item contract (tests/runtime/test_fuzz.py).
DECODER_ERRORS = (
    OSError,
    SyntaxError,
    ValueError,
    TypeError,
    LookupError,
    EOFError,
    struct.error,
    ArithmeticError,
    AttributeError,
    RuntimeError,
    AssertionError,
    MemoryError,
)

# What `load_image` and `prepare_image` accept.
ImageInput = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, BinaryIO, Image.Image]


@dataclass(frozen=True)
class PreparedImage:
    """One page ready for the vision graph.

    patches: (grid_h*grid_w, patch_dim) float32, merge-block order.
    grid_thw: (1, grid_h, grid_w) in patches (grid_h = resized height / patch size).
    merge_size: patches per image token along each side (2 for Qwen2-VL).
    """

    patches: np.ndarray
    grid_thw: tuple[int, int, int]
    merge_size: int = UPSTREAM_IMAGE_PROCESSOR_DEFAULTS["merge_size"]

    @property
    def num_image_tokens(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w // self.merge_size**2


# -- decoding ------------------------------------------------------------------------------------

# The formats colembed decodes, by PIL format id, with the file suffixes the index takes for them
# (sources.py reads them from here). Every decode opens with these plugins only
# (`Image.open(..., formats=...)`): by default PIL identifies a file by its content among every
# plugin it has, and its EPS plugin hands such a file to Ghostscript, an interpreter with a record
# of sandbox escapes, whatever the file is called. A JPEG with several pictures (MPO) is a JPEG.
IMAGE_FORMATS: dict[str, tuple[str, ...]] = {
    "PNG": (".png",),
    "JPEG": (".jpg", ".jpeg"),
    "TIFF": (".tif", ".tiff"),
    "WEBP": (".webp",),
    "BMP": (".bmp",),
    "GIF": (".gif",),
}
_FORMAT_IDS = tuple(IMAGE_FORMATS)

# How a family's pinned reference turns a decoded page into RGB (families.py declares which):
# - TRANSPARENCY_DROPPED: `image.convert("RGB")` (colpali-engine's processors, then transformers
#   4.57.1's `convert_to_rgb`, a no-op on RGB): alpha and a transparency key are dropped, the
#   pixels under them keep their colour.
# - TRANSPARENCY_ON_WHITE: the same `convert("RGB")`, then transformers 5.x's `convert_to_rgb`,
#   which composites onto white any image that still carries a transparency key (`convert`
#   keeps a palette, L or RGB image's single-colour tRNS key as an RGB one): those pixels become
#   white. Alpha channels (RGBA, LA, PA) are already gone after the first step.
TRANSPARENCY_DROPPED = "dropped"
TRANSPARENCY_ON_WHITE = "on white"
TRANSPARENCY_RULES = (TRANSPARENCY_DROPPED, TRANSPARENCY_ON_WHITE)


def pixel_limit() -> int | None:
    """The most pixels (width x height) colembed decodes or renders for one page, on every path
    (`embed_images`, `colembed index`, serve jobs and uploads, Ray): PIL's
    `Image.MAX_IMAGE_PIXELS`, read at each call, so setting it (None lifts it) moves them all."""
    return Image.MAX_IMAGE_PIXELS


def check_pixels(size: tuple[int, int], *, index: int | None = None, item=None) -> None:
    """ImageError unless `size` (width, height) is non-empty and within `pixel_limit()`."""
    width, height = size
    if width <= 0 or height <= 0:
        raise ImageError(f"zero-size image ({width}x{height})", index=index, item=item)
    limit = pixel_limit()
    if limit is not None and width * height > limit:
        raise ImageError(
            f"decompression bomb refused: {width}x{height} = {width * height} pixels exceeds "
            f"the limit of {limit} (PIL.Image.MAX_IMAGE_PIXELS)",
            index=index,
            item=item,
        )


def open_image(source, *, index: int | None = None, item=None) -> Image.Image:
    """`source` (a path or a binary file object) opened as one of `IMAGE_FORMATS`, its declared
    size checked against `pixel_limit()` before a pixel is decoded (PIL opens lazily). Raises
    ImageError naming `index` for anything else: another format, a bomb, unreadable data."""
    try:
        image = Image.open(source, formats=_FORMAT_IDS)
    except UnidentifiedImageError as e:
        raise ImageError(
            "not an image of a format colembed reads "
            f"({', '.join(IMAGE_FORMATS)}; no decoder recognises the data)",
            index=index,
            item=item,
        ) from e
    except FileNotFoundError as e:
        raise ImageError(
            f"no such file: {item if item is not None else source}", index=index, item=item
        ) from e
    except (Image.DecompressionBombError, *DECODER_ERRORS) as e:
        raise _decoding_error(e, index=index, item=item) from e
    try:
        check_pixels(image.size, index=index, item=item)
    except ImageError:
        image.close()  # closes the file only if PIL opened it (a path)
        raise
    return image


def load_image(
    obj: ImageInput, *, index: int = 0, transparency: str = TRANSPARENCY_DROPPED
) -> Image.Image:
    """Decode `obj` to an RGB PIL image, as the family's reference does (`transparency`: its
    declared rule, see TRANSPARENCY_RULES).

    Accepts a path (str or os.PathLike), bytes/bytearray/memoryview, a binary file object, or a
    PIL image. Raises ImageError (naming `index` and the reason) for data that is not a decodable
    image of `IMAGE_FORMATS`: another format, corrupt or truncated data, zero-size images, and
    decompression bombs (more pixels than `pixel_limit()`, PIL's `Image.MAX_IMAGE_PIXELS`; set it
    to None to lift the limit; PIL also emits its DecompressionBombWarning). Raises
    InputTypeError for other Python types.
    """
    if isinstance(obj, Image.Image):
        check_pixels(obj.size, index=index, item=obj)
        return _decoded_rgb(obj, transparency, index=index, item=obj)
    source = _as_source(obj, index)
    owns_file = source is not obj or isinstance(
        obj, (str, os.PathLike)
    )  # not a caller's file object
    return _open_rgb(source, owns_file, transparency, index=index, item=obj)


def _open_rgb(source, owns_file: bool, transparency: str, *, index: int, item) -> Image.Image:
    """Open, check the size, decode to RGB; a multi-frame file is copied so it can be closed."""
    opened = open_image(source, index=index, item=item)
    rgb = None
    try:
        rgb = _decoded_rgb(opened, transparency, index=index, item=item)
        if rgb is opened and owns_file and getattr(opened, "n_frames", 1) > 1:
            rgb = opened.copy()  # PIL keeps a multi-frame file (MPO, TIFF) open after load()
    finally:
        # Image.close() also closes the file it read from: a caller's file object is left alone.
        if owns_file and rgb is not opened:
            opened.close()
    return rgb


def _as_source(obj: object, index: int):
    """What `Image.open` accepts, for the input types colembed supports."""
    if isinstance(obj, (str, os.PathLike)):
        return obj
    if isinstance(obj, (bytes, bytearray, memoryview)):
        if len(obj) == 0:
            raise ImageError("empty bytes (zero-size image data)", index=index, item=obj)
        return io.BytesIO(obj)
    if hasattr(obj, "read"):
        return obj
    raise InputTypeError(
        f"cannot read an image from {type(obj).__name__}; pass a path, bytes, a binary file "
        "object or a PIL image",
        index=index,
        item=obj,
    )


def to_rgb(image: Image.Image, transparency: str = TRANSPARENCY_DROPPED) -> Image.Image:
    """A decoded image as RGB by the family's rule (`TRANSPARENCY_RULES`); an RGB image without
    a transparency key is returned as it is (both references leave it unchanged)."""
    if transparency not in TRANSPARENCY_RULES:
        raise ValueError(f"transparency rule {transparency!r} is not one of {TRANSPARENCY_RULES}")
    keyed = image.info.get("transparency") is not None
    if image.mode == "RGB" and not (keyed and transparency == TRANSPARENCY_ON_WHITE):
        return image
    rgb = image.convert("RGB")
    if transparency == TRANSPARENCY_DROPPED or rgb.info.get("transparency") is None:
        return rgb
    rgba = rgb.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def _decoded_rgb(image: Image.Image, transparency: str, *, index: int, item) -> Image.Image:
    """The family's RGB (`to_rgb`), decoded here so that corrupt or truncated data fails with
    the item's index."""
    try:
        image.load()
        return to_rgb(image, transparency)
    except (Image.DecompressionBombError, *DECODER_ERRORS) as e:
        raise _decoding_error(e, index=index, item=item) from e


def _decoding_error(e: Exception, *, index: int | None, item) -> ImageError:
    """A decoder's failure (PIL's bomb check, or DECODER_ERRORS) as the ImageError naming the
    item."""
    if isinstance(e, Image.DecompressionBombError):
        return ImageError(f"decompression bomb refused: {e}", index=index, item=item)
    return ImageError(f"cannot decode image: {type(e).__name__}: {e}", index=index, item=item)


# -- sizes ---------------------------------------------------------------------------------------


def smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(resized height, resized width): transformers 4.57.1 `qwen2_vl.smart_resize`, line for line.

    Raises ImageError when the aspect ratio exceeds 200 (the reference raises ValueError).
    """
    if min(height, width) <= 0:
        raise ImageError(f"zero-size image ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(
            f"aspect ratio {max(height, width) / min(height, width):.1f} of a {width}x{height} image "
            f"exceeds ColQwen2's limit of {MAX_ASPECT_RATIO}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resized_grid(height: int, width: int, config: PreprocessConfig) -> tuple[int, int, int]:
    """(1, grid_h, grid_w) in patches for an image of this size: the one place sizes are derived,
    used by `prepare_image` and by token counting alike."""
    h_bar, w_bar = smart_resize(
        height,
        width,
        factor=config.resize_factor,
        min_pixels=config.min_pixels,
        max_pixels=config.max_pixels,
    )
    return 1, h_bar // config.patch_size, w_bar // config.patch_size


def num_image_tokens(height: int, width: int, config: PreprocessConfig) -> int:
    """Image tokens (language-model positions) a page of this size becomes."""
    t, h, w = resized_grid(height, width, config)
    return t * h * w // config.merge_size**2


# -- patches -------------------------------------------------------------------------------------


def prepare_image(
    obj: ImageInput,
    config: PreprocessConfig,
    *,
    index: int = 0,
    transparency: str = TRANSPARENCY_DROPPED,
) -> PreparedImage:
    """Decode (by the family's `transparency` rule), resize, normalise and patchify one page (see
    the module docstring)."""
    image = load_image(obj, index=index, transparency=transparency)
    try:
        grid = resized_grid(image.height, image.width, config)
    except ImageError as e:
        raise ImageError(e.reason, index=index, item=obj) from e
    _, grid_h, grid_w = grid
    size = (grid_w * config.patch_size, grid_h * config.patch_size)  # PIL order: (width, height)
    if image.size != size:
        image = image.resize(size, _RESAMPLE)
    pixels = np.asarray(image)  # (H, W, 3) uint8
    patches = _patchify(pixels, config)
    return PreparedImage(patches=patches, grid_thw=grid, merge_size=config.merge_size)


def _patchify(pixels: np.ndarray, config: PreprocessConfig) -> np.ndarray:
    """(H, W, 3) uint8 -> (gh*gw, 3*T*p*p) float32 in the reference's patch order and values."""
    p, m, frames = config.patch_size, config.merge_size, config.temporal_patch_size
    grid_h, grid_w = pixels.shape[0] // p, pixels.shape[1] // p
    rows = grid_h * grid_w
    # (bh, mh, ph, bw, mw, pw, c) -> (bh, bw, mh, mw, c, ph, pw): the reference's row/column
    # order without the time axis, on uint8 (4x less memory traffic than on float32).
    blocks = pixels.reshape(grid_h // m, m, p, grid_w // m, m, p, RGB_CHANNELS)
    blocks = np.ascontiguousarray(blocks.transpose(0, 3, 1, 4, 6, 2, 5)).reshape(
        rows, RGB_CHANNELS, p * p
    )
    table, channel_offset = _normalisation_table(
        config.rescale_factor, config.image_mean, config.image_std
    )
    values = np.take(table, blocks + channel_offset)  # (rows, 3, p*p) float32
    out = np.empty((rows, RGB_CHANNELS, frames, p * p), dtype=np.float32)
    out[...] = values[:, :, None, :]  # the single frame, repeated along time
    return out.reshape(rows, config.patch_dim)


@lru_cache(maxsize=8)
def _normalisation_table(
    rescale_factor: float, mean: tuple[float, ...], std: tuple[float, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """Flat (3*256,) float32 table of the reference's rescale+normalise per channel and uint8 value,
    and the (1, 3, 1) uint16 offsets that select each channel's row.

    Same operations as transformers' `rescale` (float64 multiply, cast to float32) and `normalize`
    (float32 subtract, float32 divide, with mean/std cast to float32).
    """
    levels = np.arange(UINT8_LEVELS, dtype=np.uint8).astype(np.float64)
    rescaled = (levels * rescale_factor).astype(np.float32)
    mean32 = np.array(mean, dtype=np.float32)[:, None]
    std32 = np.array(std, dtype=np.float32)[:, None]
    table = (rescaled[None, :] - mean32) / std32
    offsets = (np.arange(RGB_CHANNELS, dtype=np.uint16) * UINT8_LEVELS).reshape(1, RGB_CHANNELS, 1)
    flat = np.ascontiguousarray(table, dtype=np.float32).ravel()
    flat.setflags(write=False)
    offsets.setflags(write=False)
    return flat, offsets


__all__ = [
    "ImageInput",
    "PreparedImage",
    "load_image",
    "num_image_tokens",
    "prepare_image",
    "resized_grid",
    "smart_resize",
]
