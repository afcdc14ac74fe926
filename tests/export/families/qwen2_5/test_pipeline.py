"""ColQwen2.5 end to end in torch, the way the runtime would run it: colembed's numpy host side
(tokens, pixels, rotary tables, window layout, M-RoPE positions, feature placement) feeding the
export wrappers (`WindowedImageGraph`, ColQwen2's unchanged `TextGraph`), against the reference's
per-token embeddings. Only the image graph and its window inputs differ from ColQwen2."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from colembed_export.families.preprocess_config import read_preprocess_config
from colembed.preprocess.images import prepare_image
from colembed.preprocess.positions import config_position_ids, vision_rotary_tables
from colembed.preprocess.text import TextEncoder, pad_batch
from colembed.preprocess.windows import window_layout
from tests.fixtures.qwen2_5 import PRESETS, checkpoint, reference_processor

PAGES = [(300, 200), (60, 90), (300, 200)]  # two of one grid (batched together) and a small one
QUERIES = ["What is the revenue?", "hi"]
TOLERANCE = 1e-5


def page_features(graph, config, pages, window_size):
    """Image features per page, pages of one grid run as one batch (as the runtime groups them)."""
    prepared = [prepare_image(page, config, index=i) for i, page in enumerate(pages)]
    features = [None] * len(prepared)
    for grid in {p.grid_thw for p in prepared}:
        members = [i for i, p in enumerate(prepared) if p.grid_thw == grid]
        layout = window_layout(
            grid,
            merge_size=config.merge_size,
            patch_size=config.patch_size,
            window_size=window_size,
        )
        cos, sin = vision_rotary_tables(
            grid,
            merge_size=config.merge_size,
            head_dim=config.vision_head_dim,
            theta=config.vision_rope_theta,
        )
        inputs = [
            np.stack([prepared[i].patches for i in members]),
            cos,
            sin,
            *layout.graph_inputs().values(),
        ]
        with torch.no_grad():
            out = graph(*(torch.from_numpy(np.ascontiguousarray(a)) for a in inputs)).numpy()
        for i, rows in zip(members, out):
            features[i] = rows
    return prepared, features


def run_text(text_graph, config, ids, grids, features, hidden):
    input_ids, mask = pad_batch(ids, config.pad_token_id)
    positions = config_position_ids(input_ids, mask, grids, config)
    index = np.zeros_like(input_ids)
    offset = 0
    for row, rows in enumerate(features):
        slots = np.flatnonzero((input_ids[row] == config.image_token_id) & (mask[row] == 1))
        index[row, slots] = np.arange(offset + 1, offset + 1 + len(slots))
        offset += len(slots)
    table = np.concatenate(features) if features else np.zeros((0, hidden), np.float32)
    with torch.no_grad():
        out = text_graph(
            *(torch.from_numpy(a) for a in (input_ids, mask, positions, index, table))
        ).numpy()
    return [out[row, :n] for row, n in enumerate(mask.sum(axis=1))]


def reference_rows(model, batch):
    with torch.no_grad():
        out = model(**batch).embeddings.numpy()
    return [out[row][m.astype(bool)] for row, m in enumerate(batch["attention_mask"].numpy())]


@pytest.mark.parametrize("preset", PRESETS)
def test_pages_and_queries_equal_the_reference_per_token(tmp_path_factory, preset):
    from colembed_export.families.qwen2.graphs import TextGraph
    from colembed_export.families.qwen2_5.graphs import WindowedImageGraph
    from transformers import ColQwen2ForRetrieval

    folder = checkpoint(tmp_path_factory, preset, "transformers")
    config = read_preprocess_config(folder)
    model = ColQwen2ForRetrieval.from_pretrained(folder, dtype=torch.float32).eval()
    model.vlm.model.visual.get_dtype = lambda: torch.float32  # the oracle's shim (reference doc)
    processor = reference_processor(folder)
    encoder = TextEncoder.from_file(folder / "tokenizer.json", config)
    hidden = model.config.vlm_config.text_config.hidden_size
    visual = model.vlm.model.visual
    image_graph, text_graph = WindowedImageGraph(visual).eval(), TextGraph(model).eval()

    rng = np.random.default_rng(5)
    pages = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in PAGES]
    prepared, features = page_features(image_graph, config, pages, visual.config.window_size)
    ids = [encoder.page_prompt_ids(p.num_image_tokens) for p in prepared]
    mine = run_text(text_graph, config, ids, [[p.grid_thw] for p in prepared], features, hidden)
    expected = reference_rows(model, processor.process_images(pages))
    mine += run_text(text_graph, config, encoder.encode_queries(QUERIES), [[], []], [], hidden)
    expected += reference_rows(model, processor.process_queries(QUERIES))
    for got, want in zip(mine, expected):
        assert got.shape == want.shape
        assert np.abs(got - want).max() <= TOLERANCE
