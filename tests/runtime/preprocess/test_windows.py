"""colembed.preprocess.windows against the reference tower's own index computations
(transformers 4.57.1 `Qwen2_5_VisionTransformerPretrainedModel`), and the family's image and
position preprocessing against the reference processor and `get_rope_index`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from colembed.errors import InputError
from colembed_export.families.preprocess_config import read_preprocess_config
from colembed.preprocess.images import prepare_image
from colembed.preprocess.positions import config_position_ids, vision_rotary_tables
from colembed.preprocess.windows import packed_window_index, window_layout
from tests.fixtures.qwen2_5 import checkpoint, load_reference, reference_processor

PATCH, MERGE = 14, 2
WINDOW_SIZES = (28, 56, 112, 224)  # 1, 2, 4 and 8 merged tokens a side (112 is Qwen2.5-VL's)
GRIDS = [  # (t, h, w) in patches
    (1, 2, 2),  # one merged token: smaller than any window
    (1, 4, 4),
    (1, 8, 8),  # exactly one 112-px window: the reference adds a whole empty padding window
    (1, 2, 40),  # wide
    (1, 40, 2),  # tall
    (1, 6, 10),  # odd unit counts
    (1, 22, 14),
    (1, 18, 30),  # several windows with partial right/bottom ones
    (1, 32, 32),
    (2, 6, 10),  # two frames (the reference tiles each frame)
]
_TOWERS: dict[int, object] = {}


def tower(window_size: int):
    """A tiny reference vision tower: only its index methods are used, weights do not matter."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    if window_size not in _TOWERS:
        config = Qwen2_5_VLVisionConfig(
            depth=1,
            hidden_size=16,
            intermediate_size=16,
            num_heads=2,
            out_hidden_size=16,
            window_size=window_size,
            fullatt_block_indexes=[0],
        )
        _TOWERS[window_size] = Qwen2_5_VisionTransformerPretrainedModel(config).eval()
    return _TOWERS[window_size]


def reference_indices(grids, window_size):
    """What the reference forward computes: window_index, cu_window_seqlens after
    unique_consecutive, cu_seqlens, and the windowed rotary angles."""
    visual = tower(window_size)
    grid_thw = torch.tensor(grids)
    window_index, cu_window = visual.get_window_index(grid_thw)
    cu_window = torch.unique_consecutive(torch.tensor(cu_window, dtype=torch.int32))
    cu = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).cumsum(
        0, dtype=torch.int32
    )
    cu = torch.nn.functional.pad(cu, (1, 0), value=0)
    angles = visual.rot_pos_emb(grid_thw)
    units = angles.shape[0] // MERGE**2
    angles = angles.reshape(units, MERGE**2, -1)[window_index].reshape(units * MERGE**2, -1)
    return window_index.numpy(), cu_window.numpy(), cu.numpy(), angles


def ours(grids, window_size):
    return packed_window_index(grids, merge_size=MERGE, patch_size=PATCH, window_size=window_size)


@pytest.mark.parametrize("window_size", WINDOW_SIZES)
@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_single_grid_layout_is_the_references(grid, window_size):
    index, cu_window, cu, _ = reference_indices([grid], window_size)
    layout = window_layout(grid, merge_size=MERGE, patch_size=PATCH, window_size=window_size)
    assert layout.window_index.dtype == np.int64 and np.array_equal(layout.window_index, index)
    assert layout.cu_window_seqlens.dtype == cu_window.dtype
    assert np.array_equal(layout.cu_window_seqlens, cu_window)
    assert np.array_equal(layout.cu_seqlens, cu)
    assert np.array_equal(layout.inverse, np.argsort(index))


@pytest.mark.parametrize("window_size", WINDOW_SIZES)
def test_packed_grids_are_the_references(window_size):
    index, cu_window, cu, _ = reference_indices(GRIDS, window_size)
    got = ours(GRIDS, window_size)
    for mine, theirs in zip(got, (index, cu_window, cu)):
        assert mine.dtype == theirs.dtype and np.array_equal(mine, theirs)


@settings(max_examples=60, deadline=None)
@given(
    grids=st.lists(
        st.tuples(st.just(1), st.integers(1, 30), st.integers(1, 30)), min_size=1, max_size=3
    ),
    window_size=st.sampled_from(WINDOW_SIZES),
)
def test_any_grids_are_the_references(grids, window_size):
    grids = [(t, 2 * h, 2 * w) for t, h, w in grids]
    index, cu_window, cu, _ = reference_indices(grids, window_size)
    got = ours(grids, window_size)
    for mine, theirs in zip(got, (index, cu_window, cu)):
        assert np.array_equal(mine, theirs)


@pytest.mark.parametrize("grid", [(1, 2, 2), (1, 18, 30), (1, 40, 2)], ids=str)
def test_windowed_rotary_tables_are_the_references(grid):
    """The rotary rows the windowed tower sees: colembed's Qwen2-VL tables, window-ordered."""
    head_dim = 16 // 2  # the test tower: hidden 16, 2 heads
    _, _, _, angles = reference_indices([grid], 112)
    emb = torch.cat((angles, angles), dim=-1)
    layout = window_layout(grid, merge_size=MERGE, patch_size=PATCH, window_size=112)
    cos, sin = vision_rotary_tables(grid, merge_size=MERGE, head_dim=head_dim, theta=10000.0)
    np.testing.assert_allclose(layout.to_window_order(cos), emb.cos().numpy(), rtol=0, atol=2e-7)
    np.testing.assert_allclose(layout.to_window_order(sin), emb.sin().numpy(), rtol=0, atol=2e-7)


@pytest.mark.parametrize("window_size", WINDOW_SIZES)
@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_window_gather_and_scatter_cover_every_row_once(grid, window_size):
    layout = window_layout(grid, merge_size=MERGE, patch_size=PATCH, window_size=window_size)
    rows, valid = layout.window_gather
    assert rows.shape == valid.shape == (layout.num_windows, int(layout.window_lengths.max()))
    assert np.array_equal(np.sort(rows[valid]), np.arange(layout.num_patches))
    assert np.array_equal(rows.ravel()[layout.window_scatter], np.arange(layout.num_patches))
    # each window holds the patches of one cu_window_seqlens segment of the reference's order
    for w, (start, end) in enumerate(
        zip(layout.cu_window_seqlens[:-1], layout.cu_window_seqlens[1:])
    ):
        assert np.array_equal(rows[w][valid[w]], layout.patch_order[start:end])
    inputs = layout.graph_inputs()
    assert sorted(inputs) == ["window_rows", "window_scatter", "window_valid"]
    assert all(a.dtype == np.int64 for a in inputs.values())


def test_round_trip_between_processor_and_window_order():
    layout = window_layout((1, 18, 30), merge_size=MERGE, patch_size=PATCH, window_size=112)
    units = np.arange(layout.window_index.shape[0] * 3).reshape(-1, 3)
    assert np.array_equal(layout.to_processor_order(units[layout.window_index]), units)
    patches = np.arange(layout.num_patches)
    assert np.array_equal(
        layout.to_window_order(patches).reshape(-1, 4)[:, 0] // 4, layout.window_index
    )


@pytest.mark.parametrize(
    "grid, window_size, match",
    [
        ((1, 3, 4), 112, "invalid image grid"),
        ((0, 4, 4), 112, "invalid image grid"),
        ((1, 4, 4), 14, "smaller than one"),
    ],
)
def test_bad_grids_and_windows_raise_input_error(grid, window_size, match):
    with pytest.raises(InputError, match=match):
        window_layout(grid, merge_size=MERGE, patch_size=PATCH, window_size=window_size)


# -- the family's image and position preprocessing -----------------------------------------------


PAGES = [(56, 56), (30, 900), (900, 30), (123, 457), (1000, 700), (2000, 1500)]  # (h, w)


@pytest.mark.parametrize("preset", ["tiny-2.5"])
def test_pixel_values_and_grids_equal_the_reference_processor(tmp_path_factory, preset):
    from PIL import Image

    folder = checkpoint(tmp_path_factory, preset, "transformers")
    config = read_preprocess_config(folder)
    processor = reference_processor(folder).image_processor
    rng = np.random.default_rng(3)
    for h, w in PAGES:
        page = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        expected = processor(images=[page], return_tensors="np")
        mine = prepare_image(page, config)
        assert mine.grid_thw == tuple(expected["image_grid_thw"][0]), (h, w)
        assert mine.patches.dtype == expected["pixel_values"].dtype
        assert np.array_equal(mine.patches, expected["pixel_values"]), (h, w)


def test_mrope_positions_equal_qwen2_5_get_rope_index(tmp_path_factory):
    """Images have t = 1, so `second_per_grid_ts` (videos only) never moves a position."""
    from PIL import Image

    folder = checkpoint(tmp_path_factory, "tiny-2.5", "transformers")
    config = read_preprocess_config(folder)
    processor = reference_processor(folder)
    rng = np.random.default_rng(4)
    sizes = [(300, 200), (60, 90)]
    pages = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    batch = processor.process_images(pages)
    queries = processor.process_queries(["What is the revenue?", "hi"])
    model = load_reference(folder).vlm.model
    for item, grids in (
        (batch, [[tuple(g)] for g in batch["image_grid_thw"].tolist()]),
        (queries, [[], []]),
    ):
        expected, _ = model.get_rope_index(
            item["input_ids"],
            item.get("image_grid_thw"),
            None,
            second_per_grid_ts=None,
            attention_mask=item["attention_mask"],
        )
        mine = config_position_ids(
            item["input_ids"].numpy(), item["attention_mask"].numpy(), grids, config
        )
        assert np.array_equal(mine, expected.numpy())
