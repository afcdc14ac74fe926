"""The family declarations (`colembed.families`): what each family reads from a checkpoint, the
contracts it declares, the manifest's `family` / `vision_attention` (strict, with the first
release's folders read as ColQwen2), and the runtime refusing a folder that claims the wrong one."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import colembed
from colembed.contracts import colqwen2_contracts
from colembed.errors import ManifestError, ModelFolderError
from colembed.families import (
    COLQWEN2,
    COLQWEN2_5,
    COLQWEN3,
    FAMILIES,
    UnknownFamilyError,
    VisionAttention,
    family_of_backbone,
    family_of_checkpoint,
    get_family,
)
from colembed.layout import MANIFEST_NAME
from colembed.manifest import Manifest
from colembed_export.families.preprocess_config import read_preprocess_config
from colembed.preprocess.windows import window_layout, windowed_vision_contract
from tests.fixtures.qwen2_5 import checkpoint


def _edit_config(folder, tmp_path, edit):
    copy = shutil.copytree(folder, tmp_path / "edited")
    config = json.loads((copy / "config.json").read_text())
    edit(config)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


# ------------------------------------------------------------------------ reading a checkpoint
@pytest.mark.parametrize("layout", ["transformers", "colpali"])
@pytest.mark.parametrize("preset", ["tiny-2.5", "tiny-2.5-alt"])
def test_colqwen2_5_head_dim_is_its_hidden_size_over_heads(tmp_path_factory, preset, layout):
    folder = checkpoint(tmp_path_factory, preset, layout)
    config = json.loads((folder / "config.json").read_text())
    vision = config.get("vlm_config", config)["vision_config"]
    assert family_of_backbone(config) is COLQWEN2_5 and family_of_checkpoint(config) is COLQWEN2_5
    assert (
        read_preprocess_config(folder).vision_head_dim
        == vision["hidden_size"] // vision["num_heads"]
    )
    text = config.get("vlm_config", config)["text_config"]
    assert COLQWEN2_5.merger_width(vision) == vision["out_hidden_size"] == text["hidden_size"]


def test_a_name_of_the_other_family_is_never_read(tiny_checkpoint, tmp_path):
    """Qwen2-VL's `hidden_size` is its merger's output: without `embed_dim` the folder is refused,
    never read through the other family's name."""

    def drop_embed_dim(config):
        del config["vlm_config"]["vision_config"]["embed_dim"]

    vision = json.loads((tiny_checkpoint / "config.json").read_text())["vlm_config"][
        "vision_config"
    ]
    assert COLQWEN2.merger_width(vision) == vision["hidden_size"] != vision["embed_dim"]
    folder = _edit_config(tiny_checkpoint, tmp_path, drop_embed_dim)
    with pytest.raises(ModelFolderError, match=r"vision_config\.embed_dim .*colqwen2 checkpoint"):
        read_preprocess_config(folder)


def test_an_unknown_backbone_is_refused_naming_it(tiny_checkpoint, tmp_path):
    def qwen4(config):
        config["vlm_config"]["model_type"] = "qwen4_vl"

    with pytest.raises(ModelFolderError, match="qwen4_vl"):
        read_preprocess_config(_edit_config(tiny_checkpoint, tmp_path, qwen4))


def test_a_vision_rope_base_the_reference_ignores_is_refused(tiny_checkpoint, tmp_path):
    """4.57.1's Qwen2-VL tower fixes its rotary base at 10000: a checkpoint asking for another
    is refused naming the field, never exported as if it were 10000."""

    def theta(value):
        def edit(config):
            config["vlm_config"]["vision_config"]["rope_parameters"] = {
                "rope_type": "axial",
                "rope_theta": value,
            }

        return edit

    assert (
        read_preprocess_config(
            _edit_config(tiny_checkpoint, tmp_path / "a", theta(10000.0))
        ).vision_rope_theta
        == 10000.0
    )
    with pytest.raises(
        ModelFolderError, match=r"vision_config\.rope_parameters\.rope_theta is 5000"
    ):
        read_preprocess_config(_edit_config(tiny_checkpoint, tmp_path / "b", theta(5000.0)))


@pytest.mark.parametrize(
    "params, message",
    [
        ({"rope_type": "axial", "rope_theta": 5000}, None),
        ({"rope_theta": 20000.0}, None),
        ({}, None),
        ({"rope_type": "yarn", "rope_theta": 5000}, "rope_type 'yarn'"),
        ({"rope_type": "axial", "rope_theta": "5000"}, "must be a number"),
        ({"rope_type": "axial", "rope_theta": float("nan")}, "must be a number"),
        ({"rope_type": "axial", "rope_theta": True}, "must be a number"),
        ([5000], "must be an object"),
    ],
)
def test_colqwen3_takes_its_vision_rope_base_from_the_config(params, message):
    """The pinned ColQwen3 reference (transformers 5.x) reads vision_config.rope_parameters."""
    if message is None:
        want = float(params.get("rope_theta", 10000.0)) if isinstance(params, dict) else None
        assert COLQWEN3.vision_rope_theta({"rope_parameters": params}) == want
    else:
        with pytest.raises(ModelFolderError, match=message):
            COLQWEN3.vision_rope_theta({"rope_parameters": params})
    assert COLQWEN3.vision_rope_theta({}) == 10000.0


def test_image_processor_settings_saved_the_transformers_5_way_are_read(tiny_checkpoint, tmp_path):
    """transformers 5.x's `save_pretrained` writes the image processor into processor_config.json
    (no preprocessor_config.json): the same constants are read from there; with neither, the
    folder is refused naming both."""
    want = read_preprocess_config(tiny_checkpoint)
    moved = shutil.copytree(tiny_checkpoint, tmp_path / "moved")
    image = json.loads((moved / "preprocessor_config.json").read_text())
    (moved / "preprocessor_config.json").unlink()
    processor = {}
    if (moved / "processor_config.json").exists():
        processor = json.loads((moved / "processor_config.json").read_text())
    (moved / "processor_config.json").write_text(
        json.dumps({**processor, "image_processor": image})
    )
    assert read_preprocess_config(moved) == want
    (moved / "processor_config.json").write_text(json.dumps(processor))
    with pytest.raises(ModelFolderError, match="neither preprocessor_config.json nor"):
        read_preprocess_config(moved)


def test_checkpoint_layouts_are_declared_per_family():
    assert (
        family_of_checkpoint({"model_type": "colqwen2", "vlm_config": {"model_type": "qwen2_vl"}})
        is COLQWEN2
    )
    assert family_of_checkpoint({"model_type": "qwen2_5_vl"}) is COLQWEN2_5
    # a bare Qwen2-VL config is colpali-engine's unconverted ColQwen2: not an export layout
    assert family_of_checkpoint({"model_type": "qwen2_vl"}) is None
    assert family_of_backbone({"model_type": "qwen2_vl"}) is COLQWEN2
    assert family_of_checkpoint({"model_type": "qwen3_vl"}) is COLQWEN3  # colpali-engine 0.3.18
    assert (
        family_of_checkpoint({"model_type": "colqwen2", "vlm_config": {"model_type": "qwen3_vl"}})
        is None
    )
    with pytest.raises(UnknownFamilyError, match="colqwen4"):
        get_family("colqwen4")


# ---------------------------------------------------------------------------------- contracts
def test_contracts_differ_only_in_the_image_graphs_window_inputs():
    numbers = dict(patch_dim=1176, vision_head_dim=80, text_hidden=2048, embedding_dim=128)
    assert COLQWEN2.contracts(**numbers) == colqwen2_contracts(**numbers)
    windowed = COLQWEN2_5.contracts(**numbers)
    assert windowed["text"] == colqwen2_contracts(**numbers)["text"]
    assert windowed["vision"] == windowed_vision_contract(1176, 80, 2048)


def test_window_inputs_per_grid_are_the_window_layouts():
    attention = VisionAttention("windowed", 112)
    made = attention.grid_inputs((1, 22, 30), merge_size=2, patch_size=14)
    expected = window_layout(
        (1, 22, 30), merge_size=2, patch_size=14, window_size=112
    ).graph_inputs()
    assert [spec.name for spec in attention.extra_inputs] == list(expected)
    for got, want in zip(made, expected.values()):
        np.testing.assert_array_equal(got, want)
    assert VisionAttention("full").grid_inputs((1, 22, 30), merge_size=2, patch_size=14) == ()


# ------------------------------------------------------------------------------------ manifest
BAD_ATTENTION = [  # (vision_attention, the message naming the field)
    ({"kind": "sliding", "window_size": 112}, r"vision_attention: kind 'sliding' is not one of"),
    ({"kind": "windowed"}, r"vision_attention: windowed attention needs a positive int window"),
    ({"kind": "windowed", "window_size": 0}, r"vision_attention: windowed attention needs"),
    ({"kind": "windowed", "window_size": 112.0}, r"vision_attention: windowed attention needs"),
    ({"kind": "windowed", "window_size": 112, "shift": 1}, r"vision_attention: unknown keys"),
    ({"kind": "full"}, r"vision_attention\.kind: 'full' contradicts family 'colqwen2\.5'"),
    ({"window_size": 112}, r"vision_attention\.kind: expected one of"),
    ("windowed", r"vision_attention: expected dict"),
]


@pytest.fixture(scope="module")
def manifest_2_5(exported_tiny_2_5):
    return json.loads((exported_tiny_2_5.folder / MANIFEST_NAME).read_text())


def test_a_colqwen2_5_manifest_round_trips(manifest_2_5):
    manifest = Manifest.from_dict(manifest_2_5)
    assert manifest.to_dict() == manifest_2_5
    assert manifest.family == "colqwen2.5" and manifest.vision_attention.window_size == 56


@pytest.mark.parametrize("attention, message", BAD_ATTENTION, ids=[m for _, m in BAD_ATTENTION])
def test_bad_vision_attention_is_refused_naming_the_field(manifest_2_5, attention, message):
    with pytest.raises(ManifestError, match=message):
        Manifest.from_dict({**manifest_2_5, "vision_attention": attention})


def test_unknown_or_half_declared_family_is_refused(manifest_2_5):
    with pytest.raises(ManifestError, match=r"family: 'colqwen4' is not one of"):
        Manifest.from_dict({**manifest_2_5, "family": "colqwen4"})
    with pytest.raises(ManifestError, match=r"family: expected str"):
        Manifest.from_dict({**manifest_2_5, "family": 2.5})
    without = {k: v for k, v in manifest_2_5.items() if k != "vision_attention"}
    with pytest.raises(ManifestError, match=r"vision_attention: missing"):
        Manifest.from_dict(without)
    without = {k: v for k, v in manifest_2_5.items() if k != "family"}
    with pytest.raises(ManifestError, match=r"family: missing"):
        Manifest.from_dict(without)
    assert sorted(FAMILIES) == ["colqwen2", "colqwen2.5", "colqwen3", "colqwen3.5"]
    # vision extras exactly for the family declaring them (ColQwen3), refused elsewhere
    extras = {"position_grid_side": 48, "deepstack_layers": 3}
    with pytest.raises(ManifestError, match=r"vision_extras: present for family 'colqwen2.5'"):
        Manifest.from_dict({**manifest_2_5, "vision_extras": extras})
    with pytest.raises(ManifestError, match=r"vision_extras: expected keys"):
        Manifest.from_dict({**manifest_2_5, "vision_extras": {"position_grid_side": 48}})
    # DeepStack layers exactly for the family whose tower has them
    for family, layers, has in (("colqwen3", 0, "has"), ("colqwen3.5", 3, "has no")):
        claimed = {
            **manifest_2_5,
            "family": family,
            "vision_attention": {"kind": "full"},
            "vision_extras": {"position_grid_side": 48, "deepstack_layers": layers},
        }
        message = rf"deepstack_layers: {layers} for family '{family}', whose tower {has} DeepStack"
        with pytest.raises(ManifestError, match=message):
            Manifest.from_dict(claimed)


def test_a_first_release_folder_loads_as_colqwen2(copy_model_folder):
    """Folders exported before families existed name none; they hold ColQwen2 (that exporter took
    Qwen2-VL checkpoints only), load as before, and say so."""
    folder = copy_model_folder("legacy")
    data = json.loads((folder / MANIFEST_NAME).read_text())
    assert data.pop("family") == "colqwen2" and data.pop("vision_attention") == {"kind": "full"}
    (folder / MANIFEST_NAME).write_text(json.dumps(data))
    model = colembed.load(folder)
    assert model.family is COLQWEN2 and model.manifest.vision_attention == VisionAttention("full")
    assert model.embed_queries(["hi"])[0].shape[1] == 128


def test_a_folder_claiming_the_other_family_is_refused(exported_tiny_2_5, tmp_path):
    folder = shutil.copytree(exported_tiny_2_5.folder, tmp_path / "claims-colqwen2")
    data = json.loads((folder / MANIFEST_NAME).read_text())
    data.update(family="colqwen2", vision_attention={"kind": "full"})
    (folder / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(ModelFolderError, match=r"not ColQwen2's: inputs \[.*'window_rows'"):
        colembed.load(folder)


def test_deepstack_is_declared_per_family():
    """Qwen3.5's tower is Qwen3-VL's without DeepStack: the same learned position table (two more
    image-graph inputs), no DeepStack output or text input; each family refuses the other's
    config, and a VisionExtras may hold zero DeepStack layers only then."""
    from colembed.families import COLQWEN3, COLQWEN3_5, VisionExtras

    vision = {"num_position_embeddings": 2304}
    assert COLQWEN3_5.extras(vision) == VisionExtras(48, 0)
    assert COLQWEN3_5.extras({**vision, "deepstack_visual_indexes": []}) == VisionExtras(48, 0)
    with pytest.raises(ModelFolderError, match=r"empty list \(or absent\) for a colqwen3.5"):
        COLQWEN3_5.extras({**vision, "deepstack_visual_indexes": [5]})
    with pytest.raises(ModelFolderError, match="non-empty list for a colqwen3 checkpoint"):
        COLQWEN3.extras({**vision, "deepstack_visual_indexes": []})
    sizes = dict(patch_dim=1536, vision_head_dim=64, text_hidden=256, embedding_dim=128)
    none = COLQWEN3_5.contracts(**sizes, extras=VisionExtras(48, 0))
    three = COLQWEN3.contracts(**sizes, extras=VisionExtras(48, 3))
    assert [s.name for s in none["vision"].outputs] == ["image_features"]
    assert [s.name for s in none["vision"].inputs] == [s.name for s in three["vision"].inputs]
    assert [s.name for s in none["text"].inputs] == [s.name for s in three["text"].inputs][:-1]
    assert COLQWEN3_5.query_augmentation_token == "<|endoftext|>"
    with pytest.raises(ValueError, match="deepstack_layers must be an int >= 0"):
        VisionExtras(48, -1)
