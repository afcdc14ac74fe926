"""The exported graphs, run torch-free by colembed, match ColQwen2ForRetrieval per token.

Reference: transformers 4.57.1 ColQwen2Processor (PIL image processor) + ColQwen2ForRetrieval,
fp32, one item at a time, real rows (attention mask 1) only.
"""

from __future__ import annotations

import numpy as np
import pytest
from tests.fixtures.builds import PARITY_TOLERANCE
from tests.fixtures.builds import reference_rows as _reference_rows
from tests.fixtures.samples import PAGES, QUERIES

import colembed

pytestmark = pytest.mark.heavy("tiny")

BATCH_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def reference_queries(reference_model, reference_processor):
    return [
        _reference_rows(reference_model, reference_processor.process_queries([q])) for q in QUERIES
    ]


@pytest.fixture(scope="module")
def reference_pages(reference_model, reference_processor):
    return {
        name: _reference_rows(reference_model, reference_processor.process_images([img]))
        for name, img in PAGES.items()
    }


def _max_diff(got, want):
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got - want))) if got.size else 0.0


def test_pages_cover_distinct_grids(reference_processor):
    grids = {
        tuple(reference_processor.process_images([img])["image_grid_thw"][0].tolist())
        for img in PAGES.values()
    }
    assert len(grids) >= 6, grids


def test_queries_match_reference_per_token(tiny_model, reference_queries):
    got = tiny_model.embed_queries(QUERIES, batch_size=1)
    diffs = [_max_diff(g, w) for g, w in zip(got, reference_queries)]
    print(f"query parity: max abs diff {max(diffs):.2e}")
    assert max(diffs) <= PARITY_TOLERANCE
    for g in got:
        assert g.dtype == np.float32 and g.shape[1] == tiny_model.embedding_size
        np.testing.assert_allclose(np.linalg.norm(g, axis=1), 1.0, atol=1e-5)


def test_queries_in_mixed_batch_match_reference(tiny_model, reference_queries):
    got = tiny_model.embed_queries(QUERIES, batch_size=5)
    assert max(_max_diff(g, w) for g, w in zip(got, reference_queries)) <= PARITY_TOLERANCE


def test_pages_match_reference_per_token(tiny_model, reference_pages):
    names = list(PAGES)
    got = tiny_model.embed_images([PAGES[n] for n in names], batch_size=1)
    diffs = {n: _max_diff(g, reference_pages[n]) for n, g in zip(names, got)}
    print("page parity:", {n: f"{d:.1e}" for n, d in diffs.items()})
    assert max(diffs.values()) <= PARITY_TOLERANCE, diffs


def test_pages_in_mixed_batch_match_reference(tiny_model, reference_pages):
    names = list(PAGES)
    # Two copies of one grid land in the same image-graph call; the rest share text batches.
    images = [PAGES[n] for n in names] + [PAGES["odd_997x613"]]
    got = tiny_model.embed_images(images, batch_size=len(images))
    for name, g in zip(names + ["odd_997x613"], got):
        assert _max_diff(g, reference_pages[name]) <= PARITY_TOLERANCE, name


def test_query_vectors_do_not_depend_on_batch(tiny_model):
    alone = [tiny_model.embed_queries([q])[0] for q in QUERIES[:6]]
    for batch_size in (1, 3, 16):
        batched = tiny_model.embed_queries(QUERIES[:6] * 3, batch_size=batch_size)
        for i, vec in enumerate(batched):
            assert _max_diff(vec, alone[i % 6]) <= BATCH_TOLERANCE, (batch_size, i)


def test_page_vectors_do_not_depend_on_batch(tiny_model):
    names = ["tiny_20x20", "rgba_80x120", "gray_L", "tall_40x300"]
    alone = [tiny_model.embed_images([PAGES[n]])[0] for n in names]
    images = [PAGES[n] for n in names] * 4
    for batch_size in (1, 3, 16):
        batched = tiny_model.embed_images(images, batch_size=batch_size)
        for i, vec in enumerate(batched):
            assert _max_diff(vec, alone[i % len(names)]) <= BATCH_TOLERANCE, (batch_size, i)


def test_lazy_iteration_over_a_generator(tiny_model):
    consumed = []

    def queries():
        for q in QUERIES[:5]:
            consumed.append(q)
            yield q

    iterator = tiny_model.iter_query_embeddings(queries(), batch_size=2)
    first = next(iterator)
    assert len(consumed) == 2  # only the first batch was pulled from the generator
    rest = list(iterator)
    assert len(rest) == 4 and first.shape[1] == tiny_model.embedding_size


def test_second_architecture_exports_and_matches(exported_alt_from_hub, tiny_alt_checkpoint):
    """Nothing is hard-wired to the default fixture: other heads, sections, depths, dim 64
    (conftest's one tiny-alt export)."""
    import torch
    from transformers import ColQwen2ForRetrieval, ColQwen2Processor

    model = colembed.load(exported_alt_from_hub[0].folder)
    assert model.embedding_size == 64
    reference = ColQwen2ForRetrieval.from_pretrained(
        tiny_alt_checkpoint, dtype=torch.float32
    ).eval()
    processor = ColQwen2Processor.from_pretrained(tiny_alt_checkpoint, use_fast=False)
    names = ["odd_997x613", "rgba_80x120", "cmyk"]
    got_pages = model.embed_images([PAGES[n] for n in names], batch_size=2)
    for name, g in zip(names, got_pages):
        want = _reference_rows(reference, processor.process_images([PAGES[name]]))
        assert _max_diff(g, want) <= PARITY_TOLERANCE, name
    got_queries = model.embed_queries(QUERIES[:4], batch_size=3)
    for q, g in zip(QUERIES[:4], got_queries):
        assert (
            _max_diff(g, _reference_rows(reference, processor.process_queries([q])))
            <= PARITY_TOLERANCE
        )


def test_manifest_records_the_check(exported_tiny):
    check = exported_tiny.manifest.checks["fp32"]
    assert check["max_abs_diff"] <= check["tolerance"] == PARITY_TOLERANCE
    assert exported_tiny.manifest.model.random_weights is True


def test_repr_and_properties(tiny_model):
    text = repr(tiny_model)
    assert "fp32" in text and "dim=128" in text and "CPUExecutionProvider" in text
    assert tiny_model.max_image_tokens == 768
    assert tiny_model.providers[0] == "CPUExecutionProvider"
