"""Question: How far apart are the two candidate ColQwen2.5 references on one set of weights?
Answer: padding side only: real-token embeddings within 6e-8; ids and pixels equal
Note: none kept (answer recorded in docs/reference-colqwen2_5.md, "Measured differences")

Measure how the two candidate ColQwen2.5 references differ, on the same tiny random weights.

    .venv/bin/python -m pip install --no-deps colpali-engine==0.3.12   # never torchvision
    python -m benchmarks.experiments.reference_colqwen2_5

A: colpali-engine 0.3.12 `ColQwen2_5` + `ColQwen2_5_Processor` (loads the published layout).
B: transformers 4.57.1 `ColQwen2ForRetrieval` + `ColQwen2Processor` over a Qwen2.5-VL config.
Prints token ids, masks, pixel values and per-token embedding differences (real tokens only).
Use a 128-dim preset (the default `tiny-2.5`): A hard-codes 128, so `tiny-2.5-alt` (64) does not
load in A.
The findings are written up in docs/reference-colqwen2_5.md. Not a test: colpali-engine pins
torch<2.8 and transformers<4.54 and requires torchvision, so it cannot be a declared dependency.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from colembed_export.testing.tiny_qwen2_5 import build_checkpoint_2_5, to_colpali_layout

PAGES = [(300, 200), (60, 90), (448, 448)]  # several windows, smaller than a window, square
QUERIES = ["What is the revenue?", "hi"]


def colpali_processor(folder: Path):
    """`ColQwen2_5_Processor` without its video half: the video processor needs torchvision, and
    images and text never touch it (Qwen2VLProcessor.__call__ reads it only for `videos=`)."""
    from colpali_engine.models import ColQwen2_5_Processor
    from transformers import Qwen2TokenizerFast
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    class ImageTextOnly(ColQwen2_5_Processor):
        attributes = ["image_processor", "tokenizer"]

    return ImageTextOnly(
        image_processor=Qwen2VLImageProcessor.from_pretrained(folder),
        tokenizer=Qwen2TokenizerFast.from_pretrained(folder),
    )


def rows(embeddings: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    return [e[m.bool()] for e, m in zip(embeddings, mask)]


def compare(name: str, batch_a, out_a, batch_b, out_b) -> None:
    pairs = zip(rows(out_a, batch_a["attention_mask"]), rows(out_b, batch_b["attention_mask"]))
    for i, (a, b) in enumerate(pairs):
        ids_equal = torch.equal(
            batch_a["input_ids"][i][batch_a["attention_mask"][i].bool()],
            batch_b["input_ids"][i][batch_b["attention_mask"][i].bool()],
        )
        diff = (a - b).abs().max().item() if a.shape == b.shape else float("nan")
        print(
            f"{name}[{i}]: real tokens {tuple(a.shape)} vs {tuple(b.shape)}, ids equal {ids_equal}, "
            f"max |A-B| {diff:.3g}"
        )


def main(preset: str = "tiny-2.5") -> None:
    with tempfile.TemporaryDirectory(prefix="colqwen2_5_refs_") as tmp:
        run(Path(tmp), preset)


def run(root: Path, preset: str) -> None:
    from colpali_engine.models import ColQwen2_5
    from transformers import ColQwen2ForRetrieval, ColQwen2Processor

    hf_folder = build_checkpoint_2_5(root / "transformers", preset, seed=0)
    cp_folder = to_colpali_layout(hf_folder, root / "colpali")
    model_a = ColQwen2_5.from_pretrained(cp_folder, dtype=torch.float32).eval()
    model_b = ColQwen2ForRetrieval.from_pretrained(hf_folder, dtype=torch.float32).eval()
    proc_a = colpali_processor(cp_folder)
    proc_b = ColQwen2Processor.from_pretrained(hf_folder, use_fast=False)
    print("padding side: A", proc_a.tokenizer.padding_side, "B", proc_b.tokenizer.padding_side)
    print("query prefix: A", repr(proc_a.query_prefix), "B", repr(proc_b.query_prefix))
    print(
        "augmentation: A",
        repr(proc_a.query_augmentation_token),
        "B",
        repr(proc_b.query_augmentation_token),
    )
    print("page prompt equal:", proc_a.visual_prompt_prefix == proc_b.visual_prompt_prefix)
    rng = np.random.default_rng(0)
    pages = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in PAGES]
    with torch.no_grad():
        qa, qb = proc_a.process_queries(QUERIES), proc_b.process_queries(QUERIES)
        compare("query", qa, model_a(**qa), qb, model_b(**qb).embeddings)
        pa, pb = proc_a.process_images(pages), proc_b.process_images(pages)
        grids = pa["image_grid_thw"]
        print("grids equal:", torch.equal(grids, pb["image_grid_thw"]), grids.tolist())
        print("pixel_values equal:", torch.equal(pa["pixel_values"], pb["pixel_values"]))
        try:
            model_b(**pb)
            print("B page forward: runs unpatched")
        except AttributeError as e:
            print("B page forward fails unpatched:", e)
        model_b.vlm.model.visual.get_dtype = lambda: torch.float32  # the one shim B needs
        compare("page", pa, model_a(**pa), pb, model_b(**pb).embeddings)


if __name__ == "__main__":
    main(*sys.argv[1:])
