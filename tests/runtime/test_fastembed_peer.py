"""FastEmbed's own checks, run against "colqwen2" and "colqwen2.5" on the tiny exported fixtures
(the canonical-value, token-count and description checks take both names; the rest "colqwen2"),
offline.

The first half mirrors FastEmbed 0.9.x `tests/test_late_interaction_multimodal.py` test by test
(batch, single, query, get_embedding_size, embedding_size with lazy_load, token_count): the model
is built the way that module builds it, by name only (`LateInteractionMultimodalEmbedding(name)`,
found in FASTEMBED_CACHE_PATH), and compared with abridged canonical values (first 7 tokens x 7
dims of the first item, atol 2e-3). FastEmbed hard-codes its canonical values; ours are computed in
this session from the pinned reference (transformers ColQwen2ForRetrieval on the same tiny
checkpoint), never from colembed, so the comparison can fail.

The second half mirrors FastEmbed's generic checks from its other test modules: the supported-model
description fields (test_common), lazy_load opening no session until first use, `parallel=2`
equal to serial, and `enable_cpu_mem_arena` reaching the sessions' options.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
from PIL import Image

from tests.fixtures.builds import reference_rows

from tests.fixtures.images import rgb as noise_page

from colembed.fastembed import LateInteractionMultimodalEmbedding
from colembed.registry import get_model

MODEL = "colqwen2"
MODEL_2_5 = "colqwen2.5"  # the second family: the same checks, on the tiny-2.5 export
TOKENS, DIMS = 7, 7  # abridged like FastEmbed's canonical arrays
queries = ["hello world", "flag embedding"]


@pytest.fixture(scope="module")
def image_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("peer-images") / "image.png"
    noise_page(150, 210, seed=7).save(path)
    return path


@pytest.fixture(scope="module")
def images(image_path):
    """One page in the three forms FastEmbed's module uses: Path, str, opened PIL image."""
    return [image_path, str(image_path), Image.open(image_path)]


@pytest.fixture(scope="module", autouse=True)
def fastembed_cache(exported_tiny, exported_tiny_2_5, tmp_path_factory):
    """A FastEmbed cache holding the tiny exports where colembed looks for "colqwen2" and
    "colqwen2.5"."""
    cache = tmp_path_factory.mktemp("fastembed-cache")
    for name, export in ((MODEL, exported_tiny), (MODEL_2_5, exported_tiny_2_5)):
        (cache / get_model(name).cache_folder_name).symlink_to(
            export.folder, target_is_directory=True
        )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FASTEMBED_CACHE_PATH", str(cache))
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield cache


@pytest.fixture(scope="module")
def canonical(reference_model, reference_processor, image_path, tmp_path_factory):
    """{"image": {model: values}, "query": {model: values}} from each family's reference model
    (ColQwen2.5's: transformers over Qwen2.5-VL with the get_dtype shim), rounded to 4 decimals
    like FastEmbed's literals."""
    import torch
    from transformers import ColQwen2ForRetrieval

    from colembed_export.families import export_family
    from tests.fixtures.qwen2_5 import checkpoint, reference_processor as processor_2_5

    source = checkpoint(tmp_path_factory, "tiny-2.5", "transformers")
    references = {
        MODEL: (reference_model, reference_processor),
        MODEL_2_5: (
            export_family("colqwen2.5").prepare_reference(
                ColQwen2ForRetrieval.from_pretrained(source, dtype=torch.float32).eval()
            ),
            processor_2_5(source),
        ),
    }
    out: dict[str, dict[str, np.ndarray]] = {"image": {}, "query": {}}
    for name, (model, processor) in references.items():
        page = reference_rows(model, processor.process_images([Image.open(image_path)]))
        query = reference_rows(model, processor.process_queries(queries[:1]))
        out["image"][name] = np.round(page[:TOKENS, :DIMS], 4)
        out["query"][name] = np.round(query[:TOKENS, :DIMS], 4)
    return out


@pytest.fixture(scope="module")
def model_cache():
    """FastEmbed's pattern: one model per lower-cased name for the module."""
    cache: dict[str, LateInteractionMultimodalEmbedding] = {}

    @contextmanager
    def get_model_(model_name: str):
        key = model_name.lower()
        if key not in cache:
            cache[key] = LateInteractionMultimodalEmbedding(key)
        yield cache[key]

    yield get_model_
    cache.clear()


# ------------------------------------------------- FastEmbed tests/test_late_interaction_multimodal
def test_batch_embedding(model_cache, canonical, images):
    for model_name, expected in canonical["image"].items():
        with model_cache(model_name) as model:
            result = list(model.embed_image(images, batch_size=2))
            assert len(result) == len(images)
            for value in result:
                tokens, dims = expected.shape
                assert np.allclose(value[:tokens, :dims], expected, atol=2e-3)


def test_single_embedding(model_cache, canonical, images):
    for model_name, expected in canonical["image"].items():
        with model_cache(model_name) as model:
            result = next(iter(model.embed_image(images, batch_size=6)))
            tokens, dims = expected.shape
            assert np.allclose(result[:tokens, :dims], expected, atol=2e-3)


def test_single_embedding_query(model_cache, canonical):
    for model_name, expected in canonical["query"].items():
        with model_cache(model_name) as model:
            result = next(iter(model.embed_text(queries)))
            tokens, dims = expected.shape
            assert np.allclose(result[:tokens, :dims], expected, atol=2e-3)


def test_get_embedding_size():
    assert LateInteractionMultimodalEmbedding.get_embedding_size("colqwen2") == 128
    assert LateInteractionMultimodalEmbedding.get_embedding_size("ColQwen2") == 128
    assert LateInteractionMultimodalEmbedding.get_embedding_size("colqwen2.5") == 128
    assert LateInteractionMultimodalEmbedding.get_embedding_size("ColQwen2.5") == 128


def test_embedding_size():
    model = LateInteractionMultimodalEmbedding(model_name="ColQwen2", lazy_load=True)
    assert model.embedding_size == 128


@pytest.mark.parametrize("name", [MODEL, MODEL_2_5])
def test_token_count(model_cache, name):
    with model_cache(name) as model:
        documents = ["short doc", "it is a long document to check attention mask for paddings"]
        short = model.token_count(documents[0])
        long = model.token_count(documents[1])
        assert short + long == model.token_count(documents)
        assert short + long == model.token_count(documents, batch_size=1)
        # "Query: " (2 tokens) and 10 augmentation tokens per query
        assert short + long + 2 * 12 == model.token_count(documents, include_extension=True)


# ---------------------------------------------------------------- FastEmbed's generic model checks
def test_list_supported_models_fields():
    """test_common.test_text_list_supported_models, for our entry (FastEmbed checks only [0])."""
    described = {d["model"]: d for d in LateInteractionMultimodalEmbedding.list_supported_models()}
    for name in (MODEL, MODEL_2_5):
        description = described[name]
        for key in ("model", "dim", "license", "size_in_GB", "model_file", "sources"):
            assert key in description and description[key], (name, key)
        assert "hf" in description["sources"] or "url" in description["sources"]


def test_lazy_load(images):
    model = LateInteractionMultimodalEmbedding(model_name=MODEL, lazy_load=True)
    assert not hasattr(model.model, "model")
    assert model.token_count(queries) > 0  # the tokenizer alone, no session
    assert not hasattr(model.model, "model")
    list(model.embed_image(images[:1]))
    assert hasattr(model.model, "model")

    model = LateInteractionMultimodalEmbedding(model_name=MODEL, lazy_load=True)
    list(model.embed_text(queries))
    assert hasattr(model.model, "model")


def test_parallel_processing(model_cache, images):
    """parallel=2 (two worker processes, each rebuilding the model) equals serial within 1e-5."""
    with model_cache(MODEL) as model:
        docs = queries * 3
        serial = list(model.embed_text(docs, batch_size=2, parallel=None))
        parallel = list(model.embed_text(iter(docs), batch_size=2, parallel=2))
        assert len(parallel) == len(docs)
        for a, b in zip(parallel, serial):
            assert a.shape == b.shape and a.dtype == np.float32
            assert np.max(np.abs(a - b)) <= 1e-5

        pages = images * 2
        serial = list(model.embed_image(pages, batch_size=2, parallel=None))
        parallel = list(model.embed_image(pages, batch_size=2, parallel=2))
        assert len(parallel) == len(pages)
        for a, b in zip(parallel, serial):
            assert a.shape == b.shape and np.max(np.abs(a - b)) <= 1e-5


def test_session_options(onnxruntime_calls):
    """FastEmbed's `enable_cpu_mem_arena` reaches the options onnxruntime opens each graph with."""

    def arena_by_graph():
        made = {
            name: options.enable_cpu_mem_arena for name, options, _ in onnxruntime_calls["sessions"]
        }
        onnxruntime_calls["sessions"].clear()
        return {name: made[name] for name in ("vision.onnx", "text.onnx")}

    LateInteractionMultimodalEmbedding(model_name=MODEL)  # fresh: the module's cache may hold one
    assert arena_by_graph() == {"vision.onnx": True, "text.onnx": True}
    LateInteractionMultimodalEmbedding(model_name=MODEL, enable_cpu_mem_arena=False)
    assert arena_by_graph() == {"vision.onnx": False, "text.onnx": False}
