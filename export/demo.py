"""The README's first command: an offline end-to-end run on a tiny RANDOM-WEIGHT ColQwen2.

Builds a tiny checkpoint of the real architecture with the real Qwen tokenizer, exports it with
the check on, then embeds two synthetic pages and two queries with the torch-free runtime and
ranks the pages. The numbers mean nothing (random weights); the shapes and the pipeline are real.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import numpy as np


def run_demo(workdir: Path, *, overwrite: bool = True, progress: Callable[[str], None] = print) -> dict:
    import colembed

    from .exporter import export_model
    from .tiny import build_checkpoint
    from .verify import sample_pages

    workdir = Path(workdir)
    if overwrite and workdir.exists():
        shutil.rmtree(workdir)
    progress("building a tiny RANDOM-WEIGHT ColQwen2 checkpoint (real architecture and tokenizer)")
    checkpoint = build_checkpoint(workdir / "checkpoint", "tiny", seed=0)
    report = export_model(checkpoint, workdir / "model", name="colqwen2-tiny-random",
                          random_weights=True, progress=progress)
    model = colembed.load(report.folder)
    pages = sample_pages()[:2]
    queries = ["What was the revenue in 2023?", "Who signed the contract?"]
    page_vectors = model.embed_images(pages)
    query_vectors = model.embed_queries(queries)
    scores = colembed.score(query_vectors, page_vectors)
    print("=" * 72)
    print("colembed demo -- RANDOM WEIGHTS: the scores below are meaningless, the pipeline is real")
    print(model)
    print(f"export check: max abs diff vs torch = {report.check['fp32']['max_abs_diff']:.2e}")
    for i, v in enumerate(page_vectors):
        print(f"page {i}: {pages[i].size[0]}x{pages[i].size[1]} px -> vectors {v.shape} {v.dtype}")
    for q, v in zip(queries, query_vectors):
        print(f"query {q!r} -> vectors {v.shape} {v.dtype}")
    print("MaxSim scores (queries x pages):")
    print(np.array2string(scores, precision=3))
    print("=" * 72)
    return {"folder": str(report.folder), "scores": scores.tolist()}
