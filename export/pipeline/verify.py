"""The check before an export is written: colembed's runtime against the unpatched torch model.

Sample pages (several grids, odd sizes, an RGBA one) and queries (plain, empty, CJK) go through
(a) the reference: transformers' ColQwen2Processor + the checkpoint's own ColQwen2ForRetrieval,
one item at a time, and (b) the staged folder through colembed's runtime, in one batch, one
graph's session open at a time (`_comparisons`).

Two kinds of bound, because the tensors live at different scales:
- the final embeddings (unit-norm rows, what users consume) get an absolute bound per token;
- intermediate tensors (the image features) are judged relative to their own scale,
  max |got - want| / max |want|: trained vision towers emit features in the hundreds, where fp32
  rounding alone gives ~3e-4 absolute while the embeddings still match to ~6e-7.

The reference runs first and only its outputs are kept (`reference_outputs`), so the caller can
free the torch model before the onnxruntime sessions are loaded (`compare_with_reference`). Every
comparison is collected with its figure before one error is raised (as optimum's validation does),
so a failure report says where the two diverge (image features or final embeddings, which item).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from colembed.errors import ExportError

# The check's onnxruntime sessions compute from the graphs' weights where they lie: on the CPU
# onnxruntime maps a graph's external data file (its large tensors are page-aligned) and, with
# prepacking off, its GEMMs read the mapped weights instead of packing a copy of each in anonymous
# memory. The mapped pages are the file's, which the kernel can drop under pressure; the copies
# were the whole model (benchmarks/results/export/streamed.md). Unpacked GEMMs sum in another
# order: their outputs are a user's session's within fp32 rounding, far inside the bound
# (`tests/export/pipeline/test_offloaded.py`).
CHECK_SESSION_CONFIG = {"session.disable_prepacking": "1"}

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


@dataclass(frozen=True)
class Reference:
    """What the torch model produced on the sample inputs (real rows only), as numpy arrays."""

    image_features: list[np.ndarray]
    pages: list[np.ndarray]
    queries: list[np.ndarray]


@dataclass(frozen=True)
class Comparison:
    """One tensor compared: its figure, the bound it is held to and how that bound is meant."""

    label: str
    figure: float
    bound: float
    kind: str  # "absolute" (max abs diff) or "relative" (max abs diff / max abs of the reference)

    @property
    def ok(self) -> bool:
        return self.figure <= self.bound  # NaN fails

    def describe(self) -> str:
        what = "max abs diff" if self.kind == "absolute" else "max abs diff / max abs"
        verdict = "ok  " if self.ok else "FAIL"
        return f"{verdict} {self.label}: {what} {self.figure:.3e} (bound {self.bound:.0e})"


def max_abs_diff(got: np.ndarray, want: np.ndarray) -> float:
    if got.shape != want.shape:
        return float("inf")
    return float(np.max(np.abs(got - want))) if want.size else 0.0


def relative_diff(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want|: a figure that means the same at any feature scale."""
    diff = max_abs_diff(got, want)
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    return diff / scale if scale > 0 else diff


def reference_outputs(model, checkpoint_folder: Path) -> Reference:
    """Run the unpatched torch model on the sample inputs, one item at a time."""
    from transformers import ColQwen2Processor

    processor = ColQwen2Processor.from_pretrained(checkpoint_folder, use_fast=False)
    return reference_on_samples(model, processor)


def reference_on_samples(
    model,
    processor,
    *,
    image_features: Callable[[Any], Any] = lambda tower_output: tower_output,
    query_text: Callable[[str], str] = lambda query: query,
) -> Reference:
    """The torch model's image features and unpadded token embeddings for each sample page and
    query, one item at a time through `processor`. `image_features` picks the features from what
    the vision tower returns; `query_text` is the text the processor is given for a query."""
    import torch

    visual = model.vlm.model.visual
    features, pages, queries = [], [], []
    with torch.no_grad():
        for page in sample_pages():
            batch = processor.process_images([page])
            grid = batch["image_grid_thw"]
            n = int(grid[0, 1] * grid[0, 2])
            tower_output = visual(batch["pixel_values"][0, :n], grid_thw=grid)
            features.append(image_features(tower_output).numpy())
            pages.append(model(**batch).embeddings[0][batch["attention_mask"][0] == 1].numpy())
        for query in SAMPLE_QUERIES:
            batch = processor.process_queries([query_text(query)])
            queries.append(model(**batch).embeddings[0][batch["attention_mask"][0] == 1].numpy())
    return Reference(image_features=features, pages=pages, queries=queries)


def reference_processor_qwen3(checkpoint_folder: Path):
    """(processor, the folder's PreprocessConfig): colpali-engine 0.3.18 ColQwen3Processor's
    semantics from 4.57.1's classes (ColQwen2Processor's prompts with query prefix "", the PIL
    Qwen2VLImageProcessor at the folder's patch, mean/std and bounds). The folder's constants
    are colembed's reading of it (bounds from min/max_pixels or size, a layout's processor
    differences), so the reference and the runtime see the same pixel budget. Used by the check
    and by the benchmarks' torch reference."""
    from transformers import ColQwen2Processor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    from ..families.preprocess_config import read_preprocess_config

    config = read_preprocess_config(checkpoint_folder)
    image_processor = Qwen2VLImageProcessor(
        patch_size=config.patch_size,
        merge_size=config.merge_size,
        temporal_patch_size=config.temporal_patch_size,
        image_mean=list(config.image_mean),
        image_std=list(config.image_std),
        min_pixels=config.min_pixels,
        max_pixels=config.max_pixels,
    )
    processor = ColQwen2Processor(
        image_processor=image_processor,
        query_prefix="",
        tokenizer=reference_tokenizer(checkpoint_folder),
    )
    return processor, config


def reference_tokenizer(checkpoint_folder: Path):
    """4.57.1's `Qwen2TokenizerFast` for the folder. transformers 5.x saves
    `extra_special_tokens` as a list (its additional special tokens) where 4.57.1 reads a
    name -> token object and fails on a list; a list is handed to 4.57.1 as what it means,
    `additional_special_tokens`."""
    import json

    from transformers import Qwen2TokenizerFast

    path = Path(checkpoint_folder) / "tokenizer_config.json"
    extra = None
    if path.is_file():
        try:
            extra = json.loads(path.read_text(encoding="utf-8")).get("extra_special_tokens")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise ExportError(f"{path}: unreadable tokenizer configuration ({e})") from e
    if isinstance(extra, list):
        return Qwen2TokenizerFast.from_pretrained(
            checkpoint_folder, extra_special_tokens={}, additional_special_tokens=extra
        )
    return Qwen2TokenizerFast.from_pretrained(checkpoint_folder)


def reference_outputs_qwen3(model, checkpoint_folder: Path) -> Reference:
    """`reference_outputs` for ColQwen3: the checkpoint's Qwen3-VL tower and retrieval forward
    (`checkpoint_qwen3`), fed by colpali-engine 0.3.18 ColQwen3Processor's semantics built from
    4.57.1's classes (its prompts are ColQwen2Processor's with query prefix "", its image
    processor the PIL Qwen2VLImageProcessor at the folder's patch 16, mean/std and bounds). That
    these give colpali-engine's own ids, pixels and embeddings on transformers 5.x is what
    `tests/export/families/qwen3/test_reference.py` pins. The tower returns (features, DeepStack features): the
    features are compared here, DeepStack through the final embeddings."""
    processor, config = reference_processor_qwen3(checkpoint_folder)
    return reference_on_samples(
        model,
        processor,
        image_features=lambda tower_output: tower_output[0],
        # TomoroAI's processor strips the text (layouts_qwen3)
        query_text=str.strip if config.query_strip else (lambda query: query),
    )


def _comparisons(
    staged_folder: Path, reference: Reference, tolerance: float, feature_tolerance: float
) -> list[Comparison]:
    """The staged folder's outputs on the sample inputs against the reference, one graph's session
    open at a time: the image graph runs every page and is closed (its mapped weights and arena
    released) before the text graph's session opens for the pages' text part and the queries.
    Both sessions at once held both graphs' weights (the whole model) in the check's memory."""
    from colembed.model import ColQwenModel

    from ..measure import release_memory

    pages = sample_pages()
    runtime = ColQwenModel(
        staged_folder, verify=True, session_config=CHECK_SESSION_CONFIG, graphs=("vision",)
    )
    image_outputs = runtime.run_image_graph(pages)
    runtime.close_graph("vision")
    release_memory()
    runtime.open_graph("text")
    got_pages = runtime.embed_image_graph_outputs(image_outputs)
    got_queries = runtime.embed_queries(list(SAMPLE_QUERIES))
    runtime.close_graph("text")
    del runtime
    release_memory()
    found = []
    for i in range(len(pages)):
        found.append(
            Comparison(
                f"page {i} image features",
                relative_diff(image_outputs.features[i], reference.image_features[i]),
                feature_tolerance,
                "relative",
            )
        )
        found.append(
            Comparison(
                f"page {i} embeddings",
                max_abs_diff(got_pages[i], reference.pages[i]),
                tolerance,
                "absolute",
            )
        )
    for i, (got, want) in enumerate(zip(got_queries, reference.queries)):
        found.append(
            Comparison(f"query {i} embeddings", max_abs_diff(got, want), tolerance, "absolute")
        )
    return found


def compare_with_reference(
    staged_folder: Path, reference: Reference, *, tolerance: float, feature_tolerance: float
) -> dict[str, Any]:
    """Run the staged folder with colembed; return the figures, or raise listing every comparison.

    `tolerance` bounds the final embeddings per token (absolute); `feature_tolerance` bounds the
    image features relative to their own scale.
    """
    found = _comparisons(Path(staged_folder), reference, tolerance, feature_tolerance)
    if not all(c.ok for c in found):
        raise ExportError(
            "the exported graphs diverge from the torch model; nothing was written:\n  "
            + "\n  ".join(c.describe() for c in found)
        )
    final = [c.figure for c in found if c.kind == "absolute"]
    relative = [c.figure for c in found if c.kind == "relative"]
    return {
        "tolerance": tolerance,
        "max_abs_diff": max(final),
        "feature_tolerance": feature_tolerance,
        "max_relative_feature_diff": max(relative),
        "comparisons": {c.label: c.figure for c in found},
        "pages": len(reference.pages),
        "queries": len(reference.queries),
    }


def verify_export(
    model, checkpoint_folder, staged_folder, *, tolerance: float, feature_tolerance: float
) -> dict[str, Any]:
    """Both halves in one call (the reference, then the runtime), for callers that keep the model."""
    reference = reference_outputs(model, Path(checkpoint_folder))
    return compare_with_reference(
        Path(staged_folder), reference, tolerance=tolerance, feature_tolerance=feature_tolerance
    )
