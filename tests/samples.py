"""Queries and pages shared by the parity and ranking tests: the inputs users hand us."""

from __future__ import annotations

import numpy as np
from PIL import Image

QUERIES = [
    "What was the revenue in 2023?",
    "",
    "表格中的数字是多少？",
    "emoji 🚀📄 ranking",
    "tabs\tand\nnewlines\r\n",
    "   leading and trailing   ",
    "1234567890 !!!??? ... ---",
    "contains <|image_pad|> and <|endoftext|> strings",
    "a" * 300,
    "Quarterly report: EBITDA margin (%) vs. prior year",
    "Qué es la energía? Ça va. Straße",
    "x",
]


def _pages() -> dict[str, Image.Image]:
    """Eight pages on different grids, in the sizes and modes users hand us."""
    rng = np.random.default_rng(42)

    def noise(h, w, c=3):
        return rng.integers(0, 256, (h, w, c) if c > 1 else (h, w), dtype=np.uint8)

    palette = Image.fromarray(noise(90, 130)).convert("P", palette=Image.Palette.ADAPTIVE)
    rgba = noise(120, 80, 4)
    rgba[:40, :, 3] = 0  # transparent band: alpha is dropped, not composited
    pages = {
        "tiny_20x20": Image.fromarray(noise(20, 20)),
        "odd_997x613": Image.fromarray(noise(613, 997)),
        "tall_40x300": Image.fromarray(noise(300, 40)),
        "rgba_80x120": Image.fromarray(rgba),
        "gray_L": Image.fromarray(noise(150, 110, 1)),
        "palette_P": palette,
        "cmyk": Image.frombytes("CMYK", (70, 100), noise(100, 70, 4).tobytes()),
        "gray16": Image.fromarray(noise(64, 96, 1).astype(np.uint16) * 257),
    }
    modes = {name: img.mode for name, img in pages.items()}
    assert modes["rgba_80x120"] == "RGBA" and modes["gray_L"] == "L" and modes["cmyk"] == "CMYK"
    assert modes["gray16"].startswith("I;16"), modes
    return pages


PAGES = _pages()
