"""The runtime refuses a tampered model folder, and each error names the file."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from PIL import Image

import colembed
from colembed.errors import ManifestError, ModelFolderError, ProviderError
from colembed.integrity import describe_file
from colembed.manifest import MANIFEST_NAME


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
    import colembed.integrity as integrity

    folder = copy_model_folder()
    hashed = []
    real = integrity.sha256_of
    monkeypatch.setattr(integrity, "sha256_of", lambda p: hashed.append(p.name) or real(p))
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


# --------------------------------------------------------------------------- confinement, tamper
def test_manifest_round_trips(exported_tiny):
    from colembed.manifest import Manifest

    data = json.loads((exported_tiny.folder / MANIFEST_NAME).read_text())
    assert Manifest.from_dict(data).to_dict() == data


def _set(path):
    """An edit setting `manifest[a][b]... = value` (value DELETE removes the key)."""
    *parents, last = path.split("/")

    def edit(value):
        def apply(manifest):
            node = manifest
            for key in parents:
                node = node[int(key) if isinstance(node, list) else key]
            key = int(last) if isinstance(node, list) else last
            if value is DELETE:
                del node[key]
            else:
                node[key] = value

        return apply

    return edit


DELETE = object()
MALFORMED = [  # (edit, value, the field the error must name)
    ("variants", [], r"variants: expected dict"),
    ("variants", {}, r"variants: empty"),
    ("files/text.onnx/size", DELETE, r"files\.text\.onnx\.size: missing"),
    ("files/text.onnx/sha256", "abc", r"files\.text\.onnx\.sha256"),
    ("architecture/vision_heads", 0, r"architecture\.vision_heads: must be > 0"),
    ("architecture/vision_heads", 5, r"architecture\.vision_heads: 5 does not divide"),
    ("architecture/text_hidden", DELETE, r"architecture\.text_hidden: missing"),
    ("architecture/text_width", 64, r"architecture: unknown keys \['text_width'\]"),
    ("exported_by", "someone", r"manifest: unknown keys \['exported_by'\]"),
    ("embedding_dim", "128", r"embedding_dim: expected int"),
    ("embedding_dim", True, r"embedding_dim: expected int"),
    ("preprocess/max_pixels", DELETE, r"preprocess: missing keys \['max_pixels'\]"),
    ("preprocess/patch_size", "14", r"preprocess\.patch_size: expected int"),
    ("preprocess/image_std", [1, 0, 1], r"image_std must not contain 0"),
    ("model/name", DELETE, r"model\.name: missing"),
    ("model/random_weights", "yes", r"model\.random_weights: expected bool"),
    (
        "variants/fp32/text/contract/inputs/0/dtype",
        "float64",
        r"variants\.fp32\.text\.contract\.inputs\[0\]\.dtype",
    ),
    ("variants/fp32/text/contract/outputs/0/dims/2", 64, r"variants\.fp32\.text.*width 64 != 128"),
    ("variants/fp32/vision", DELETE, r"variants\.fp32: has graphs \['text'\]"),
    ("variants/fp32/text/file", "/etc/passwd", r"variants\.fp32\.text\.file.*not a plain"),
    ("variants/fp32/text/file", "../text.onnx", r"variants\.fp32\.text\.file.*not a plain"),
    ("variants/fp32/text/data_file", "nowhere.bin", r"nowhere\.bin is not described"),
    ("checks/fp32/max_abs_diff", "small", r"checks\.fp32\.max_abs_diff: expected float"),
    (
        "checks/int8",
        {"mean_cosine": 1.0, "min_cosine": 1.0},
        r"checks: \['int8'\] are not variants",
    ),
    ("files/tokenizer.json", DELETE, r"tokenizer\.json is not described"),
]


@pytest.mark.parametrize("path, value, message", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_manifest_fails_at_load_naming_the_field(
    copy_model_folder, capsys, path, value, message
):
    from colembed.cli import main

    folder = copy_model_folder()
    _rewrite_manifest(folder, _set(path)(value))
    with pytest.raises(ManifestError, match=message):
        colembed.load(folder)
    assert (
        main(["info", str(folder)]) == 1
    )  # a clean runtime error (2 is for usage errors), no traceback
    err = capsys.readouterr().err
    assert err.startswith("colembed: error:") and "Traceback" not in err


def test_a_link_out_of_the_folder_is_refused_without_revealing_the_target(
    copy_model_folder, tmp_path
):
    folder = copy_model_folder()
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"x" * 12345)
    (folder / "vision.onnx_data").unlink()
    os.symlink(outside, folder / "vision.onnx_data")
    for verify in (True, False):
        with pytest.raises(ModelFolderError, match="outside the model folder") as caught:
            colembed.load(folder, verify=verify)
        assert "12345" not in str(caught.value) and "secret" not in str(caught.value)


def test_unlisted_external_data_is_refused(copy_model_folder):
    """A graph reading a file the manifest does not list: that file was never hashed, so an edit
    to it would change the vectors unnoticed."""
    folder = copy_model_folder()

    def unlist(manifest):
        manifest["variants"]["fp32"]["text"]["data_file"] = None
        del manifest["files"]["text.onnx_data"]

    _rewrite_manifest(folder, unlist)
    data = folder / "text.onnx_data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0x40
    data.write_bytes(bytes(raw))
    for verify in (True, "full", False):
        with pytest.raises(ModelFolderError, match=r"text\.onnx.*external data.*text\.onnx_data"):
            colembed.load(folder, verify=verify)


def test_same_size_edit_with_mtime_restored_is_caught_by_default(copy_model_folder):
    folder = copy_model_folder()
    colembed.load(folder)  # hashes, and remembers the files' stamps
    data = folder / "text.onnx_data"
    before = data.stat()
    with open(data, "r+b") as f:  # in place: same inode, same size
        f.seek(before.st_size // 2)
        byte = f.read(1)
        f.seek(before.st_size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = data.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        before.st_size,
        before.st_mtime_ns,
        before.st_ino,
    )
    with pytest.raises(ModelFolderError, match=r"text\.onnx_data.*sha256"):
        colembed.load(folder)


def test_external_data_references_are_read_without_onnx(exported_tiny, tmp_path):
    """The protobuf reader finds locations in initializers, Constant attributes and subgraphs,
    exactly as onnx reports them."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    from colembed.integrity import external_data_files

    assert external_data_files(exported_tiny.folder / "text.onnx") == {"text.onnx_data"}
    assert external_data_files(exported_tiny.folder / "maxsim.onnx") == set()
    big = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    const = numpy_helper.from_array(np.ones((64, 64), np.float32), "c")
    then = helper.make_graph(
        [helper.make_node("Constant", [], ["y"], value=const)],
        "then",
        [],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
    )
    graph = helper.make_graph(
        [helper.make_node("If", ["flag"], ["y"], then_branch=then, else_branch=then)],
        "g",
        [helper.make_tensor_value_info("flag", onnx.TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        initializer=[big],
    )
    model = helper.make_model(graph)
    onnx.save(
        model,
        tmp_path / "m.onnx",
        save_as_external_data=True,
        all_tensors_to_one_file=False,
        size_threshold=0,
        convert_attribute=True,
    )
    assert external_data_files(tmp_path / "m.onnx") == {"w", "c"}  # "c": in the If's branches
    for bad in (b"", b"\xff\xff\xff", b"\x3a\x7f"):
        (tmp_path / "bad.onnx").write_bytes(bad)
        with pytest.raises(ModelFolderError, match="not a readable ONNX"):
            external_data_files(tmp_path / "bad.onnx")


def test_embedding_dim_is_checked_against_the_text_graph(copy_model_folder):
    """A manifest that consistently claims 64-dim vectors over a graph that gives 128."""
    folder = copy_model_folder()

    def claim_64(manifest):
        manifest["embedding_dim"] = manifest["architecture"]["embedding_dim"] = 64
        for graphs in manifest["variants"].values():
            graphs["text"]["contract"]["outputs"][0]["dims"][-1] = 64

    _rewrite_manifest(folder, claim_64)
    with pytest.raises(ModelFolderError, match=r"text\.onnx.*contract.*embeddings"):
        colembed.load(folder)


def test_image_graph_whose_rows_disagree_with_the_prompt_is_a_named_error(
    copy_model_folder, tmp_path
):
    """A vision graph that drops its last feature row, hashed into the manifest (so it loads):
    the first page fails with GraphOutputError naming the folder, not a bare RuntimeError; queries,
    which never run the image graph, still work."""
    import onnx
    from onnx import helper

    folder = copy_model_folder()
    graph_path = folder / "vision.onnx"
    model = onnx.load(graph_path, load_external_data=False)
    (output,) = model.graph.output
    inner = output.name + "_all_rows"
    for node in model.graph.node:
        node.output[:] = [inner if name == output.name else name for name in node.output]
    for name, values in (("drop_start", [0]), ("drop_end", [-1]), ("drop_axis", [1])):
        model.graph.initializer.append(
            helper.make_tensor(name, onnx.TensorProto.INT64, [1], values)
        )
    model.graph.node.append(
        helper.make_node("Slice", [inner, "drop_start", "drop_end", "drop_axis"], [output.name])
    )
    onnx.save(model, graph_path)  # its weights stay in vision.onnx_data, referenced as before

    def rehash(manifest):
        manifest["files"]["vision.onnx"] = describe_file(graph_path)

    _rewrite_manifest(folder, rehash)
    model = colembed.load(folder)
    assert model.embed_queries(["still fine"])[0].shape[1] == model.embedding_size
    page = Image.new("RGB", (120, 160), "white")
    with pytest.raises(colembed.GraphOutputError, match=r"feature rows.*image tokens") as caught:
        model.embed_images([page])
    assert caught.value.path == folder and isinstance(caught.value, RuntimeError)


def test_one_graph_session_at_a_time_embeds_as_both(tiny_model, exported_tiny):
    """`graphs=` opens the named graphs' sessions only; the image graph's half, then the text
    graph's in a session opened after the first was closed, give `embed_images`' vectors, and a
    closed graph is refused by name."""
    from colembed.model import ColQwenModel

    pages = [Image.new("RGB", (120, 90), "white"), Image.new("RGB", (57, 91), (30, 60, 90))]
    model = ColQwenModel(exported_tiny.folder, graphs=("vision",))
    assert model.providers == tiny_model.providers
    with pytest.raises(ModelFolderError, match="text graph's session is closed"):
        model.embed_queries(["a query"])
    outputs = model.run_image_graph(pages)
    model.close_graph("vision")
    model.open_graph("text")
    with pytest.raises(ModelFolderError, match="vision graph's session is closed"):
        model.embed_images(pages)
    got = model.embed_image_graph_outputs(outputs)
    want = tiny_model.embed_images(pages, batch_size=len(pages))
    assert len(got) == len(want) == len(pages)
    for g, w in zip(got, want):
        assert g.shape == w.shape and (g == w).all()
    with pytest.raises(ValueError, match="graphs must be among"):
        ColQwenModel(exported_tiny.folder, graphs=("audio",))
