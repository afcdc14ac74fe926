"""The README's Qdrant example, run: FastEmbed "colqwen2" vectors in a local-mode Qdrant multivector
collection (MAX_SIM), searched with a query's vectors. Qdrant's ranking must equal colembed's
exact `top_k` for the same query and pages, with the same scores.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

import colembed
from colembed.registry import get_model


@pytest.fixture
def page_files(tmp_path):
    rng = np.random.default_rng(11)
    paths = []
    for i, (w, h) in enumerate([(150, 210), (210, 150), (120, 120), (168, 224), (90, 300)]):
        paths.append(tmp_path / f"page{i}.png")
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(paths[-1])
    return [str(p) for p in paths]


@pytest.fixture
def fastembed_cache(exported_tiny, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / get_model("colqwen2").cache_folder_name).symlink_to(exported_tiny.folder)
    monkeypatch.setenv("FASTEMBED_CACHE_PATH", str(cache))
    return cache


def test_qdrant_local_mode_ranks_like_colembed(fastembed_cache, page_files):
    # --- the README example ---
    from colembed.fastembed import LateInteractionMultimodalEmbedding
    from qdrant_client import QdrantClient, models

    model = LateInteractionMultimodalEmbedding("colqwen2")
    client = QdrantClient(":memory:")  # local mode; QdrantClient(url=...) for a server
    client.create_collection(
        "pages",
        vectors_config=models.VectorParams(
            size=model.embedding_size,
            distance=models.Distance.DOT,  # ColQwen2 vectors are unit length: DOT = cosine
            multivector_config=models.MultiVectorConfig(
                comparator=models.MultiVectorComparator.MAX_SIM),
        ),
    )
    page_vectors = list(model.embed_image(page_files))
    client.upsert("pages", points=[
        models.PointStruct(id=i, vector=vectors.tolist(), payload={"file": path})
        for i, (path, vectors) in enumerate(zip(page_files, page_vectors))
    ])
    query = next(iter(model.embed_text(["What was the revenue in 2023?"])))
    hits = client.query_points("pages", query=query.tolist(), limit=3).points
    # --- end of the README example ---

    indices, scores = colembed.top_k([query], page_vectors, 3)
    assert [hit.id for hit in hits] == indices[0].tolist()
    assert np.allclose([hit.score for hit in hits], scores[0], atol=1e-4, rtol=0)
    assert [hit.payload["file"] for hit in hits] == [page_files[i] for i in indices[0]]
    # the whole ranking, not just the top 3
    everything = client.query_points("pages", query=query.tolist(), limit=len(page_files)).points
    exact = colembed.score([query], page_vectors)[0]
    assert [hit.id for hit in everything] == np.argsort(-exact, kind="stable").tolist()
