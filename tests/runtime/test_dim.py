"""`colembed.load(dim=K)`: each page and query vector cut to its first K components and
L2-normalised again, after the graphs (which stay as exported); K checked against the model's
width; the index records K in its identity and refuses another; the CLI's `--dim` reaches the
model. On the tiny random-weight model (its vectors are not Matryoshka-trained: only the
mechanism is checked here, not what truncation does to rankings).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.fixtures.documents import write_pdf
from tests.fixtures.images import rgb

import colembed
from colembed.cli import main
from colembed.errors import DimensionError
from colembed.index import Index, ModelMismatchError
from colembed.index.records import ModelIdentity
from colembed.model import check_dim, truncate

TOKENS = 64  # image tokens per page: the mechanism is the same at any budget
QUERIES = ["What was the revenue in 2023?", "hello", "表格中的数字是多少？"]
PAGES = [rgb(150, 210, seed=1), rgb(200, 120, seed=2)]


def numpy_truncation(vectors: np.ndarray, dim: int) -> np.ndarray:
    head = vectors[:, :dim].astype(np.float64)
    return head / np.linalg.norm(head, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def full_model(exported_tiny):
    return colembed.load(exported_tiny.folder, max_image_tokens=TOKENS)


@pytest.fixture(scope="module")
def full_vectors(full_model):
    return full_model.embed_queries(QUERIES), full_model.embed_images(PAGES)


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 1.0])
def test_vectors_are_numpys_truncation_of_the_full_ones(
    exported_tiny, full_model, full_vectors, fraction
):
    width = full_model.full_embedding_size
    dim = max(1, int(width * fraction))
    model = colembed.load(exported_tiny.folder, max_image_tokens=TOKENS, dim=dim)
    assert (model.embedding_size, model.full_embedding_size) == (dim, width)
    assert f"dim={dim}" in repr(model)
    queries, pages = model.embed_queries(QUERIES), model.embed_images(PAGES)
    for ours, full in zip([*queries, *pages], [*full_vectors[0], *full_vectors[1]]):
        assert ours.dtype == np.float32 and ours.shape == (len(full), dim)
        np.testing.assert_allclose(ours, numpy_truncation(full, dim), rtol=0, atol=2e-6)
        np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=2e-6)
    # the page layout and scoring follow: scores are MaxSim over the truncated vectors
    (vectors, layout), _ = model.embed_pages(PAGES[:1] * 2)
    assert vectors.shape[1] == dim and layout.num_tokens == len(vectors)
    scores = colembed.score(queries, pages)
    assert scores.shape == (len(QUERIES), len(PAGES))


@given(dim=st.integers(1, 128), rows=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=60, deadline=None)
def test_truncate_is_numpys_for_every_valid_width(dim, rows, seed):
    vectors = np.random.default_rng(seed).standard_normal((rows, 128)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    assert check_dim(dim, 128) == dim
    out = truncate(vectors, dim)
    assert out.dtype == np.float32 and out.shape == (rows, dim)
    np.testing.assert_allclose(out, numpy_truncation(vectors, dim), rtol=0, atol=2e-6)


def test_a_zero_head_stays_zero():
    vectors = np.zeros((2, 8), np.float32)
    vectors[:, 4:] = 0.5
    assert not truncate(vectors, 4).any()


@pytest.mark.parametrize("bad", [0, -1, 129, 1.5, True, "64"])
def test_a_dim_outside_the_models_width_is_refused_naming_both(bad):
    with pytest.raises(DimensionError, match=rf"width 128, got {bad!r}".replace("(", r"\(")):
        check_dim(bad, 128)
    assert issubclass(DimensionError, ValueError)


def test_load_refuses_a_bad_dim_before_opening_a_graph(exported_tiny, onnxruntime_calls):
    width = colembed.load(exported_tiny.folder).full_embedding_size
    onnxruntime_calls.clear()
    with pytest.raises(DimensionError, match=f"width {width}, got {width + 1}"):
        colembed.load(exported_tiny.folder, dim=width + 1)
    assert not onnxruntime_calls
    with pytest.raises(DimensionError, match=f"width {width}, got 0"):
        ModelIdentity.of_folder(
            exported_tiny.folder, variant="fp32", max_image_tokens=None, dpi=None, schema=3, dim=0
        )
    identity = ModelIdentity.of_folder(
        exported_tiny.folder, variant="fp32", max_image_tokens=None, dpi=None, schema=3, dim=8
    )
    assert identity.dim == 8


def test_an_index_records_its_dim_and_refuses_another(exported_tiny, tmp_path):
    (tmp_path / "docs").mkdir()
    pdf = write_pdf(tmp_path / "docs" / "a.pdf", ["one", "two"])
    db = tmp_path / "db"
    folder = exported_tiny.folder
    with Index(db, model=str(folder), max_image_tokens=TOKENS, dim=16) as index:
        assert index.add([pdf]).pages_added == 2
        assert index.store.dim == 16 and index.identity["dim"] == 16
        ((_, payload), *_) = index.store.payloads()
        assert payload["dim"] == 16
    with Index(db) as reopened:  # no dim: the index's own
        assert reopened.model.embedding_size == 16
        [hits] = reopened.search(["one"], k=2)
        assert len(hits) == 2
    with pytest.raises(ModelMismatchError, match=r"16-dim page vectors.*dim 8\b.*dim=16"):
        Index(db, model=str(folder), max_image_tokens=TOKENS, dim=8)
    with Index(db, dim=8) as searched:  # the model loads at search: refused then
        with pytest.raises(ModelMismatchError, match=r"dim 16\).*dim 8\b"):
            searched.search(["one"], k=1)
    with Index(db, model=str(folder), max_image_tokens=TOKENS, dim=16) as same:
        assert same.add([pdf]).pages_added == 0  # the same K: stored pages are skipped


def test_the_identity_refuses_pages_of_another_dim_naming_both(exported_tiny, tmp_path):
    model = colembed.load(exported_tiny.folder, max_image_tokens=TOKENS, dim=16)
    stored = ModelIdentity.of_model(model, schema=3, dpi=None).payload()
    other = ModelIdentity.of_model(
        colembed.load(exported_tiny.folder, max_image_tokens=TOKENS, dim=32), schema=3, dpi=None
    )
    with pytest.raises(ModelMismatchError, match="dim: the index has 16, this run 32"):
        other.check(stored, "db")
    older = {k: v for k, v in stored.items() if k != "dim"}  # a page stamped before `dim`
    ModelIdentity.of_model(model, schema=3, dpi=None).check(older, "db")


def test_the_cli_flag_reaches_the_model(exported_tiny, tmp_path, capsys):
    (tmp_path / "docs").mkdir()
    pdf = write_pdf(tmp_path / "docs" / "a.pdf", ["alpha"])
    db = str(tmp_path / "db")
    common = ["--db", db, "--model", str(exported_tiny.folder), "--max-image-tokens", str(TOKENS)]
    assert main(["index", str(pdf), *common, "--dim", "24", "--json", "--quiet"]) == 0
    capsys.readouterr()
    with Index(db) as index:
        assert index.store.dim == 24 and index.model.embedding_size == 24
    assert main(["search", "alpha", "--db", db, "--json"]) == 0
    [result] = json.loads(capsys.readouterr().out)
    assert result["hits"]
    assert main(["search", "alpha", "--db", db, "--dim", "12"]) == 1
    assert "dim 24" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["search", "alpha", "--db", db, "--dim", "0"])


def test_fastembed_passes_dim_to_the_model_and_its_workers(exported_tiny):
    from colembed.fastembed import LateInteractionMultimodalEmbedding

    folder = str(exported_tiny.folder)
    fe = LateInteractionMultimodalEmbedding("colqwen2", specific_model_path=folder, dim=20)
    assert fe.model.embedding_size == 20 and fe.model.model.embedding_size == 20
    expected = colembed.load(folder, dim=20).embed_queries(QUERIES)
    here = list(fe.embed_text(QUERIES))
    there = list(fe.embed_text(QUERIES, batch_size=1, parallel=1))  # a worker process
    for a, b, c in zip(here, there, expected):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, c)
    with pytest.raises(DimensionError, match="got 0"):
        LateInteractionMultimodalEmbedding("colqwen2", specific_model_path=folder, dim=0)
