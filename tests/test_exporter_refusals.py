"""Issue 3: the exporter refuses what it cannot export faithfully, with a clear message."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from colembed.errors import ExportError
from colembed_export.destination import is_export_folder
from colembed_export.exporter import export_model


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
    config["vlm_config"]["model_type"] = "qwen3_vl"
    (checkpoint_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="qwen3_vl"):
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


@pytest.mark.parametrize("where, reason", [
    (lambda ckpt: ckpt, "is the source checkpoint"),
    (lambda ckpt: ckpt / "export", "inside the source checkpoint"),
    (lambda ckpt: ckpt.parent, "contains the source checkpoint"),
])
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


@pytest.mark.slow
def test_overwrite_replaces_an_export_of_another_model(copy_model_folder, tiny_alt_checkpoint,
                                                       tmp_path):
    out = copy_model_folder("existing")
    report = export_model(tiny_alt_checkpoint, out, check=False, overwrite=True)
    assert report.folder == out and report.manifest.embedding_dim == 64
    # Never guessed from the fixture's colembed_tiny.json: only an explicit random_weights=True.
    assert report.manifest.model.random_weights is False
    assert is_export_folder(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]  # no staging, no old copy


def test_cli_refuses_overwrite_of_a_user_folder(tiny_checkpoint, tmp_path, capsys):
    from colembed.cli import main

    out = tmp_path / "photos"
    out.mkdir()
    (out / "cat.jpg").write_bytes(b"\xff\xd8 not really")
    assert main(["export", str(tiny_checkpoint), "--out", str(out), "--overwrite",
                 "--no-check"]) == 2
    assert "not a colembed model folder" in capsys.readouterr().err
    assert (out / "cat.jpg").read_bytes() == b"\xff\xd8 not really"


def test_unknown_source_is_refused(tmp_path):
    with pytest.raises(ExportError, match="no such folder"):
        export_model(tmp_path / "does-not-exist", tmp_path / "out")


@pytest.mark.slow  # runs the exporter
def test_hub_source_goes_through_snapshot_download(tiny_checkpoint, tmp_path, monkeypatch):
    """A repo id is fetched with huggingface-hub; the boundary call is replaced by a local folder."""
    calls = {}

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None, **_):
        calls.update(repo_id=repo_id, revision=revision, patterns=allow_patterns)
        return str(tiny_checkpoint)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    report = export_model("someone/colqwen2-test", tmp_path / "out", revision="abc123", check=False)
    assert calls["repo_id"] == "someone/colqwen2-test" and calls["revision"] == "abc123"
    assert "*.safetensors" in calls["patterns"]
    assert report.manifest.model.source == "someone/colqwen2-test"
    assert report.manifest.model.revision == "abc123"


def test_offline_hub_failure_is_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ExportError, match="could not download"):
        export_model("vidore/colqwen2-v1.0-hf", tmp_path / "out", check=False)


@pytest.mark.slow  # runs the exporter
def test_failed_check_writes_nothing_and_says_where(tiny_checkpoint, tmp_path):
    """A tolerance no float graph can meet: the check must fail, name the comparisons, write nothing."""
    with pytest.raises(ExportError) as caught:
        export_model(tiny_checkpoint, tmp_path / "out", tolerance=1e-12)
    message = str(caught.value)
    assert "nothing was written" in message and "query" in message and "image features" in message
    assert not (tmp_path / "out").exists()
    assert not any(p.name.startswith(".out.staging") for p in tmp_path.iterdir())


def test_exported_graphs_have_no_reshape_allowzero(exported_tiny):
    import onnx

    for name in ("vision.onnx", "text.onnx"):
        model = onnx.load(str(exported_tiny.folder / name), load_external_data=False)
        flagged = [n.name for n in model.graph.node if n.op_type == "Reshape"
                   and any(a.name == "allowzero" and a.i == 1 for a in n.attribute)]
        assert flagged == [], (name, flagged)
        assert model.opset_import[0].version == 18 or any(
            o.domain in ("", "ai.onnx") and o.version == 18 for o in model.opset_import)


def test_vision_attention_is_the_fused_onnxruntime_op(exported_tiny):
    """The image graph's attention runs as com.microsoft.MultiHeadAttention, one per block."""
    import onnx

    model = onnx.load(str(exported_tiny.folder / "vision.onnx"), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    depth = exported_tiny.manifest.architecture.vision_depth
    assert ops.count("MultiHeadAttention") == depth
    assert "Softmax" not in ops
