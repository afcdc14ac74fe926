"""colembed's FastEmbed integration (issue 5): registration, model resolution, the vectors.

- Registration: importing `colembed.fastembed_plugin` puts ColQwen2 into FastEmbed's multimodal
  late-interaction registry once, after FastEmbed's own models, with its description from
  models.json; without fastembed, colembed still imports and embeds.
- Resolution: specific_model_path, then the cache (cache_dir / FASTEMBED_CACHE_PATH), then a
  published export downloaded through huggingface_hub (faked here: the hub is unreachable), else an
  error naming `colembed export` and the checkpoint; offline never calls the hub.
- Vectors: FastEmbed's equal colembed's own API's bit for bit, and the reference model's within
  the parity tolerance; every input form; MUVERA on top.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import colembed
from colembed import registry
from colembed.errors import ImageError, ModelFolderError
from colembed.fastembed_plugin import ColQwen2, register
from colembed.manifest import MANIFEST_NAME
from fastembed import LateInteractionMultimodalEmbedding
from fastembed.postprocess import Muvera

PARITY_TOLERANCE = 1e-4  # per token, as in test_export_parity
MODEL = "colqwen2"
QUERIES = ["What was the revenue in 2023?", "hello world", "", "表格中的数字是多少？"]


def _page(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


PAGES = [_page(150, 210, 1), _page(200, 120, 2), _page(150, 210, 3)]


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
def fe_model(exported_tiny):
    return LateInteractionMultimodalEmbedding(MODEL, specific_model_path=str(exported_tiny.folder))


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


def test_description_comes_from_models_json(entry):
    raw = json.loads(registry.models_json_path().read_text())
    (listed,) = [m for m in raw["models"] if m["model"] == MODEL]
    (described,) = [d for d in LateInteractionMultimodalEmbedding.list_supported_models()
                    if d["model"] == MODEL]
    for key in ("model", "dim", "description", "license", "size_in_GB", "model_file",
                "additional_files"):
        assert described[key] == listed[key], key
    assert described["sources"]["hf"] == (listed["export_repo"] or listed["checkpoint"])
    # every file the exporter writes for the runtime is named explicitly
    assert set(entry.files) >= {"vision.onnx", "vision.onnx_data", "text.onnx", "text.onnx_data",
                                "maxsim.onnx", "tokenizer.json", "config.json",
                                "preprocessor_config.json", MANIFEST_NAME}


def test_packaged_models_json_is_the_root_file():
    """The package's models.json (what a wheel ships) is the repository's, not a second copy."""
    root = Path(__file__).resolve().parents[1] / "models.json"
    packaged = Path(colembed.__file__).with_name("models.json")
    assert registry.models_json_path() in (root, packaged)
    if packaged.exists():
        assert packaged.read_bytes() == root.read_bytes()


def test_name_is_case_insensitive(exported_tiny):
    model = LateInteractionMultimodalEmbedding("ColQwen2", specific_model_path=exported_tiny.folder,
                                               lazy_load=True)
    assert isinstance(model.model, ColQwen2) and model.embedding_size == 128


IMPORT_PROBE = """
import importlib, sys
import colembed.fastembed_plugin as plugin
from fastembed import LateInteractionMultimodalEmbedding as L
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
    import colembed.fastembed_plugin
except ImportError as e:
    assert "colembed[fastembed]" in str(e), e
else:
    raise SystemExit("the FastEmbed plugin imported without fastembed")
leaked = [m for m in ("fastembed", "torch", "transformers") if m in sys.modules]
assert not leaked, leaked
print("ok")
"""


def _run(code: str, *args: str) -> None:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                            capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr


def test_plugin_import_registers_once_without_torch():
    _run(IMPORT_PROBE)


def test_colembed_works_without_fastembed(exported_tiny):
    _run(NO_FASTEMBED_PROBE, str(exported_tiny.folder))


# ------------------------------------------------------------------------------------ resolution
def test_specific_model_path_comes_first(exported_tiny, tmp_path, entry):
    (tmp_path / entry.cache_folder_name).mkdir()  # a broken folder in the cache is not looked at
    model = LateInteractionMultimodalEmbedding(
        MODEL, cache_dir=str(tmp_path), specific_model_path=str(exported_tiny.folder),
        lazy_load=True)
    assert model.model._model_dir == exported_tiny.folder


def test_cache_dir_and_env(exported_tiny, tmp_path, monkeypatch, entry):
    linked = _link(exported_tiny.folder, tmp_path / "given", entry)
    model = LateInteractionMultimodalEmbedding(MODEL, cache_dir=str(tmp_path / "given"),
                                               lazy_load=True)
    assert model.model._model_dir == linked

    linked = _link(exported_tiny.folder, tmp_path / "env", entry)
    monkeypatch.setenv("FASTEMBED_CACHE_PATH", str(tmp_path / "env"))
    model = LateInteractionMultimodalEmbedding(MODEL, lazy_load=True)
    assert model.model._model_dir == linked


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


def test_published_export_is_downloaded_into_the_cache(exported_tiny, published, tmp_path,
                                                        monkeypatch):
    import huggingface_hub

    hub = FakeHub(exported_tiny.folder)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    folder = registry.resolve_model_folder(published, cache_dir=tmp_path / "cache")
    assert folder == tmp_path / "cache" / published.cache_folder_name
    ((repo, kwargs),) = hub.calls
    assert repo == "someone/colqwen2-colembed" and sorted(kwargs["allow_patterns"]) == sorted(
        published.files)
    colembed.load(folder)  # a complete, verified model folder
    # now cached: found without the hub
    assert registry.resolve_model_folder(published, cache_dir=tmp_path / "cache") == folder
    assert len(hub.calls) == 1


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
    shutil.copyfile(exported_tiny.folder / "tokenizer.json", partial / "tokenizer.json")
    with pytest.raises(ModelFolderError) as info:
        registry.resolve_model_folder(published, cache_dir=tmp_path,
                                      local_files_only=how == "argument")
    assert hub.calls == []
    message = str(info.value)
    assert "offline" in message and "someone/colqwen2-colembed" in message
    assert "vision.onnx" in message and "'tokenizer.json'" not in message  # what is missing


# --------------------------------------------------------------------------------------- vectors
def test_vectors_equal_colembeds_own(fe_model, tiny_model, page_files):
    got = list(fe_model.embed_text(QUERIES, batch_size=16))
    want = tiny_model.embed_queries(QUERIES, batch_size=16)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == np.float32 and g.shape[1] == 128 and np.array_equal(g, w)

    got = list(fe_model.embed_image(page_files, batch_size=4))
    want = tiny_model.embed_images(page_files, batch_size=4)
    for g, w in zip(got, want):
        assert g.dtype == np.float32 and np.array_equal(g, w)


def _reference_rows(model, batch) -> np.ndarray:
    with torch.no_grad():
        out = model(**batch).embeddings[0]
    return out[batch["attention_mask"][0] == 1].numpy()


def test_vectors_match_the_reference(fe_model, reference_model, reference_processor):
    for query, got in zip(QUERIES, fe_model.embed_text(QUERIES)):
        want = _reference_rows(reference_model, reference_processor.process_queries([query]))
        assert got.shape == want.shape and np.max(np.abs(got - want)) <= PARITY_TOLERANCE
    for page, got in zip(PAGES, fe_model.embed_image(PAGES, batch_size=2)):
        want = _reference_rows(reference_model, reference_processor.process_images([page]))
        assert got.shape == want.shape and np.max(np.abs(got - want)) <= PARITY_TOLERANCE


def test_every_input_form_any_batch_size(fe_model, tiny_model, page_files):
    expected = tiny_model.embed_images(page_files)
    forms = [page_files[0], str(page_files[1]), PAGES[2]]  # Path, str, PIL
    as_bytes = [_png(p) for p in PAGES]  # PNG round trip is lossless
    for batch_size in (1, 2, 5):
        for images in (forms, as_bytes, (p for p in forms), [io.BytesIO(b) for b in as_bytes]):
            got = list(fe_model.embed_image(images, batch_size=batch_size))
            assert len(got) == 3
            for g, w in zip(got, expected):
                assert np.allclose(g, w, atol=1e-5, rtol=0), batch_size
        got = list(fe_model.embed_text((q for q in QUERIES), batch_size=batch_size))
        assert [g.shape for g in got] == [w.shape for w in tiny_model.embed_queries(QUERIES)]
    # single items, as FastEmbed accepts them
    (one,) = fe_model.embed_text("hello world")
    assert np.array_equal(one, tiny_model.embed_queries(["hello world"])[0])
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
        MODEL, specific_model_path=exported_tiny.folder, max_image_tokens=16, threads=1,
        verify=False)
    (page,) = capped.embed_image(page_files[0])
    direct = colembed.load(exported_tiny.folder, max_image_tokens=16, threads=1)
    assert np.array_equal(page, direct.embed_images([page_files[0]])[0])
    assert capped.model.model.max_image_tokens == 16
    with pytest.raises(TypeError, match="max_image_token"):
        LateInteractionMultimodalEmbedding(MODEL, specific_model_path=exported_tiny.folder,
                                           max_image_token=16)


def test_providers_cuda_and_device_ids(exported_tiny):
    import onnxruntime

    from fastembed.common.types import Device

    folder = str(exported_tiny.folder)
    explicit = LateInteractionMultimodalEmbedding(MODEL, specific_model_path=folder,
                                                  providers=["CPUExecutionProvider"])
    assert explicit.model.model.providers[0] == "CPUExecutionProvider"
    default = LateInteractionMultimodalEmbedding(MODEL, specific_model_path=folder)
    has_cuda = "CUDAExecutionProvider" in onnxruntime.get_available_providers()
    assert default.model.model.providers[0] == (
        "CUDAExecutionProvider" if has_cuda else "CPUExecutionProvider")

    # FastEmbed's mapping: cuda=True demands CUDA on the first of device_ids; cuda=False is CPU
    lazy = LateInteractionMultimodalEmbedding(MODEL, specific_model_path=folder, cuda=True,
                                              device_ids=[1, 2], lazy_load=True)
    assert lazy.model._onnx_providers() == ([("CUDAExecutionProvider", {"device_id": 1})], False)
    lazy = LateInteractionMultimodalEmbedding(MODEL, specific_model_path=folder, cuda=Device.CPU,
                                              lazy_load=True)
    assert lazy.model._onnx_providers() == (None, False)
    if not has_cuda:  # no silent CPU fallback when CUDA was demanded
        with pytest.raises(colembed.ProviderError, match="CUDAExecutionProvider"):
            LateInteractionMultimodalEmbedding(MODEL, specific_model_path=folder, cuda=True)


def test_parallel_reports_the_bad_item(fe_model, page_files):
    images = [page_files[0], page_files[1], b"not an image", page_files[2]]
    with pytest.raises(ImageError, match="item 2"):
        list(fe_model.embed_image(images, batch_size=1, parallel=2))


def test_muvera_encodes_documents_and_queries(fe_model, page_files):
    muvera = Muvera.from_multivector_model(fe_model, k_sim=4, dim_proj=16, r_reps=8)
    assert muvera.dim == 128 and muvera.embedding_size == 8 * 2**4 * 16
    pages = list(fe_model.embed_image(page_files))
    queries = list(fe_model.embed_text(QUERIES))
    for vectors, encode in [(v, muvera.process_document) for v in pages] + [
            (v, muvera.process_query) for v in queries]:
        fde = encode(vectors)
        assert fde.shape == (muvera.embedding_size,) and np.all(np.isfinite(fde))
        assert np.any(fde != 0)
    # deterministic for the same vectors
    assert np.array_equal(muvera.process_document(pages[0]), muvera.process_document(pages[0]))


def test_import_colembed_registers():
    _run("import colembed\nfrom fastembed import LateInteractionMultimodalEmbedding as L\n"
         "assert any(d['model'] == 'colqwen2' for d in L.list_supported_models())\nprint('ok')")
