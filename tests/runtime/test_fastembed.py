"""colembed's FastEmbed integration: registration, model resolution, the vectors.

- Registration: `from colembed.fastembed import LateInteractionMultimodalEmbedding` (the one
  documented line) puts ColQwen2 into FastEmbed's multimodal late-interaction registry once, after
  FastEmbed's own models, with its description from models.json; without fastembed, colembed still
  imports and embeds.
- Resolution: specific_model_path, then the cache (cache_dir / FASTEMBED_CACHE_PATH), then a
  published export downloaded through huggingface_hub (faked here: the hub is unreachable), else an
  error naming `colembed export` and the checkpoint; offline never calls the hub. A folder is
  complete when it holds what its own manifest lists for the variant asked for: exports with inline
  weights (the default for small models), with external data, or with only some variants. A cached
  folder another user owns, or others may write, is refused.
- Vectors: FastEmbed's equal colembed's own API's bit for bit, and the reference model's within
  the parity tolerance; every input form; MUVERA on top.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from tests.fixtures.builds import PARITY_TOLERANCE, reference_rows
from tests.fixtures.images import rgb as noise_page
from PIL import Image

import colembed
from colembed import registry
from colembed.errors import ImageError, ModelFolderError
from colembed.fastembed import ColQwen2, LateInteractionMultimodalEmbedding, register
from colembed.layout import MANIFEST_NAME
from colembed.integrity import describe_file
from fastembed.postprocess import Muvera

pytestmark = pytest.mark.heavy("tiny")

MODEL = "colqwen2"
QUERIES = ["What was the revenue in 2023?", "hello world", "", "表格中的数字是多少？"]
PAGES = [
    noise_page(w, h, seed=seed)
    for seed, (w, h) in enumerate([(150, 210), (200, 120), (150, 210)], start=1)
]


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def page_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fastembed-pages")
    paths = []
    for i, page in enumerate(PAGES):
        paths.append(folder / f"page{i}.png")
        page.save(paths[-1])
    return paths


@pytest.fixture(scope="module")
def fe_model(exported_tiny_default):
    return LateInteractionMultimodalEmbedding(
        MODEL, specific_model_path=str(exported_tiny_default.folder)
    )


@pytest.fixture(scope="module")
def default_model(exported_tiny_default):
    return colembed.load(exported_tiny_default.folder)


@pytest.fixture
def entry():
    return registry.get_model(MODEL)


def _link(folder: Path, cache: Path, entry: registry.ModelEntry) -> Path:
    target = cache / entry.cache_folder_name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(folder, target_is_directory=True)
    return target


# ---------------------------------------------------------------------------------- registration
def test_registered_once_after_fastembeds_own_models():
    classes = LateInteractionMultimodalEmbedding.EMBEDDINGS_REGISTRY
    before = list(classes)
    assert register() is ColQwen2 and register() is ColQwen2
    assert classes == before
    assert classes.count(ColQwen2) == 1 and classes[-1] is ColQwen2
    own = [c for c in classes if c is not ColQwen2]
    assert {c.__name__ for c in own} >= {"ColPali", "ColModernVBERT"}
    names = [d["model"] for d in LateInteractionMultimodalEmbedding.list_supported_models()]
    assert names.count(MODEL) == 1 and "Qdrant/colpali-v1.3-fp16" in names


def test_description_comes_from_models_json():
    raw = json.loads(registry.models_json_path().read_text())
    (listed,) = [m for m in raw["models"] if m["model"] == MODEL]
    (described,) = [
        d for d in LateInteractionMultimodalEmbedding.list_supported_models() if d["model"] == MODEL
    ]
    for key in ("model", "dim", "description", "license", "size_in_GB"):
        assert described[key] == listed[key], key
    assert described["sources"]["hf"] == (listed["export_repo"] or listed["checkpoint"])
    assert described["model_file"] == MANIFEST_NAME  # it lists every other file


def test_name_is_case_insensitive(exported_tiny_default):
    model = LateInteractionMultimodalEmbedding(
        "ColQwen2", specific_model_path=exported_tiny_default.folder, lazy_load=True
    )
    assert isinstance(model.model, ColQwen2) and model.embedding_size == 128


IMPORT_PROBE = """
import importlib, sys
import fastembed
from colembed.fastembed import LateInteractionMultimodalEmbedding as L
import colembed.fastembed as plugin
assert L is fastembed.LateInteractionMultimodalEmbedding   # FastEmbed's own class, re-exported
importlib.reload(plugin)                  # a second import of the module registers nothing new
plugin.register()
names = [d.model for c in L.EMBEDDINGS_REGISTRY for d in c._list_supported_models()]
assert names.count("colqwen2") == 1, names
assert L.EMBEDDINGS_REGISTRY[-1] is plugin.ColQwen2
leaked = [m for m in ("torch", "transformers") if m in sys.modules]
assert not leaked, leaked
print("ok")
"""

NO_FASTEMBED_PROBE = """
import importlib.abc, sys

class BlockFastEmbed(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "fastembed" or name.startswith("fastembed."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, BlockFastEmbed())
import colembed
from colembed import registry
folder = registry.resolve_model_folder("colqwen2", specific_model_path=sys.argv[1])
model = colembed.load(folder)
(query,) = model.embed_queries(["hello world"])
assert query.shape == (14, 128), query.shape
try:
    import colembed.fastembed
except ImportError as e:
    assert "colembed[fastembed]" in str(e), e
else:
    raise SystemExit("the FastEmbed plugin imported without fastembed")
leaked = [m for m in ("fastembed", "torch", "transformers") if m in sys.modules]
assert not leaked, leaked
print("ok")
"""


def _run(code: str, *args: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr


def test_plugin_import_registers_once_without_torch():
    _run(IMPORT_PROBE)


def test_colembed_works_without_fastembed(exported_tiny):
    _run(NO_FASTEMBED_PROBE, str(exported_tiny.folder))


# ------------------------------------------------------------------------------------ resolution
def test_specific_model_path_comes_first(exported_tiny, tmp_path, entry):
    (tmp_path / entry.cache_folder_name).mkdir()  # a broken folder in the cache is not looked at
    model = LateInteractionMultimodalEmbedding(
        MODEL, cache_dir=str(tmp_path), specific_model_path=str(exported_tiny.folder)
    )
    assert model.model.model.folder == exported_tiny.folder  # the colembed model it loaded


def test_cache_dir_and_env(exported_tiny, tmp_path, monkeypatch, entry):
    linked = _link(exported_tiny.folder, tmp_path / "given", entry)
    model = LateInteractionMultimodalEmbedding(MODEL, cache_dir=str(tmp_path / "given"))
    assert model.model.model.folder == linked

    linked = _link(exported_tiny.folder, tmp_path / "env", entry)
    monkeypatch.setenv("FASTEMBED_CACHE_PATH", str(tmp_path / "env"))
    model = LateInteractionMultimodalEmbedding(MODEL)
    assert model.model.model.folder == linked


@pytest.mark.parametrize("name", ["../evil", "/etc", "a/b/c", "a\\b", "x/..", ""])
def test_a_model_name_that_could_leave_the_cache_is_refused(tmp_path, name):
    data = json.loads(registry.models_json_path().read_text())
    data["models"][0]["model"] = name
    path = tmp_path / "models.json"
    path.write_text(json.dumps(data))
    with pytest.raises(colembed.ColembedError):
        registry.known_models(path)


def test_nothing_found_names_colembed_export(tmp_path, entry):
    with pytest.raises(ModelFolderError) as info:
        LateInteractionMultimodalEmbedding(MODEL, cache_dir=str(tmp_path))
    message = str(info.value)
    assert "colembed export vidore/colqwen2-v1.0-hf" in message
    assert str(tmp_path / entry.cache_folder_name) in message
    assert isinstance(info.value, ValueError)  # what FastEmbed raises for unloadable models


def test_incomplete_or_foreign_folder_says_what_is_wrong(copy_model_folder, entry):
    folder = copy_model_folder()
    (folder / "vision.onnx_data").unlink()
    with pytest.raises(ModelFolderError, match=r"missing \['vision.onnx_data'\]"):
        registry.resolve_model_folder(entry, specific_model_path=folder)

    folder = copy_model_folder("other-dim")
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    manifest["embedding_dim"] = manifest["architecture"]["embedding_dim"] = 64
    for graphs in manifest["variants"].values():  # a consistent 64-dim manifest
        graphs["text"]["contract"]["outputs"][0]["dims"][-1] = 64
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ModelFolderError, match="64-dim vectors, not colqwen2"):
        registry.resolve_model_folder(entry, specific_model_path=folder)


@pytest.fixture
def published(tmp_path):
    """A models.json whose colqwen2 names a published export, and a fake hub that serves it."""
    data = json.loads(registry.models_json_path().read_text())
    data["models"][0]["export_repo"] = "someone/colqwen2-colembed"
    path = tmp_path / "models.json"
    path.write_text(json.dumps(data))
    return registry.get_model(MODEL, path)


class FakeHub:
    def __init__(self, source: Path | None, error: Exception | None = None) -> None:
        self.source, self.error, self.calls = source, error, []

    def __call__(self, repo_id, **kwargs):
        self.calls.append((repo_id, kwargs))
        if self.error is not None:
            raise self.error
        out = Path(kwargs["local_dir"])
        out.mkdir(parents=True, exist_ok=True)
        for name in kwargs["allow_patterns"]:
            shutil.copyfile(self.source / name, out / name)
        return str(out)


def test_published_export_is_downloaded_into_the_cache(
    exported_tiny_default, published, tmp_path, monkeypatch
):
    import huggingface_hub

    hub = FakeHub(exported_tiny_default.folder)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    folder = registry.resolve_model_folder(published, cache_dir=tmp_path / "cache")
    assert folder == tmp_path / "cache" / published.cache_folder_name
    # the manifest first, then what it lists for the variant (no .onnx_data: none was exported)
    (repo, first), (_, second) = hub.calls
    assert repo == "someone/colqwen2-colembed" and first["allow_patterns"] == [MANIFEST_NAME]
    assert set(second["allow_patterns"]) == {
        MANIFEST_NAME,
        "vision.onnx",
        "text.onnx",
        "tokenizer.json",
        "maxsim.onnx",
    }
    colembed.load(folder)  # a complete, verified model folder
    # now cached: found without the hub
    assert registry.resolve_model_folder(published, cache_dir=tmp_path / "cache") == folder
    assert len(hub.calls) == 2


def test_failed_download_names_colembed_export(published, tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", FakeHub(None, OSError("no route")))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ModelFolderError, match="colembed export vidore/colqwen2-v1.0-hf"):
        registry.resolve_model_folder(published, cache_dir=tmp_path)


@pytest.mark.parametrize("how", ["env", "argument"])
def test_offline_never_calls_the_hub(published, tmp_path, monkeypatch, exported_tiny, how):
    import huggingface_hub

    hub = FakeHub(exported_tiny.folder)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    if how == "env":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    partial = tmp_path / published.cache_folder_name
    partial.mkdir()
    for name in (MANIFEST_NAME, "tokenizer.json"):
        shutil.copyfile(exported_tiny.folder / name, partial / name)
    with pytest.raises(ModelFolderError) as info:
        registry.resolve_model_folder(
            published, cache_dir=tmp_path, local_files_only=how == "argument"
        )
    assert hub.calls == []
    message = str(info.value)
    assert "offline" in message and "someone/colqwen2-colembed" in message
    assert "vision.onnx" in message and "'tokenizer.json'" not in message  # what is missing


# --------------------------------------------------------------------------------------- vectors
@pytest.fixture(params=["default", "external"])
def export_kind(request, exported_tiny_default, exported_tiny):
    """Both weight layouts: inline (the default below 1 GiB) and external `.onnx_data`."""
    folder = exported_tiny_default.folder if request.param == "default" else exported_tiny.folder
    has_data = any(folder.glob("*.onnx_data"))
    assert has_data == (request.param == "external")
    return folder


def test_export_by_path_and_by_name_equals_colembed_load(
    export_kind, tmp_path, monkeypatch, entry, page_files
):
    """The held-out small-model case: a folder as `colembed export` writes it, loaded through
    FastEmbed by `specific_model_path` and by name from the cache, gives colembed.load's vectors."""
    want_pages = colembed.load(export_kind).embed_images(page_files, batch_size=2)
    want_queries = colembed.load(export_kind).embed_queries(QUERIES)
    cache = tmp_path / "cache"
    shutil.copytree(export_kind, cache / entry.cache_folder_name)
    monkeypatch.setenv("FASTEMBED_CACHE_PATH", str(cache))
    for model in (
        LateInteractionMultimodalEmbedding(MODEL, specific_model_path=str(export_kind)),
        LateInteractionMultimodalEmbedding(MODEL),
    ):
        got = list(model.embed_image(page_files, batch_size=2))
        assert len(got) == len(want_pages)
        for g, w in zip(got, want_pages):
            assert g.dtype == np.float32 and np.array_equal(g, w)
        for g, w in zip(model.embed_text(QUERIES, batch_size=16), want_queries):
            assert g.shape[1] == 128 and np.array_equal(g, w)
    assert model.model.model.folder == cache / entry.cache_folder_name


def _with_int8_copy_only(folder: Path) -> None:
    """Make `folder` (an inline-weights export) hold an "int8" variant, here a byte copy of the
    fp32 graphs (a real variant's files are named and listed the same way), and drop fp32's graph
    files: a folder holding only some of the variants its manifest lists."""
    path = folder / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    graphs = {}
    for role, entry in manifest["variants"]["fp32"].items():
        copy = f"{role}.int8.onnx"
        shutil.copyfile(folder / entry["file"], folder / copy)
        manifest["files"][copy] = describe_file(folder / copy)
        graphs[role] = {**entry, "file": copy}
        (folder / entry["file"]).unlink()
    manifest["variants"]["int8"] = graphs
    path.write_text(json.dumps(manifest))


def test_folder_with_only_some_variants(exported_tiny_default, tmp_path, page_files, entry):
    folder = shutil.copytree(exported_tiny_default.folder, tmp_path / "int8-only")
    _with_int8_copy_only(folder)
    model = LateInteractionMultimodalEmbedding(
        MODEL, specific_model_path=str(folder), variant="int8"
    )
    want = colembed.load(exported_tiny_default.folder).embed_images(page_files[:1])
    assert np.array_equal(next(iter(model.embed_image(page_files[:1]))), want[0])
    with pytest.raises(ModelFolderError, match=r"missing \['vision.onnx', 'text.onnx'\]"):
        registry.resolve_model_folder(entry, specific_model_path=folder)  # fp32 asked, not there
    with pytest.raises(ModelFolderError, match="variant 'fp16' is not in this folder"):
        registry.resolve_model_folder(entry, specific_model_path=folder, variant="fp16")


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX ownership")
def test_cached_folder_of_another_user_or_writable_by_others_is_refused(
    exported_tiny_default, tmp_path, monkeypatch, entry
):
    cache = tmp_path / "cache"
    folder = shutil.copytree(exported_tiny_default.folder, cache / entry.cache_folder_name)
    assert registry.resolve_model_folder(entry, cache_dir=cache) == folder
    # a specific_model_path is the caller's own choice; only the shared cache is checked
    for path, mode in ((folder, 0o777), (folder / "text.onnx", 0o666)):
        original = path.stat().st_mode
        path.chmod(mode)
        with pytest.raises(ModelFolderError, match="writable by other users") as info:
            registry.resolve_model_folder(entry, cache_dir=cache)
        assert str(path) in str(info.value)
        assert registry.resolve_model_folder(entry, specific_model_path=folder) == folder
        path.chmod(original)
    if os.geteuid() == 0:  # only root may give a file away
        # group-writable: fine for the user's private group (umask 002), refused for another group
        (folder / "text.onnx").chmod(0o664)
        assert registry.resolve_model_folder(entry, cache_dir=cache) == folder
        os.chown(folder / "text.onnx", -1, 4242)
        with pytest.raises(ModelFolderError, match="writable by other users"):
            registry.resolve_model_folder(entry, cache_dir=cache)
        (folder / "text.onnx").chmod(0o644)
        os.chown(folder / MANIFEST_NAME, 4242, -1)
        with pytest.raises(ModelFolderError, match="owned by user id 4242"):
            LateInteractionMultimodalEmbedding(MODEL, cache_dir=str(cache))
        monkeypatch.setenv("FASTEMBED_CACHE_PATH", str(cache))
        with pytest.raises(ModelFolderError, match="owned by user id 4242"):
            colembed.load(MODEL)


def test_vectors_match_the_reference(fe_model, reference_model, reference_processor):
    for query, got in zip(QUERIES, fe_model.embed_text(QUERIES)):
        want = reference_rows(reference_model, reference_processor.process_queries([query]))
        assert got.shape == want.shape and np.max(np.abs(got - want)) <= PARITY_TOLERANCE
    for page, got in zip(PAGES, fe_model.embed_image(PAGES, batch_size=2)):
        want = reference_rows(reference_model, reference_processor.process_images([page]))
        assert got.shape == want.shape and np.max(np.abs(got - want)) <= PARITY_TOLERANCE


def test_every_input_form_any_batch_size(fe_model, default_model, page_files):
    expected = default_model.embed_images(page_files)
    forms = [page_files[0], str(page_files[1]), PAGES[2]]  # Path, str, PIL
    as_bytes = [_png(p) for p in PAGES]  # PNG round trip is lossless
    for batch_size in (1, 2, 5):
        for images in (forms, as_bytes, (p for p in forms), [io.BytesIO(b) for b in as_bytes]):
            got = list(fe_model.embed_image(images, batch_size=batch_size))
            assert len(got) == 3
            for g, w in zip(got, expected):
                assert np.allclose(g, w, atol=1e-5, rtol=0), batch_size
        got = list(fe_model.embed_text((q for q in QUERIES), batch_size=batch_size))
        assert [g.shape for g in got] == [w.shape for w in default_model.embed_queries(QUERIES)]
    # single items, as FastEmbed accepts them
    (one,) = fe_model.embed_text("hello world")
    assert np.array_equal(one, default_model.embed_queries(["hello world"])[0])
    for single in (page_files[0], str(page_files[0]), _png(PAGES[0]), PAGES[0]):
        (page,) = fe_model.embed_image(single)
        assert np.allclose(page, expected[0], atol=1e-5, rtol=0)
    assert list(fe_model.embed_text([])) == [] and list(fe_model.embed_image([])) == []


def test_token_count_matches_the_reference(fe_model, reference_processor):
    for query in QUERIES:
        with_extension = reference_processor.process_queries([query])["attention_mask"].sum()
        assert fe_model.token_count(query, include_extension=True) == int(with_extension)
        bare = len(reference_processor.tokenizer(query, add_special_tokens=True)["input_ids"])
        assert fe_model.token_count(query) == bare


def test_colembed_options_pass_through(exported_tiny, page_files):
    capped = LateInteractionMultimodalEmbedding(
        MODEL,
        specific_model_path=exported_tiny.folder,
        max_image_tokens=16,
        threads=1,
        verify=False,
    )
    (page,) = capped.embed_image(page_files[0])
    direct = colembed.load(exported_tiny.folder, max_image_tokens=16, threads=1)
    assert np.array_equal(page, direct.embed_images([page_files[0]])[0])
    assert capped.model.model.max_image_tokens == 16
    with pytest.raises(TypeError, match="max_image_token"):
        LateInteractionMultimodalEmbedding(
            MODEL, specific_model_path=exported_tiny.folder, max_image_token=16
        )


def test_providers_cuda_and_device_ids(exported_tiny):
    import onnxruntime

    from fastembed.common.types import Device

    folder = str(exported_tiny.folder)
    explicit = LateInteractionMultimodalEmbedding(
        MODEL, specific_model_path=folder, providers=["CPUExecutionProvider"]
    )
    assert explicit.model.model.providers[0] == "CPUExecutionProvider"
    default = LateInteractionMultimodalEmbedding(MODEL, specific_model_path=folder)
    has_cuda = "CUDAExecutionProvider" in onnxruntime.get_available_providers()
    assert default.model.model.providers[0] == (
        "CUDAExecutionProvider" if has_cuda else "CPUExecutionProvider"
    )

    # FastEmbed's mapping: cuda=Device.CPU is the CPU; cuda=True demands CUDA on the first of
    # device_ids, with no silent CPU fallback (here, without CUDA: an error naming what was asked)
    on_cpu = LateInteractionMultimodalEmbedding(MODEL, specific_model_path=folder, cuda=Device.CPU)
    assert on_cpu.model.model.providers == ["CPUExecutionProvider"]
    if not has_cuda:
        with pytest.raises(
            colembed.ProviderError, match=r"CUDAExecutionProvider \(options \{'device_id': 1\}\)"
        ):
            LateInteractionMultimodalEmbedding(
                MODEL, specific_model_path=folder, cuda=True, device_ids=[1, 2]
            )
        with pytest.raises(colembed.ProviderError, match=r"CUDAExecutionProvider is not"):
            LateInteractionMultimodalEmbedding(MODEL, specific_model_path=folder, cuda=True)


def test_parallel_reports_the_bad_item(fe_model, page_files):
    images = [page_files[0], page_files[1], b"not an image", page_files[2]]
    with pytest.raises(ImageError, match="item 2"):
        list(fe_model.embed_image(images, batch_size=1, parallel=2))


def test_muvera_first_pass_keeps_the_exact_best_page(fe_model):
    """MUVERA's fixed-size vectors over colembed's: for a query made of 12 of page k's own vectors
    (page k is then the exact MaxSim winner), FDE inner products rank page k in their top 2 of 8.
    With the page FDEs shuffled the same check fails, so it can fail."""
    sizes = [
        (150, 210),
        (210, 150),
        (120, 120),
        (168, 224),
        (90, 300),
        (200, 200),
        (140, 180),
        (224, 168),
    ]
    pages = list(fe_model.embed_image([noise_page(w, h, seed=i) for i, (w, h) in enumerate(sizes)]))
    muvera = Muvera.from_multivector_model(fe_model, k_sim=5, dim_proj=16, r_reps=20)
    fdes = np.stack([muvera.process_document(p) for p in pages])
    assert fdes.shape == (8, muvera.embedding_size) and np.all(np.isfinite(fdes))

    def ranks(documents: np.ndarray) -> list[int]:
        found = []
        for k, page in enumerate(pages):
            rows = page[np.random.default_rng(100 + k).choice(len(page), 12, replace=False)]
            assert np.argmax(colembed.score([rows], pages)[0]) == k  # the exact winner
            order = np.argsort(-(documents @ muvera.process_query(rows)), kind="stable")
            found.append(order.tolist().index(k))
        return found

    assert max(ranks(fdes)) <= 1, ranks(fdes)
    assert max(ranks(fdes[np.roll(np.arange(8), 3)])) > 1


# ---------------------------------------------------------------------- the second family's name
MODEL_2_5 = "colqwen2.5"


def test_both_families_are_registered_once_with_their_descriptions():
    raw = {m["model"]: m for m in json.loads(registry.models_json_path().read_text())["models"]}
    described = [
        d
        for d in LateInteractionMultimodalEmbedding.list_supported_models()
        if d["model"] in (MODEL, MODEL_2_5)
    ]
    assert sorted(d["model"] for d in described) == [MODEL, MODEL_2_5]
    for description in described:
        listed = raw[description["model"]]
        for key in ("dim", "description", "license", "size_in_GB"):
            assert description[key] == listed[key], (description["model"], key)
        assert description["sources"]["hf"] == listed["checkpoint"]
    assert registry.get_model(MODEL_2_5).family == "colqwen2.5"
    assert registry.get_model(MODEL_2_5).base_checkpoint == "vidore/colqwen2.5-base"


def test_colqwen2_5_by_name_equals_colembed_load_and_the_reference(
    exported_tiny_2_5, tmp_path, monkeypatch, tmp_path_factory
):
    """Found in the cache by name like "colqwen2"; FastEmbed's vectors are colembed's bit for bit
    and the reference's (transformers over Qwen2.5-VL, get_dtype shim) within the tolerance."""
    import torch
    from transformers import ColQwen2ForRetrieval

    from colembed_export.families import export_family
    from tests.fixtures.qwen2_5 import checkpoint, reference_processor

    _link(exported_tiny_2_5.folder, tmp_path, registry.get_model(MODEL_2_5))
    monkeypatch.setenv("FASTEMBED_CACHE_PATH", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = LateInteractionMultimodalEmbedding("ColQwen2.5")
    assert model.embedding_size == 128 and model.model.model.family.name == "colqwen2.5"
    own = colembed.load(exported_tiny_2_5.folder)
    source = checkpoint(tmp_path_factory, "tiny-2.5", "transformers")
    reference = export_family("colqwen2.5").prepare_reference(
        ColQwen2ForRetrieval.from_pretrained(source, dtype=torch.float32).eval()
    )
    processor = reference_processor(source)
    pages = list(model.embed_image(PAGES, batch_size=2))
    queries = list(model.embed_text(QUERIES))
    for got, want in zip(pages, own.embed_images(PAGES, batch_size=2)):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(queries, own.embed_queries(QUERIES)):
        np.testing.assert_array_equal(got, want)
    for page, got in zip(PAGES, pages):
        want = reference_rows(reference, processor.process_images([page]))
        assert got.shape == want.shape and np.max(np.abs(got - want)) <= PARITY_TOLERANCE
    for query, got in zip(QUERIES, queries):
        want = reference_rows(reference, processor.process_queries([query]))
        assert got.shape == want.shape and np.max(np.abs(got - want)) <= PARITY_TOLERANCE


def test_a_folder_of_the_other_family_is_refused_by_name(exported_tiny_default, exported_tiny_2_5):
    with pytest.raises(ModelFolderError, match=r"holds a colqwen2 .*not colqwen2\.5"):
        LateInteractionMultimodalEmbedding(
            MODEL_2_5, specific_model_path=exported_tiny_default.folder
        )
    with pytest.raises(ModelFolderError, match=r"holds a colqwen2\.5 .*not colqwen2 "):
        LateInteractionMultimodalEmbedding(MODEL, specific_model_path=exported_tiny_2_5.folder)


def test_nothing_found_for_colqwen2_5_names_the_adapter_to_export(tmp_path):
    with pytest.raises(ModelFolderError, match="colembed export vidore/colqwen2.5-v0.2"):
        LateInteractionMultimodalEmbedding(MODEL_2_5, cache_dir=str(tmp_path))
