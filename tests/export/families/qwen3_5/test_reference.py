"""ColQwen3.5 against its pinned reference: colpali-engine 0.3.18 ColQwen3_5 on transformers 5.24.

The checkpoints are tiny ColQwen3.5 folders saved by the reference itself (both shapes); the
reference runs in its own environment. Its ids, pixels, grids and 3-D positions are compared with
colembed's numpy preprocessing (bit for bit), and its embeddings with the exported folder through
colembed's runtime (per real token, <= 1e-4): queries of several lengths (up to past two 64-token
DeltaNet chunks) alone and in one batch, pages of several sizes (both pixel bounds, odd aspects,
transparency keys) alone and in one batch; queries, through the text graph alone, within 1e-5.
docs/reference-colqwen3_5.md records what these pin.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.fixtures.colqwen3_5 import (  # noqa: F401
    BATCHED_PAGES,
    QUERIES,
    checkpoint,
    exported,
    pages,
    qwen3_5_preset,
    reference,
)

pytestmark = [pytest.mark.heavy("qwen3.5"), pytest.mark.slow]
TOLERANCE = 1e-4
# Queries run the text graph alone: colembed's Qwen3.5 stack is the reference's to this bound
# (test_text.py, through torch), and so is its exported graph.
TEXT_TOLERANCE = 1e-5


def _preprocessing(folder):
    from colembed.preprocess.text import TextEncoder
    from colembed_export.families.preprocess_config import read_preprocess_config

    config = read_preprocess_config(folder)
    return config, TextEncoder.from_file(folder / "tokenizer.json", config)


def test_the_folder_is_read_as_the_processor_reads_it(qwen3_5_preset, tmp_path_factory):
    from colembed_export.testing.tiny_qwen3_5 import (
        DEFAULT_MAX_PIXELS,
        DEFAULT_MIN_PIXELS,
        qwen3_5_special_tokens,
    )

    config, _ = _preprocessing(checkpoint(tmp_path_factory, qwen3_5_preset))
    ids = {content: i for i, content in qwen3_5_special_tokens()}
    assert config.query_prefix == "" and config.query_augmentation_token == "<|endoftext|>"
    assert config.image_token_id == ids["<|image_pad|>"]
    assert config.vision_start_token_id == ids["<|vision_start|>"]
    assert config.pad_token_id == ids["<|endoftext|>"]
    assert (config.min_pixels, config.max_pixels) == (DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS)
    assert (config.patch_size, config.merge_size, config.temporal_patch_size) == (16, 2, 2)
    assert config.image_mean == config.image_std == (0.5, 0.5, 0.5)


def test_query_ids_are_the_processors(qwen3_5_preset, tmp_path_factory):
    ref = reference(tmp_path_factory, qwen3_5_preset)
    _, encoder = _preprocessing(checkpoint(tmp_path_factory, qwen3_5_preset))
    for i, ids in enumerate(encoder.encode_queries(list(QUERIES))):
        np.testing.assert_array_equal(ids, ref[f"query{i}_ids"], err_msg=repr(QUERIES[i]))


def test_page_ids_pixels_grids_and_positions_are_the_processors(qwen3_5_preset, tmp_path_factory):
    from colembed.families import COLQWEN3_5
    from colembed.preprocess.images import prepare_image
    from colembed.preprocess.positions import mrope_position_ids

    ref = reference(tmp_path_factory, qwen3_5_preset)
    config, encoder = _preprocessing(checkpoint(tmp_path_factory, qwen3_5_preset))
    for i, page in enumerate(pages()):
        prepared = prepare_image(page, config, index=i, transparency=COLQWEN3_5.transparency)
        assert prepared.grid_thw == tuple(int(v) for v in ref[f"page{i}_grid"])
        np.testing.assert_array_equal(prepared.patches, ref[f"page{i}_pixels"])  # bit for bit
        ids = encoder.page_prompt_ids(prepared.num_image_tokens)
        np.testing.assert_array_equal(ids, ref[f"page{i}_ids"])
        positions = mrope_position_ids(
            ids[None],
            np.ones((1, len(ids)), np.int64),
            [(prepared.grid_thw,)],
            image_token_id=config.image_token_id,
            vision_start_token_id=config.vision_start_token_id,
            merge_size=config.merge_size,
        )
        np.testing.assert_array_equal(positions[:, 0], ref[f"page{i}_positions"])


@pytest.mark.slow
def test_the_export_environments_model_is_the_reference(qwen3_5_preset, tmp_path_factory):
    """The torch model the export check compares the graphs with (the tower on 4.57.1, colembed's
    text stack) gives the reference's embeddings on the reference's own inputs."""
    import torch

    from colembed_export.families.qwen3_5.model import load_colqwen3_5

    ref = reference(tmp_path_factory, qwen3_5_preset)
    model = load_colqwen3_5(checkpoint(tmp_path_factory, qwen3_5_preset))
    with torch.no_grad():
        for i in range(len(QUERIES)):
            ids = torch.from_numpy(ref[f"query{i}_ids"])[None]
            got = model(input_ids=ids, attention_mask=torch.ones_like(ids)).embeddings[0]
            assert np.abs(got.numpy() - ref[f"query{i}"]).max() <= TOLERANCE, i
        for i in range(len(pages())):
            ids = torch.from_numpy(ref[f"page{i}_ids"])[None]
            got = model(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                pixel_values=torch.from_numpy(ref[f"page{i}_pixels"]),
                image_grid_thw=torch.from_numpy(ref[f"page{i}_grid"])[None],
            ).embeddings[0]
            assert np.abs(got.numpy() - ref[f"page{i}"]).max() <= TOLERANCE, i


@pytest.mark.slow
def test_the_exported_folder_gives_the_references_embeddings(qwen3_5_preset, tmp_path_factory):
    import colembed

    ref = reference(tmp_path_factory, qwen3_5_preset)
    model = colembed.load(exported(tmp_path_factory, qwen3_5_preset))
    assert model.family.name == "colqwen3.5"
    alone = [model.embed_queries([q])[0] for q in QUERIES]
    batched = model.embed_queries(list(QUERIES), batch_size=len(QUERIES))
    for i in range(len(QUERIES)):
        for got, key in ((alone[i], f"query{i}"), (batched[i], f"query{i}_batched")):
            assert got.shape == ref[key].shape, key
            assert np.abs(got - ref[key]).max() <= TEXT_TOLERANCE, key
    images = pages()
    alone = [model.embed_images([page])[0] for page in images]
    batched = model.embed_images(images[:BATCHED_PAGES], batch_size=BATCHED_PAGES)
    for i in range(len(images)):
        assert alone[i].shape == ref[f"page{i}"].shape, i
        assert np.abs(alone[i] - ref[f"page{i}"]).max() <= TOLERANCE, i
    for i in range(BATCHED_PAGES):
        assert np.abs(batched[i] - ref[f"page{i}_batched"]).max() <= TOLERANCE, i


@pytest.mark.slow
def test_a_page_budget_past_the_text_graphs_bound_is_refused(qwen3_5_preset, tmp_path_factory):
    """The DeltaNet scan computes `Family.max_text_tokens` tokens exactly: a budget whose page
    prompt is longer is refused at load, naming the largest budget that fits; that one loads."""
    import colembed
    from colembed.errors import ImageError

    folder = exported(tmp_path_factory, qwen3_5_preset)
    bound = colembed.load(folder).family.max_text_tokens
    with pytest.raises(ImageError, match=f"past the {bound} ColQwen3.5") as refused:
        colembed.load(folder, max_image_tokens=bound)
    fits = int(str(refused.value).rsplit("max_image_tokens <= ", 1)[1])
    assert colembed.load(folder, max_image_tokens=fits).max_image_tokens == fits


def test_the_exported_text_graph_is_standard_ops_without_loops(qwen3_5_preset, tmp_path_factory):
    """The text graph (dynamo) holds only standard ONNX ops and no Loop, Scan or If: the DeltaNet
    scan is unrolled to a fixed sequence, so every execution provider runs it as it is."""
    import onnx

    from colembed.manifest import read_manifest

    folder = exported(tmp_path_factory, qwen3_5_preset)
    text = read_manifest(folder).graph("fp32", "text").file
    graph = onnx.load(str(folder / text), load_external_data=False).graph
    assert {n.domain for n in graph.node} <= {"", "ai.onnx"}
    assert not {"Loop", "Scan", "If"} & {n.op_type for n in graph.node}
