"""ColQwen2.5 served end to end: `colembed export` folders of both tiny shapes (tiny-2.5 from
colpali-engine's published layout, tiny-2.5-alt from transformers' layout), loaded with
`colembed.load`, against the pinned reference (transformers 4.57.1 `ColQwen2ForRetrieval` over the
Qwen2.5-VL config with the `get_dtype` shim, docs/reference-colqwen2_5.md) per token: pages of
several sizes (several windows, and one smaller than a window) and queries, alone and in batches;
and both families in one process giving what each gives alone.

The two exports are session fixtures (conftest: `exported_tiny_2_5`, `exported_tiny_2_5_alt`), so
every test here is marked slow by conftest.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from tests.fixtures.builds import PARITY_TOLERANCE, reference_rows
from tests.fixtures.images import rgb as noise_page

from colembed.preprocess.images import prepare_image
from colembed.preprocess.windows import WINDOW_INPUTS, merged_window_side, window_layout
from tests.fixtures.qwen2_5 import checkpoint, reference_processor

pytestmark = pytest.mark.heavy("qwen2.5")

# (width, height): a page of many windows, its transpose, a small photo (smaller than one
# 4x4-token window of tiny-2.5-alt), a one-token-high strip, and a mid-size page.
PAGE_SIZES = [(300, 420), (420, 300), (60, 90), (400, 30), (150, 210)]
QUERIES = ["What was the revenue in 2023?", "hi", "", "表格中的数字是多少？ <|image_pad|>"]


@pytest.fixture(scope="module")
def served(exported_2_5, tmp_path_factory):
    """(preset, colembed model, reference model, reference processor) for each preset."""
    import torch
    from transformers import ColQwen2ForRetrieval

    import colembed
    from colembed_export.families import export_family

    preset, report = exported_2_5
    folder = checkpoint(tmp_path_factory, preset, "transformers")
    reference = export_family("colqwen2.5").prepare_reference(
        ColQwen2ForRetrieval.from_pretrained(folder, dtype=torch.float32).eval()
    )
    return preset, colembed.load(report.folder), reference, reference_processor(folder)


@pytest.fixture(scope="module")
def pages():
    return [noise_page(w, h, seed=seed) for seed, (w, h) in enumerate(PAGE_SIZES, start=11)]


def assert_alone_and_batched(embed, items, expected, preset):
    """Every item's vectors within the parity tolerance, one item per run and all in one batch."""
    for batch_size in (1, len(items)):
        for i, (mine, want) in enumerate(zip(embed(items, batch_size=batch_size), expected)):
            assert mine.shape == want.shape, (preset, batch_size, i)
            assert np.abs(mine - want).max() <= PARITY_TOLERANCE, (preset, batch_size, i)


def test_the_folder_names_its_family_and_window_size(exported_2_5, tmp_path_factory):
    import json

    preset, report = exported_2_5
    manifest = report.manifest
    source = checkpoint(tmp_path_factory, preset, "transformers")
    vision_config = json.loads((source / "config.json").read_text())["vlm_config"]["vision_config"]
    assert manifest.family == "colqwen2.5"
    assert manifest.vision_attention.to_dict() == {
        "kind": "windowed",
        "window_size": vision_config["window_size"],
    }
    inputs = manifest.graph("fp32", "vision").contract.inputs
    assert inputs[-len(WINDOW_INPUTS) :] == WINDOW_INPUTS
    assert manifest.architecture.vision_embed_dim == vision_config["hidden_size"]
    assert manifest.checks["fp32"]["max_abs_diff"] <= PARITY_TOLERANCE


def test_pages_equal_the_reference_alone_and_in_batches(served, pages):
    preset, model, reference, processor = served
    config = model.config
    side = merged_window_side(
        window_size=model.manifest.vision_attention.window_size,
        merge_size=config.merge_size,
        patch_size=config.patch_size,
    )
    grids = [prepare_image(page, config).grid_thw for page in pages]
    windows = [
        window_layout(
            g,
            merge_size=config.merge_size,
            patch_size=config.patch_size,
            window_size=model.manifest.vision_attention.window_size,
        ).num_windows
        for g in grids
    ]
    assert max(windows) >= 6  # windowed and full-attention blocks both see real structure
    if side > 2:  # tiny-2.5's windows (2x2 tokens) are the smallest page ColQwen allows
        assert any(
            h // config.merge_size < side and w // config.merge_size < side for _, h, w in grids
        ), grids
    expected = [reference_rows(reference, processor.process_images([page])) for page in pages]
    assert_alone_and_batched(model.embed_images, pages, expected, preset)


def test_queries_equal_the_reference_alone_and_in_batches(served):
    preset, model, reference, processor = served
    expected = [reference_rows(reference, processor.process_queries([q])) for q in QUERIES]
    assert_alone_and_batched(model.embed_queries, QUERIES, expected, preset)


ALONE = textwrap.dedent("""
    import sys
    import numpy as np
    import colembed
    sys.path.insert(0, sys.argv[3])
    from tests.fixtures.images import rgb
    model = colembed.load(sys.argv[1], threads=1)
    pages = [rgb(w, h, seed=s) for s, (w, h) in enumerate([(300, 420), (60, 90)])]
    out = [v for page in pages for v in model.embed_images([page])]
    out += model.embed_queries(["What was the revenue?", "hi"])
    np.savez(sys.argv[2], *out)
""")


def test_both_families_in_one_process_equal_each_alone(exported_tiny, exported_tiny_2_5, tmp_path):
    """Each family alone in a fresh process, then both in this one, calls interleaved."""
    from pathlib import Path

    import colembed

    folders = {"colqwen2": exported_tiny.folder, "colqwen2.5": exported_tiny_2_5.folder}
    alone = {}
    for family, folder in folders.items():
        out = tmp_path / f"{family}.npz"
        subprocess.run(
            [
                sys.executable,
                "-c",
                ALONE,
                str(folder),
                str(out),
                str(Path(__file__).resolve().parents[4]),
            ],
            check=True,
        )
        with np.load(out) as saved:
            alone[family] = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    models = {family: colembed.load(folder, threads=1) for family, folder in folders.items()}
    assert {f: m.family.name for f, m in models.items()} == {f: f for f in folders}
    pages = [noise_page(w, h, seed=s) for s, (w, h) in enumerate([(300, 420), (60, 90)])]
    together = {family: [] for family in folders}
    for page in pages:  # interleaved: each call of one family between calls of the other
        for family, model in models.items():
            together[family] += model.embed_images([page])
    for family, model in models.items():
        together[family] += model.embed_queries(["What was the revenue?", "hi"])
    for family in folders:
        assert len(together[family]) == len(alone[family])
        for got, want in zip(together[family], alone[family]):
            np.testing.assert_array_equal(got, want)
