"""Retrieval agreement for the benchmarks: a rendered page set, text queries, top-k overlap.

The exporter's own gate (colembed_export.variants.gates) ranks perturbed page copies, which have clear
winners under any weights. These helpers measure what a user would see on text queries over
rendered pages; with random weights fp32's margins there are tiny, hence the tie band.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from colembed_export.variants.gates import maxsim as maxsim_scores  # noqa: F401  (re-exported)


def topk_agreement(
    variant_scores: np.ndarray, fp32_scores: np.ndarray, k: int = 5, tie: float = 0.0
) -> dict[str, Any]:
    """Share of queries whose top-k pages agree with fp32's.

    `same_set` / `same_order`: exactly the same k pages (in the same order). `within_ties`: the
    same, except that pages whose fp32 score lies within `tie` (relative, e.g. 0.005) of fp32's
    k-th score count as interchangeable: every page the variant ranks in its top k scores at
    least `s_k - tie*|s_k|` under fp32, and every page scoring above `s_k + tie*|s_k|` under fp32
    is in the variant's top k. With tie 0 it is `same_set`.
    """
    top_v = np.argsort(-variant_scores, axis=1, kind="stable")[:, :k]
    top_f = np.argsort(-fp32_scores, axis=1, kind="stable")[:, :k]
    same_set = [set(a) == set(b) for a, b in zip(top_v, top_f)]
    same_order = [list(a) == list(b) for a, b in zip(top_v, top_f)]
    within = []
    for row, (tv, tf) in enumerate(zip(top_v, top_f)):
        kth = fp32_scores[row, tf[-1]]
        band = tie * abs(kth)
        sure = set(np.flatnonzero(fp32_scores[row] > kth + band))
        within.append(bool(np.all(fp32_scores[row, tv] >= kth - band)) and sure <= set(tv))
    gaps = np.sort(fp32_scores, axis=1)[:, ::-1]
    return {
        "k": k,
        "queries": len(same_set),
        "same_set": float(np.mean(same_set)),
        "same_order": float(np.mean(same_order)),
        "tie": tie,
        "within_ties": float(np.mean(within)),
        "median_fp32_gap_k": float(np.median(gaps[:, k - 1] - gaps[:, k])),
    }


def synthetic_retrieval_set(
    pages: int = 100, queries: int = 20, *, size: tuple[int, int] = (112, 140), seed: int = 0
) -> tuple[list[Any], list[str]]:
    """`pages` small same-size page images with rendered text, and `queries` that quote them.

    Page i shows a title ("Report 17: harbour freight"), a few body lines drawn from a word list
    and a coloured chart bar, on its own paper tint; query j quotes the title and first line of
    page `j * pages // queries`. Pages differ visibly (tint, ink, layout) because a random-weight
    model only tells pages apart by what it sees, not by what the text means: that keeps fp32's
    score margins well above quantisation noise, so a top-k comparison tests the variant rather
    than ties. All pages share one size (one grid), so the image graph batches them.
    """
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    words = (
        "harbour freight invoice revenue tax energy rail audit salary budget forecast river "
        "clinic grain steel vaccine solar port tariff loan credit wind copper cotton wheat "
        "coffee tourism census school bridge"
    ).split()
    images, texts = [], []
    for i in range(pages):
        title = f"Report {i}: {words[i % len(words)]} {words[(3 * i + 1) % len(words)]}"
        lines = [" ".join(rng.choice(words, 3)) for _ in range(5)]
        paper = tuple(int(c) for c in rng.integers(150, 256, 3))
        ink = tuple(int(c) for c in rng.integers(0, 110, 3))
        image = Image.new("RGB", size, paper)
        draw = ImageDraw.Draw(image)
        x0 = int(rng.integers(2, 20))
        draw.text((x0, 4), title, fill=ink)
        for row, line in enumerate(lines):
            draw.text((x0, 22 + 14 * row), line, fill=ink)
        bar = tuple(int(c) for c in rng.integers(0, 256, 3))
        top = int(rng.integers(size[1] // 2, size[1] - 24))
        draw.rectangle([4, top, 4 + int(rng.integers(20, size[0] - 8)), top + 16], fill=bar)
        images.append(image)
        texts.append((title, lines))
    query_texts = [
        f"{texts[j * pages // queries][0]} {texts[j * pages // queries][1][0]}"
        for j in range(queries)
    ]
    return images, query_texts
