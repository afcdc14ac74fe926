"""Deterministic test images, generated in code (no image files in the repository).

Each case is a function returning encoded bytes or a PIL image, built from numpy's seeded
generator, so a failure reproduces exactly. Large cases tile a small noise block instead of drawing
hundreds of millions of random numbers.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageDraw


def noise(width: int, height: int, *, seed: int = 0, channels: int = 3) -> np.ndarray:
    """(height, width, channels) uint8 noise; above 1 Mpx a 512x512 block is tiled, with a
    gradient added so tiles differ."""
    rng = np.random.default_rng(seed)
    shape = (height, width, channels) if channels > 1 else (height, width)
    if width * height <= 1_000_000:
        return rng.integers(0, 256, shape, dtype=np.uint8)
    block = rng.integers(0, 256, (512, 512) + shape[2:], dtype=np.uint8)
    reps = (-(-height // 512), -(-width // 512)) + (1,) * (len(shape) - 2)
    tiled = np.tile(block, reps)[:height, :width]
    ramp = (np.arange(height, dtype=np.uint16)[:, None] * 7 + np.arange(width, dtype=np.uint16)[None, :] * 3) % 256
    if len(shape) == 3:
        ramp = ramp[:, :, None]
    return (tiled.astype(np.uint16) + ramp).astype(np.uint8)


def rgb(width: int, height: int, *, seed: int = 0) -> Image.Image:
    return Image.fromarray(noise(width, height, seed=seed), "RGB")


def rgba_with_transparency(width: int = 300, height: int = 200, *, seed: int = 1) -> Image.Image:
    """Noise colours; alpha 0 on the left third, 128 in the middle, 255 on the right."""
    pixels = noise(width, height, seed=seed, channels=4)
    pixels[:, : width // 3, 3] = 0
    pixels[:, width // 3 : 2 * width // 3, 3] = 128
    pixels[:, 2 * width // 3 :, 3] = 255
    return Image.fromarray(pixels, "RGBA")


def grayscale(width: int = 257, height: int = 311, *, seed: int = 2) -> Image.Image:
    return Image.fromarray(noise(width, height, seed=seed, channels=1), "L")


def palette(width: int = 320, height: int = 240, *, seed: int = 3) -> Image.Image:
    return rgb(width, height, seed=seed).convert("P", palette=Image.Palette.ADAPTIVE, colors=64)


def encode(image: Image.Image, fmt: str, **params) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **params)
    return buffer.getvalue()


def cmyk_jpeg(width: int = 400, height: int = 300, *, seed: int = 4) -> bytes:
    return encode(rgb(width, height, seed=seed).convert("CMYK"), "JPEG", quality=90)


def gray16_png(width: int = 350, height: int = 250, *, seed: int = 5) -> bytes:
    """A 16-bit grayscale PNG; decodes to mode I;16."""
    values = np.random.default_rng(seed).integers(0, 65536, (height, width), dtype=np.uint16)
    return encode(Image.fromarray(values), "PNG")


def document_page(width: int = 1275, height: int = 1650, *, seed: int = 6) -> Image.Image:
    """A letter page at 150 dpi: white paper, lines of text, boxes and a grey figure."""
    rng = np.random.default_rng(seed)
    page = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(page)
    words = ["revenue", "quarter", "total", "growth", "2024", "table", "figure", "net", "cost"]
    y = 90
    while y < height - 120:
        line = " ".join(rng.choice(words, size=12))
        draw.text((100, y), line, fill=(20, 20, 20))
        y += 22
        if rng.random() < 0.08:
            x0, y0 = int(rng.integers(100, width // 2)), y
            draw.rectangle((x0, y0, x0 + 400, y0 + 160), outline=(0, 0, 0), fill=(220, 220, 235))
            y += 180
    return page


def open_bytes(data: bytes) -> Image.Image:
    """The PIL image a user would hand the reference for these bytes."""
    return Image.open(io.BytesIO(data))


def animated(fmt: str = "GIF", frames: int = 3, *, seed: int = 10) -> bytes:
    """A multi-frame file (GIF or TIFF); decoders show the first frame."""
    images = [rgb(90, 60, seed=seed + i) for i in range(frames)]
    buffer = io.BytesIO()
    images[0].save(buffer, format=fmt, save_all=True, append_images=images[1:])
    return buffer.getvalue()


def keyed_transparency(fmt: str = "PNG", mode: str = "P") -> bytes:
    """A page whose file carries a single-colour transparency key (a tRNS chunk, GIF's
    transparent index): a 250x170 noise page `.quantize(12)` with index 5 transparent (mode
    "P"), or its L / RGB version keyed on its first pixel's value."""
    page = rgb(250, 170, seed=5)
    if mode == "P":
        return encode(page.quantize(12), fmt, transparency=5)
    image = page.convert(mode)
    return encode(image, fmt, transparency=image.getpixel((0, 0)))
