"""The check before an export is written: colembed's runtime against the unpatched torch model.

Sample pages (several grids, odd sizes, an RGBA one) and queries (plain, empty, CJK) go through
(a) the reference: transformers' ColQwen2Processor + the checkpoint's own ColQwen2ForRetrieval,
one item at a time, and (b) the staged folder loaded with `colembed.load`, in one batch. Every
comparison is collected with its max abs difference before one error is raised, so a failure
report says where the two diverge (image features or final embeddings, which item).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from colembed.errors import ExportError

SAMPLE_QUERIES = ("What was the revenue in 2023?", "", "表格中的数字是多少？ <|image_pad|>")


def sample_pages() -> list[Any]:
    """Deterministic synthetic pages: a text-like page, a small photo, a wide RGBA strip."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(0)
    page = Image.new("RGB", (300, 420), "white")
    draw = ImageDraw.Draw(page)
    for row in range(12):
        y = 20 + row * 32
        draw.rectangle([20, y, 20 + int(rng.integers(80, 260)), y + 12], fill=(20, 20, 20))
    photo = Image.fromarray(rng.integers(0, 256, (91, 57, 3), dtype=np.uint8))
    strip = Image.fromarray(rng.integers(0, 256, (60, 400, 4), dtype=np.uint8), "RGBA")
    return [page, photo, strip]


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def verify_export(model, checkpoint_folder, staged_folder, *, tolerance: float) -> dict[str, Any]:
    """Compare; return the figures for the manifest, or raise ExportError listing divergences."""
    import torch
    from transformers import ColQwen2Processor

    import colembed

    processor = ColQwen2Processor.from_pretrained(checkpoint_folder, use_fast=False)
    runtime = colembed.load(staged_folder, verify=True)
    pages = sample_pages()
    failures: list[str] = []
    figures: dict[str, float] = {}

    def compare(label: str, got: np.ndarray, want: np.ndarray) -> None:
        diff = _max_abs(got, want)
        figures[label] = diff
        if not diff <= tolerance:
            failures.append(f"{label}: max abs diff {diff:.3e} (shapes {got.shape} vs {want.shape})")

    visual = model.vlm.model.visual
    with torch.no_grad():
        runtime_features = runtime.image_features(pages)
        runtime_pages = runtime.embed_images(pages, batch_size=len(pages))
        for i, page in enumerate(pages):
            batch = processor.process_images([page])
            grid = batch["image_grid_thw"]
            n = int(grid[0, 1] * grid[0, 2])
            want = visual(batch["pixel_values"][0, :n], grid_thw=grid).numpy()
            compare(f"page {i} image features", runtime_features[i], want)
            want = model(**batch).embeddings[0][batch["attention_mask"][0] == 1].numpy()
            compare(f"page {i} embeddings", runtime_pages[i], want)

        runtime_queries = runtime.embed_queries(list(SAMPLE_QUERIES))
        for i, query in enumerate(SAMPLE_QUERIES):
            batch = processor.process_queries([query])
            want = model(**batch).embeddings[0][batch["attention_mask"][0] == 1].numpy()
            compare(f"query {i} embeddings", runtime_queries[i], want)

    report = {
        "tolerance": tolerance,
        "max_abs_diff": max(figures.values()),
        "comparisons": figures,
        "pages": len(pages),
        "queries": len(SAMPLE_QUERIES),
    }
    if failures:
        raise ExportError("the exported graphs diverge from the torch model; nothing was written:\n  "
                          + "\n  ".join(failures))
    return report
