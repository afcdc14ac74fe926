"""Tiny ColQwen2.5 checkpoints: real architecture, both attention kinds, both on-disk layouts."""

from __future__ import annotations

import json

import pytest

from tests.fixtures.qwen2_5 import (  # noqa: F401
    PRESETS,
    checkpoint,
    load_reference,
    qwen2_5_checkpoint,
    reference_processor,
)


def test_window_and_full_attention_blocks_are_both_present(qwen2_5_checkpoint):
    visual = load_reference(qwen2_5_checkpoint).vlm.model.visual
    full = set(visual.fullatt_block_indexes)
    windowed = set(range(len(visual.blocks))) - full
    assert full and windowed
    assert type(visual).__name__ == "Qwen2_5_VisionTransformerPretrainedModel"
    assert type(visual.blocks[0].norm1).__name__ == "Qwen2RMSNorm"  # not Qwen2-VL's LayerNorm


def test_checkpoint_uses_the_real_tokenizer_and_training_pixel_bounds(qwen2_5_checkpoint):
    """Each folder's files; the reference processor reads them (checked for one in the pipeline)."""
    from tokenizers import Tokenizer

    from colembed_export.testing.tiny_qwen2 import TOKENIZER_FILES, qwen_tokenizer_dir

    for name in TOKENIZER_FILES:
        assert (qwen2_5_checkpoint / name).read_bytes() == (
            qwen_tokenizer_dir() / name
        ).read_bytes()
    assert (
        Tokenizer.from_file(str(qwen2_5_checkpoint / "tokenizer.json")).token_to_id("<|image_pad|>")
        == 151655
    )
    image = json.loads((qwen2_5_checkpoint / "preprocessor_config.json").read_text())
    assert (image["min_pixels"], image["max_pixels"]) == (4 * 28 * 28, 768 * 28 * 28)


@pytest.mark.parametrize("preset", PRESETS)
def test_colpali_layout_holds_the_same_weights_under_the_published_names(tmp_path_factory, preset):
    """The published layout (`model.*`, `visual.*`, `custom_text_proj.*`) loads into
    transformers' `Qwen2_5_VLModel` through its own checkpoint conversion mapping, which is the
    mapping colpali-engine 0.3.12 `ColQwen2_5.from_pretrained` passes, with nothing missing."""
    import torch
    from safetensors import safe_open
    from transformers import Qwen2_5_VLModel

    reference = load_reference(checkpoint(tmp_path_factory, preset, "transformers"))
    folder = checkpoint(tmp_path_factory, preset, "colpali")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_vl" and config["architectures"] == ["ColQwen2_5"]
    backbone, info = Qwen2_5_VLModel.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True
    )
    assert info["missing_keys"] == [] or set(info["missing_keys"]) == set()
    assert set(info["unexpected_keys"]) == {"custom_text_proj.weight", "custom_text_proj.bias"}
    expected = reference.vlm.model.state_dict()
    for name, value in backbone.state_dict().items():
        assert torch.equal(value, expected[name]), name
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert not any(k.startswith(("vlm.", "lm_head")) for k in f.keys())
        assert torch.equal(
            f.get_tensor("custom_text_proj.weight"), reference.embedding_proj_layer.weight
        )


def test_reference_page_forward_needs_the_dtype_shim(tmp_path_factory):
    """Pins a finding of docs/reference-colqwen2_5.md: transformers 4.57.1 `ColQwen2ForRetrieval`
    calls `visual.get_dtype()`, which only Qwen2-VL's tower has; with the shim it runs."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers import ColQwen2ForRetrieval

    folder = checkpoint(tmp_path_factory, "tiny-2.5", "transformers")
    model = ColQwen2ForRetrieval.from_pretrained(
        folder, dtype=torch.float32
    ).eval()  # patched below
    processor = reference_processor(folder)
    page = Image.fromarray(np.random.default_rng(0).integers(0, 256, (112, 140, 3), dtype=np.uint8))
    batch = processor.process_images([page])
    with torch.no_grad(), pytest.raises(AttributeError, match="get_dtype"):
        model(**batch)
    model.vlm.model.visual.get_dtype = lambda: torch.float32
    with torch.no_grad():
        embeddings = model(**batch).embeddings
    assert embeddings.shape == (1, batch["input_ids"].shape[1], 128)
    assert torch.isfinite(embeddings).all()


@pytest.mark.parametrize("preset", PRESETS)
def test_both_layouts_load_to_the_same_model(tmp_path_factory, preset):
    import torch

    from colembed_export.families.qwen2_5.checkpoint import checkpoint_layout, load_colqwen2_5

    hf_folder = checkpoint(tmp_path_factory, preset, "transformers")
    cp_folder = checkpoint(tmp_path_factory, preset, "colpali")
    assert (checkpoint_layout(hf_folder), checkpoint_layout(cp_folder)) == (
        "transformers",
        "colpali",
    )
    expected = load_reference(hf_folder).state_dict()
    loaded = load_colqwen2_5(cp_folder)
    assert loaded.config.embedding_dim == load_reference(hf_folder).config.embedding_dim
    for name, value in loaded.state_dict().items():
        if not name.startswith("vlm.lm_head.") or loaded.config.vlm_config.tie_word_embeddings:
            assert torch.equal(value, expected[name]), name


def test_other_folders_are_refused_with_the_reason(tmp_path_factory, tmp_path):
    from colembed.errors import ModelFolderError
    from colembed_export.families.qwen2_5.checkpoint import checkpoint_layout, to_transformers_names

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    with pytest.raises(ModelFolderError, match="not a ColQwen2.5 checkpoint"):
        checkpoint_layout(tmp_path)
    with pytest.raises(ModelFolderError, match="score.weight"):
        to_transformers_names({"visual.x": 0, "lm_head.weight": 0, "score.weight": 0})


@pytest.mark.parametrize(
    "change, match",
    [
        ({"window_size": 70}, "multiple of 28"),
        ({"fullatt_block_indexes": (3,)}, "outside depth"),
        ({"mrope_section": (2, 2, 2)}, "mrope_section"),
    ],
)
def test_inconsistent_specs_are_refused(change, match):
    from dataclasses import replace

    from colembed_export.testing.tiny_qwen2_5 import PRESETS_2_5, build_vlm_config

    with pytest.raises(ValueError, match=match):
        build_vlm_config(replace(PRESETS_2_5["tiny-2.5"], **change))
