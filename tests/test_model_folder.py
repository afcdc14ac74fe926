"""Issue 3: the runtime refuses a tampered model folder, and each error names the file."""

from __future__ import annotations

import json
import shutil

import pytest

import colembed
from colembed.errors import ManifestError, ModelFolderError, ProviderError
from colembed.manifest import MANIFEST_NAME, describe_file


def _rewrite_manifest(folder, edit):
    path = folder / MANIFEST_NAME
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_missing_graph_is_named(copy_model_folder):
    folder = copy_model_folder()
    (folder / "text.onnx").unlink()
    with pytest.raises(ModelFolderError, match=r"text\.onnx.*missing"):
        colembed.load(folder)


def test_truncated_external_data_is_named(copy_model_folder):
    folder = copy_model_folder()
    data = folder / "vision.onnx_data"
    assert data.is_file(), "the fixture is exported with external data"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(ModelFolderError, match=r"vision\.onnx_data.*size"):
        colembed.load(folder, verify=False)  # sizes are checked even without hashing


def test_modified_file_fails_sha256(copy_model_folder):
    folder = copy_model_folder()
    data = folder / "text.onnx_data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one flipped byte
    data.write_bytes(bytes(raw))
    with pytest.raises(ModelFolderError, match=r"text\.onnx_data.*sha256"):
        colembed.load(folder)
    colembed.load(folder, verify=False)  # the caller may opt out of hashing


def test_graph_whose_inputs_differ_from_manifest(copy_model_folder):
    """A different graph under the expected name, with the manifest's size/sha updated to match."""
    folder = copy_model_folder()
    shutil.copyfile(folder / "vision.onnx", folder / "text.onnx")

    def edit(manifest):
        manifest["files"]["text.onnx"] = describe_file(folder / "text.onnx")
    _rewrite_manifest(folder, edit)
    with pytest.raises(ModelFolderError, match=r"text\.onnx.*external data.*vision\.onnx_data"):
        colembed.load(folder)  # it reads the vision weights, which its entry does not list

    def edit_data(manifest):
        manifest["variants"]["fp32"]["text"]["data_file"] = "vision.onnx_data"
    _rewrite_manifest(folder, edit_data)
    with pytest.raises(ModelFolderError, match=r"text\.onnx.*contract"):
        colembed.load(folder)


def test_missing_manifest(copy_model_folder):
    folder = copy_model_folder()
    (folder / MANIFEST_NAME).unlink()
    with pytest.raises(ManifestError, match="colembed export"):
        colembed.load(folder)


def test_corrupt_manifest(copy_model_folder):
    folder = copy_model_folder()
    (folder / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ManifestError, match="unreadable"):
        colembed.load(folder)


def test_unknown_variant_lists_the_available_ones(tiny_model, exported_tiny):
    with pytest.raises(ModelFolderError, match=r"int8.*fp32"):
        colembed.load(exported_tiny.folder, variant="int8")


def test_unavailable_provider_is_refused(exported_tiny):
    with pytest.raises(ProviderError, match="DmlExecutionProvider"):
        colembed.load(exported_tiny.folder, providers=["directml"])


def test_auto_provider_falls_to_cpu_only_when_directml_is_absent(exported_tiny):
    model = colembed.load(exported_tiny.folder, providers="auto", threads=1)
    assert model.providers[0] == "CPUExecutionProvider"


def test_not_a_folder(tmp_path):
    with pytest.raises(ModelFolderError, match="colembed export"):
        colembed.load(tmp_path / "nope")


def test_load_by_model_name_uses_the_cache(exported_tiny, tmp_path, monkeypatch):
    shutil.copytree(exported_tiny.folder, tmp_path / "colembed-colqwen2")
    monkeypatch.setenv("FASTEMBED_CACHE_PATH", str(tmp_path))
    model = colembed.load("ColQwen2")
    assert model.folder == tmp_path / "colembed-colqwen2"


def test_load_by_model_name_offline_says_how_to_export(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTEMBED_CACHE_PATH", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelFolderError, match=r"colembed export vidore/colqwen2-v1\.0-hf"):
        colembed.load("colqwen2")


def test_unknown_name_lists_known_models(tmp_path):
    with pytest.raises(ModelFolderError, match=r"colqwen2"):
        colembed.load("colpali-nonsense")


def test_unchanged_files_are_not_hashed_twice(copy_model_folder, monkeypatch):
    import colembed.integrity as manifest_module

    folder = copy_model_folder()
    hashed = []
    real = manifest_module.sha256_of
    monkeypatch.setattr(manifest_module, "sha256_of", lambda p: hashed.append(p.name) or real(p))
    colembed.load(folder)
    assert "text.onnx_data" in hashed
    hashed.clear()
    colembed.load(folder)
    assert hashed == []  # stamps from the first load: same size, mtime, inode, expected sha256
    colembed.load(folder, verify="full")
    assert "text.onnx_data" in hashed
    hashed.clear()
    data = folder / "text.onnx_data"
    raw = bytearray(data.read_bytes())
    raw[7] ^= 0x01
    data.write_bytes(bytes(raw))  # same size, new mtime: hashed again, and caught
    with pytest.raises(ModelFolderError, match=r"text\.onnx_data.*sha256"):
        colembed.load(folder)
    with pytest.raises(ValueError, match="verify"):
        colembed.load(folder, verify="sometimes")
