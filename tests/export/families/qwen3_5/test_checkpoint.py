"""Reading a ColQwen3.5 folder as colpali-engine 0.3.18 saves it on transformers 5.24
(`families/qwen3_5/checkpoint.py`, the preprocessing reader): every tensor is placed by the
declared layout, and what does not fit is refused naming it (a tensor the layout does not name,
a missing or mis-shaped one, a projection whose width disagrees with `dim`, missing processor
settings), never exported as random layers or guessed settings.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.fixtures.colqwen3_5 import checkpoint

pytestmark = [pytest.mark.heavy("qwen3.5"), pytest.mark.slow]


def _copy(tmp_path_factory, tmp_path):
    source = checkpoint(tmp_path_factory, "tiny-3.5")
    folder = tmp_path / "copy"
    shutil.copytree(source, folder)
    return folder


def _rewrite_weights(folder, change):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_every_tensor_has_its_place(tmp_path_factory):
    from colembed_export.families.qwen3_5.checkpoint import read_checkpoint

    read = read_checkpoint(checkpoint(tmp_path_factory, "tiny-3.5"))
    assert read.embedding_dim == 128 == read.config["dim"]
    assert set(read.tensors["projection"]) == {"weight", "bias"}
    assert "pos_embed.weight" in read.tensors["visual"]
    assert "embed_tokens.weight" in read.tensors["language_model"]
    keys = [key for part in read.tensors.values() for _, key in part.values()]
    assert not [k for k in keys if k.startswith("model.")]  # the reference saves no prefix
    alt = read_checkpoint(checkpoint(tmp_path_factory, "tiny-3.5-alt"))
    assert alt.embedding_dim == 48  # the config's `dim`, not colpali-engine's default


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda t: t.update({"model.visual.extra": t["visual.pos_embed.weight"].clone()}),
            "does not name",
        ),
        (lambda t: t.pop("custom_text_proj.weight"), "no projection weight"),
        (lambda t: t.pop("visual.merger.norm.bias"), "missing visual"),
        (
            lambda t: t.update({"visual.merger.norm.bias": t["visual.merger.norm.bias"][:3]}),
            "mis-shaped",
        ),
    ],
)
def test_a_partial_or_foreign_checkpoint_is_refused(change, message, tmp_path_factory, tmp_path):
    from colembed.errors import ExportError
    from colembed_export.families.qwen3_5.checkpoint import load_vision_tower, read_checkpoint

    folder = _copy(tmp_path_factory, tmp_path)
    _rewrite_weights(folder, change)
    with pytest.raises(ExportError, match=message):
        load_vision_tower(read_checkpoint(folder))


def test_the_multi_token_prediction_head_is_ignored(tmp_path_factory, tmp_path):
    from colembed_export.families.qwen3_5.checkpoint import read_checkpoint

    folder = _copy(tmp_path_factory, tmp_path)
    _rewrite_weights(
        folder, lambda t: t.update({"mtp.fc.weight": t["custom_text_proj.weight"].clone()})
    )
    read = read_checkpoint(folder)
    assert not [k for part in read.tensors.values() for _, k in part.values() if "mtp" in k]


def test_a_dim_that_disagrees_with_the_projection_is_refused(tmp_path_factory, tmp_path):
    from colembed.errors import ExportError
    from colembed_export.families.qwen3_5.checkpoint import read_checkpoint

    folder = _copy(tmp_path_factory, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "dim": 320}))
    with pytest.raises(ExportError, match="dim 320 disagrees with the projection's 128 rows"):
        read_checkpoint(folder)


def test_missing_processor_files_are_named(tmp_path_factory, tmp_path):
    """transformers 5.x's save writes no preprocessor_config.json: the image processor's settings
    are processor_config.json's `image_processor`; without either, the folder is refused naming
    them, and without the tokenizer naming tokenizer.json."""
    from colembed.errors import ColembedError
    from colembed_export.families.checkpoint import check_required_files

    folder = _copy(tmp_path_factory, tmp_path)
    assert not (folder / "preprocessor_config.json").exists()
    check_required_files(folder)
    (folder / "processor_config.json").unlink()
    with pytest.raises(ColembedError, match="processor_config.json"):
        check_required_files(folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ColembedError, match="tokenizer.json"):
        check_required_files(folder)
