"""Runtime embeddings rank pages as the reference model's do, under the same exact scorer."""

from __future__ import annotations

import numpy as np
from tests.fixtures.builds import reference_rows
from tests.fixtures.samples import PAGES, QUERIES

import colembed


def test_runtime_ranking_equals_reference_ranking(tiny_model, reference_model, reference_processor):
    pages = list(PAGES.values())
    queries = QUERIES[:6]
    ours_pages = tiny_model.embed_images(pages, batch_size=4)
    ours_queries = tiny_model.embed_queries(queries)
    ref_pages = [
        reference_rows(reference_model, reference_processor.process_images([p])) for p in pages
    ]
    ref_queries = [
        reference_rows(reference_model, reference_processor.process_queries([q])) for q in queries
    ]
    ours = colembed.score(ours_queries, ours_pages)
    ref = colembed.score(ref_queries, ref_pages)
    np.testing.assert_allclose(ours, ref, atol=1e-3)
    np.testing.assert_array_equal(
        np.argsort(-ours, axis=1, kind="stable"), np.argsort(-ref, axis=1, kind="stable")
    )
    idx, top = tiny_model.top_k(ours_queries, ours_pages, 3)
    np.testing.assert_array_equal(idx, np.argsort(-ref, axis=1, kind="stable")[:, :3])


def test_model_scorer_uses_the_folder_graph(tiny_model):
    pages = tiny_model.embed_images(list(PAGES.values())[:4])
    queries = tiny_model.embed_queries(QUERIES[:3])
    assert tiny_model.scorer.has_graph
    graph = tiny_model.score(queries, pages, backend="onnx")
    plain = tiny_model.score(queries, pages, backend="numpy")
    np.testing.assert_allclose(graph, plain, rtol=1e-5)
