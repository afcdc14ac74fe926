"""The exporter refuses what it cannot export faithfully, with a clear message."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tests.fixtures.builds import PARITY_TOLERANCE

from colembed.errors import ExportError
from colembed_export.pipeline.destination import is_export_folder
from colembed_export.pipeline.exporter import export_model

pytestmark = pytest.mark.heavy("tiny")


@pytest.fixture
def checkpoint_copy(tiny_checkpoint, tmp_path):
    return shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")


def test_missing_tensor_is_refused(checkpoint_copy, tmp_path):
    from safetensors.numpy import load_file, save_file

    weights = load_file(checkpoint_copy / "model.safetensors")
    dropped = next(k for k in weights if "blocks.1.mlp.fc2.weight" in k)
    del weights[dropped]
    save_file(weights, checkpoint_copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ExportError, match=r"missing.*blocks\.1\.mlp\.fc2\.weight"):
        export_model(checkpoint_copy, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_other_architecture_is_refused(checkpoint_copy, tmp_path):
    config = json.loads((checkpoint_copy / "config.json").read_text())
    config["model_type"] = "paligemma"
    (checkpoint_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="paligemma"):
        export_model(checkpoint_copy, tmp_path / "out")


def test_other_backbone_is_refused(checkpoint_copy, tmp_path):
    config = json.loads((checkpoint_copy / "config.json").read_text())
    config["vlm_config"]["model_type"] = "qwen4_vl"
    (checkpoint_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="qwen4_vl"):
        export_model(checkpoint_copy, tmp_path / "out")


def test_folder_with_a_different_model_is_refused(exported_tiny, tiny_alt_checkpoint, tmp_path):
    out = shutil.copytree(exported_tiny.folder, tmp_path / "existing")
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ExportError, match="different model"):
        export_model(tiny_alt_checkpoint, out, check=False)
    assert sorted(p.name for p in out.iterdir()) == before  # untouched


def _snapshot(folder):
    """Every file under `folder` with its bytes: what a refused export must leave unchanged."""
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("overwrite", [False, True])
def test_user_folder_is_refused_even_with_overwrite(tiny_checkpoint, tmp_path, overwrite):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "thesis.txt").write_text("precious")
    with pytest.raises(ExportError, match="not a colembed model folder.*thesis.txt"):
        export_model(tiny_checkpoint, out, check=False, overwrite=overwrite)
    assert (out / "thesis.txt").read_text() == "precious"
    assert [p.name for p in tmp_path.iterdir()] == ["notes"]  # no staging left behind


@pytest.mark.parametrize(
    "where, reason",
    [
        (lambda ckpt: ckpt, "is the source checkpoint"),
        (lambda ckpt: ckpt / "export", "inside the source checkpoint"),
        (lambda ckpt: ckpt.parent, "contains the source checkpoint"),
    ],
)
def test_source_checkpoint_is_never_a_destination(checkpoint_copy, where, reason):
    before = _snapshot(checkpoint_copy.parent)
    with pytest.raises(ExportError, match=reason):
        export_model(checkpoint_copy, where(checkpoint_copy), check=False, overwrite=True)
    assert _snapshot(checkpoint_copy.parent) == before


@pytest.mark.parametrize("folder", ["cwd", "home"])
def test_working_and_home_folders_are_refused(tiny_checkpoint, tmp_path, monkeypatch, folder):
    user = tmp_path / folder
    user.mkdir()
    (user / "todo.txt").write_text("mine")
    monkeypatch.chdir(user) if folder == "cwd" else monkeypatch.setenv("HOME", str(user))
    target = "." if folder == "cwd" else "~"
    with pytest.raises(ExportError, match="root, home or working folder"):
        export_model(tiny_checkpoint, target, check=False, overwrite=True)
    assert _snapshot(user) == {Path("todo.txt"): b"mine"}


def test_export_with_a_foreign_file_is_refused(copy_model_folder, tiny_alt_checkpoint):
    out = copy_model_folder("existing")
    (out / "my-notes.md").write_text("added by the user")
    before = _snapshot(out)
    with pytest.raises(ExportError, match="my-notes.md"):
        export_model(tiny_alt_checkpoint, out, check=False, overwrite=True)
    assert _snapshot(out) == before


def test_file_and_link_destinations_are_refused(copy_model_folder, tiny_checkpoint, tmp_path):
    existing = copy_model_folder("existing")
    link = tmp_path / "link"
    link.symlink_to(existing, target_is_directory=True)
    plain = tmp_path / "plain.txt"
    plain.write_text("a file")
    for out in (link, plain):
        with pytest.raises(ExportError, match="not a folder"):
            export_model(tiny_checkpoint, out, check=False, overwrite=True)
    assert link.is_symlink() and plain.read_text() == "a file"


def test_is_export_folder(copy_model_folder, tmp_path):
    export = copy_model_folder("export")
    assert is_export_folder(export)
    (export / "vision.onnx_data").unlink()  # a listed file missing: still only colembed's files
    assert is_export_folder(export)
    (export / "extra").mkdir()
    assert not is_export_folder(export)
    (tmp_path / "empty").mkdir()
    assert not is_export_folder(tmp_path / "empty")


def test_overwrite_replaces_an_export_of_another_model(exported_alt_from_hub):
    """conftest's tiny-alt export went, with overwrite, over a copy of the tiny export."""
    report, _, listing = exported_alt_from_hub
    assert report.folder.name == "existing" and report.manifest.embedding_dim == 64
    # Never guessed from the fixture's colembed_tiny.json: only an explicit random_weights=True.
    assert report.manifest.model.random_weights is False
    assert is_export_folder(report.folder)
    assert listing == ["existing"]  # no staging, no old copy


def test_cli_refuses_overwrite_of_a_user_folder(tiny_checkpoint, tmp_path, capsys):
    from colembed.cli import main

    out = tmp_path / "photos"
    out.mkdir()
    (out / "cat.jpg").write_bytes(b"\xff\xd8 not really")
    assert (
        main(["export", str(tiny_checkpoint), "--out", str(out), "--overwrite", "--no-check"]) == 1
    )  # a runtime refusal (2 is for usage errors)
    assert "not a colembed model folder" in capsys.readouterr().err
    assert (out / "cat.jpg").read_bytes() == b"\xff\xd8 not really"


def test_unknown_source_is_refused(tmp_path):
    with pytest.raises(ExportError, match="no such folder"):
        export_model(tmp_path / "does-not-exist", tmp_path / "out")


def test_hub_source_goes_through_snapshot_download(exported_alt_from_hub):
    """A repo id is fetched with huggingface-hub; conftest's tiny-alt export named one, and the
    boundary call (`snapshot_download`) answered with the local checkpoint folder."""
    from tests.fixtures.builds import ALT_HUB_REPO, ALT_HUB_REVISION

    report, calls, _ = exported_alt_from_hub
    assert calls["repo_id"] == ALT_HUB_REPO and calls["revision"] == ALT_HUB_REVISION
    assert "*.safetensors" in calls["patterns"]
    assert report.manifest.model.source == ALT_HUB_REPO
    assert report.manifest.model.revision == ALT_HUB_REVISION


def test_offline_hub_failure_is_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ExportError, match="could not download"):
        export_model("vidore/colqwen2-v1.0-hf", tmp_path / "out", check=False)


def test_failed_check_says_where(exported_tiny, tiny_checkpoint):
    """A tolerance no float graph can meet: the check fails and names every comparison. Run on the
    session's export; that `export_model` then writes nothing and leaves no staging is
    test_export_check.py's wrong-graph test (an export whose check fails)."""
    from colembed_export.families.checkpoint import load_strict
    from colembed_export.constants import FEATURE_TOLERANCE
    from colembed_export.pipeline.verify import compare_with_reference, reference_outputs

    reference = reference_outputs(load_strict(tiny_checkpoint), tiny_checkpoint)
    with pytest.raises(ExportError) as caught:
        compare_with_reference(
            exported_tiny.folder, reference, tolerance=1e-12, feature_tolerance=FEATURE_TOLERANCE
        )
    message = str(caught.value)
    assert "nothing was written" in message and "query" in message and "image features" in message
    assert "FAIL" in message


def test_export_hands_its_tolerance_to_the_check(exported_alt_from_hub):
    """conftest's tiny-alt export asked for half the default tolerance: the check ran with it."""
    from tests.fixtures.builds import ALT_TOLERANCE

    check = exported_alt_from_hub[0].manifest.checks["fp32"]
    assert check["tolerance"] == ALT_TOLERANCE != PARITY_TOLERANCE
    assert check["max_abs_diff"] <= ALT_TOLERANCE


def test_exported_graphs_have_no_reshape_allowzero(exported_tiny):
    import onnx

    for name in ("vision.onnx", "text.onnx"):
        model = onnx.load(str(exported_tiny.folder / name), load_external_data=False)
        flagged = [
            n.name
            for n in model.graph.node
            if n.op_type == "Reshape"
            and any(a.name == "allowzero" and a.i == 1 for a in n.attribute)
        ]
        assert flagged == [], (name, flagged)
        assert model.opset_import[0].version == 18 or any(
            o.domain in ("", "ai.onnx") and o.version == 18 for o in model.opset_import
        )


def test_vision_attention_is_the_fused_onnxruntime_op(exported_tiny):
    """The image graph's attention runs as com.microsoft.MultiHeadAttention, one per block."""
    import onnx

    model = onnx.load(str(exported_tiny.folder / "vision.onnx"), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    depth = exported_tiny.manifest.architecture.vision_depth
    assert ops.count("MultiHeadAttention") == depth
    assert "Softmax" not in ops


def test_text_attention_is_the_fused_onnxruntime_ops(exported_tiny):
    """The text graph's attention runs as com.microsoft.GroupQueryAttention and its rotary as
    RotaryEmbedding (query and key), one of each per layer: no Softmax and no per-layer
    (batch, heads, tokens, head_dim) Transposes left (one stays: the rotary angles', once)."""
    import onnx

    model = onnx.load(str(exported_tiny.folder / "text.onnx"), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    layers = exported_tiny.manifest.architecture.text_layers
    assert ops.count("GroupQueryAttention") == layers and ops.count("RotaryEmbedding") == 2 * layers
    assert "Softmax" not in ops and "IsNaN" not in ops and ops.count("Transpose") <= 1
