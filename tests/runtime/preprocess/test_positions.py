"""3-D M-RoPE position ids and vision rotary tables against the reference model's own code
(transformers 4.57.1 `Qwen2VLModel.get_rope_index`, `Qwen2VisionTransformerPretrainedModel.rot_pos_emb`)."""

from __future__ import annotations

import numpy as np
import pytest

import tests.fixtures.images as fx
from colembed.errors import InputError
from colembed_export.families.preprocess_config import VISION_ROPE_THETA
from colembed.preprocess.images import prepare_image
from colembed.preprocess.positions import config_position_ids, vision_rotary_tables
from colembed.preprocess.text import pad_batch

torch = pytest.importorskip("torch")

PAGE_SIZES = [(60, 100), (300, 40), (700, 900), (20, 20)]  # (width, height): different grids
QUERIES = ["a", "what is the total revenue in 2024?", "<|image_pad|> literally", "", "x" * 300]


@pytest.fixture(scope="module")
def pages(config):
    return [prepare_image(fx.rgb(w, h, seed=i), config) for i, (w, h) in enumerate(PAGE_SIZES)]


def ours(config, ids, mask, grids):
    return config_position_ids(ids, mask, grids, config)


def reference(model, ids, mask, grids):
    flat = [g for row in grids for g in row]
    grid_tensor = torch.tensor(flat, dtype=torch.long) if flat else None
    positions, _ = model.vlm.model.get_rope_index(
        torch.as_tensor(ids), grid_tensor, None, torch.as_tensor(mask)
    )
    return positions.numpy()


def left_pad(rows, pad_id):
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = row
        mask[i, width - len(row) :] = 1
    return ids, mask


def test_pages_of_different_grids_from_the_reference_processor(
    config, pages, reference_processor, reference_model
):
    images = [fx.rgb(w, h, seed=i) for i, (w, h) in enumerate(PAGE_SIZES)]
    batch = reference_processor.process_images(images)
    grids = [[tuple(g)] for g in batch["image_grid_thw"].tolist()]
    expected = reference(reference_model, batch["input_ids"], batch["attention_mask"], grids)
    got = ours(config, batch["input_ids"].numpy(), batch["attention_mask"].numpy(), grids)
    assert got.dtype == np.int64 and got.shape == (3,) + tuple(batch["input_ids"].shape)
    np.testing.assert_array_equal(got, expected)


def test_pages_from_our_own_ids(config, encoder, pages, reference_model):
    ids, mask = pad_batch(
        [encoder.page_prompt_ids(p.num_image_tokens) for p in pages], config.pad_token_id
    )
    grids = [[p.grid_thw] for p in pages]
    np.testing.assert_array_equal(
        ours(config, ids, mask, grids), reference(reference_model, ids, mask, grids)
    )


def test_text_only_batch_is_cumsum(config, encoder, reference_model):
    ids, mask = pad_batch(encoder.encode_queries(QUERIES), config.pad_token_id)
    grids = [[] for _ in QUERIES]
    got = ours(config, ids, mask, grids)
    np.testing.assert_array_equal(got, reference(reference_model, ids, mask, grids))
    expected = np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 1)
    np.testing.assert_array_equal(got, np.broadcast_to(expected, got.shape))


def test_query_with_vision_tokens_in_its_text_stays_text(config, encoder, reference_model):
    """A query may spell `<|vision_start|><|image_pad|>`; with no grids it is text, as in the reference."""
    query = "<|vision_start|><|image_pad|><|vision_end|> x"
    ids, mask = pad_batch(encoder.encode_queries([query]), config.pad_token_id)
    np.testing.assert_array_equal(
        ours(config, ids, mask, [[]]), reference(reference_model, ids, mask, [[]])
    )


@pytest.mark.parametrize("padding", ["right", "left"])
def test_mixed_batch_of_queries_and_pages(config, encoder, pages, reference_model, padding):
    rows = encoder.encode_queries(QUERIES) + [
        encoder.page_prompt_ids(p.num_image_tokens) for p in pages
    ]
    order = np.random.default_rng(0).permutation(len(rows))
    grids_by_row = [[] for _ in QUERIES] + [[p.grid_thw] for p in pages]
    rows = [rows[i] for i in order]
    grids = [grids_by_row[i] for i in order]
    ids, mask = (
        pad_batch(rows, config.pad_token_id)
        if padding == "right"
        else left_pad(rows, config.pad_token_id)
    )
    np.testing.assert_array_equal(
        ours(config, ids, mask, grids), reference(reference_model, ids, mask, grids)
    )


def test_two_images_in_one_row(config, encoder, pages, reference_model):
    first, second = pages[0], pages[2]
    row = np.concatenate(
        [
            encoder.page_prompt_ids(first.num_image_tokens),
            encoder.page_prompt_ids(second.num_image_tokens),
        ]
    )
    ids, mask = pad_batch(
        [row, encoder.page_prompt_ids(pages[1].num_image_tokens)], config.pad_token_id
    )
    grids = [[first.grid_thw, second.grid_thw], [pages[1].grid_thw]]
    np.testing.assert_array_equal(
        ours(config, ids, mask, grids), reference(reference_model, ids, mask, grids)
    )


def test_grids_that_do_not_match_the_ids_are_refused(config, encoder, pages):
    ids, mask = pad_batch([encoder.page_prompt_ids(pages[0].num_image_tokens)], config.pad_token_id)
    with pytest.raises(InputError):
        ours(config, ids, mask, [[pages[2].grid_thw]])  # more image tokens than the row has
    with pytest.raises(InputError):
        ours(config, ids, mask, [[pages[0].grid_thw, pages[0].grid_thw]])  # two grids, one image
    with pytest.raises(InputError):
        ours(config, ids, mask, [])  # no grid list for the row
    assert ours(config, ids, mask, [[pages[0].grid_thw]]).shape == (3,) + ids.shape


# -- vision rotary tables ------------------------------------------------------------------------


def reference_tables(visual, grid):
    emb = visual.rot_pos_emb(torch.tensor([grid]))
    emb = torch.cat((emb, emb), dim=-1)
    return emb.cos().numpy(), emb.sin().numpy()


def assert_tables_close(got, expected):
    for ours_table, ref_table in zip(got, expected):
        assert ours_table.dtype == np.float32 and ours_table.shape == ref_table.shape
        assert float(np.abs(ours_table - ref_table).max()) <= 1e-6


@pytest.mark.parametrize("grid", [(1, 4, 4), (1, 62, 48), (1, 2, 100), (2, 6, 10)])
def test_vision_rotary_tables_equal_the_reference_tower(config, reference_model, grid):
    got = vision_rotary_tables(
        grid,
        merge_size=config.merge_size,
        head_dim=config.vision_head_dim,
        theta=config.vision_rope_theta,
    )
    assert got[0].shape == (int(np.prod(grid)), config.vision_head_dim)
    assert_tables_close(got, reference_tables(reference_model.vlm.model.visual, grid))


@pytest.mark.parametrize("head_dim", [16, 80])
def test_vision_rotary_tables_at_other_head_dims(head_dim):
    """head_dim 80 is Qwen2-VL-2B's; the tower is built from its config (weights are irrelevant)."""
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    tower = Qwen2VisionTransformerPretrainedModel._from_config(
        Qwen2VLVisionConfig(
            depth=1, embed_dim=head_dim * 2, num_heads=2, hidden_size=32, mlp_ratio=1.0
        )
    )
    grid = (1, 62, 48)
    got = vision_rotary_tables(grid, merge_size=2, head_dim=head_dim, theta=VISION_ROPE_THETA)
    assert_tables_close(got, reference_tables(tower, grid))
