"""Fuzzing the runtime's input contract: only documented exceptions come out, finished items kept.

Hypothesis feeds random and mutated pages (PNG, JPEG, BMP, WebP, multi-frame GIF and TIFF; whole,
truncated or with flipped bytes), query strings (lone surrogates, control characters, very long),
scorer arrays and manifests (the exported manifest with a field replaced or removed). Each case
passes or raises the one error type colembed documents for it, naming the item; a batch that fails
keeps the items before the bad one. Bounded: few examples per property, a deadline each, one
small tiny-model export shared with the rest of the suite (the module runs in well under 30 s on
two cores once that fixture exists).

PDFs (and image files) as the index reads them: `Document` opens and renders, or raises its
SourceError naming the file.
"""

from __future__ import annotations

import copy
import io
import json
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

import colembed
from colembed.errors import (
    ImageError,
    InputError,
    InputTypeError,
    ManifestError,
    QueryTruncatedWarning,
    ScoringError,
)
from colembed.manifest import MANIFEST_NAME, Manifest
from colembed.preprocess.images import PreparedImage, prepare_image

FUZZ = settings(max_examples=25, deadline=2000, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])
FUZZ_MODEL = settings(FUZZ, max_examples=8, deadline=10000)
MAX_FUZZ_PIXELS = 4_000_000  # mutated headers may claim huge sizes: refuse them early, and fast


@pytest.fixture(autouse=True)
def _small_bomb_limit(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", MAX_FUZZ_PIXELS)


# ------------------------------------------------------------------------------------- pages
def _encode(frames: list[Image.Image], fmt: str) -> bytes:
    out = io.BytesIO()
    extra = {"save_all": True, "append_images": frames[1:]} if len(frames) > 1 else {}
    frames[0].save(out, format=fmt, **extra)
    return out.getvalue()


def _damage(draw, data: bytearray) -> bytes:
    """Maybe truncate `data`, then overwrite up to 6 random bytes."""
    if draw(st.booleans()):
        data = data[:draw(st.integers(0, len(data)))]
    for _ in range(draw(st.integers(0, 6))):
        if data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


@st.composite
def page_bytes(draw) -> bytes:
    """A small real image file (possibly multi-frame), then maybe truncated and/or mutated."""
    fmt = draw(st.sampled_from(["PNG", "JPEG", "BMP", "WEBP", "GIF", "TIFF"]))
    mode = draw(st.sampled_from(["RGB", "L", "RGBA", "P", "1"] if fmt != "JPEG" else ["RGB", "L"]))
    frames = draw(st.integers(1, 3)) if fmt in ("GIF", "TIFF") else 1
    w, h = draw(st.integers(1, 48)), draw(st.integers(1, 48))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(mode)
              for _ in range(frames)]
    data = bytearray(_encode(images, fmt))
    return _damage(draw, data)


PAGE_SOURCES = st.one_of(page_bytes(), st.binary(max_size=256),
                         st.sampled_from([None, 3, 1.5, [], "no/such/file.png", object()]))


def _check_page(obj, config, index: int) -> bool:
    """True if the page prepared; False if it raised its documented error naming `index`."""
    try:
        prepared = prepare_image(obj, config, index=index)
    except (ImageError, InputTypeError) as e:
        assert e.index == index and f"item {index}" in str(e)
        return False
    assert isinstance(prepared, PreparedImage) and np.isfinite(prepared.patches).all()
    return True


@pytest.mark.filterwarnings("ignore::UserWarning")  # PIL warns about malformed TIFF tags
@FUZZ
@given(page=PAGE_SOURCES, index=st.integers(0, 10**6))
def test_any_page_prepares_or_raises_its_image_error(config, page, index):
    _check_page(page, config, index)


@FUZZ_MODEL
@given(pages=st.lists(PAGE_SOURCES, min_size=1, max_size=5), batch=st.integers(1, 3))
def test_a_batch_of_pages_keeps_the_pages_before_the_first_bad_one(tiny_model, config, pages,
                                                                  batch):
    good = [_check_page(p, config, i) for i, p in enumerate(pages)]
    _embeds_or_names_first_bad(lambda: tiny_model.embed_images(pages, batch_size=batch), good)


def _embeds_or_names_first_bad(embed, good: list[bool]) -> list[np.ndarray] | None:
    """`embed()` gives one result per item when all are good; else it raises InputError naming
    the first bad item, with every item before it in `.completed`."""
    first_bad = good.index(False) if False in good else None
    try:
        vectors = embed()
    except InputError as e:
        assert first_bad is not None and e.index == first_bad
        assert len(e.completed) == first_bad
        return None
    assert first_bad is None and len(vectors) == len(good)
    return vectors


@st.composite
def pdf_bytes(draw) -> bytes:
    """A small real PDF of 1-3 pages (Pillow's writer), then maybe truncated and/or mutated."""
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    pages = [Image.fromarray(rng.integers(0, 256, (draw(st.integers(8, 40)),
                                                   draw(st.integers(8, 40)), 3), dtype=np.uint8))
             for _ in range(draw(st.integers(1, 3)))]
    data = bytearray(_encode(pages, "PDF"))
    return _damage(draw, data)


@pytest.mark.filterwarnings("ignore::UserWarning")
@FUZZ
@given(data=st.one_of(pdf_bytes(), page_bytes().map(lambda b: ("png", b))), name=st.uuids())
def test_any_document_renders_or_raises_its_source_error(tmp_path, data, name):
    from colembed.index.sources import Document, SourceError

    suffix, payload = data if isinstance(data, tuple) else ("pdf", data)
    path = tmp_path / f"{name}.{suffix}"
    path.write_bytes(payload)
    try:
        with Document(path, max_pixels=40_000) as document:
            for page in range(1, document.pages + 1):
                image = document.render(page)
                assert image.mode == "RGB" and image.width * image.height <= 4 * 40_000
    except SourceError as e:
        assert str(path) in str(e)


# ----------------------------------------------------------------------------------- queries
QUERY_TEXT = st.text(st.characters(exclude_categories=()), max_size=60)  # surrogates, controls
LONG_QUERY = st.builds(lambda word, n: word * n, st.text(min_size=1, max_size=8),
                       st.integers(100, 800))
QUERIES = st.lists(st.one_of(QUERY_TEXT, LONG_QUERY, st.sampled_from([None, 7, b"bytes"])),
                   min_size=1, max_size=6)


def _valid_query(q) -> bool:
    if not isinstance(q, str):
        return False
    try:
        q.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


@FUZZ_MODEL
@given(queries=QUERIES, batch=st.integers(1, 4))
def test_queries_embed_or_name_the_first_bad_one(tiny_model, queries, batch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QueryTruncatedWarning)  # long queries are cut, by design
        vectors = _embeds_or_names_first_bad(
            lambda: tiny_model.embed_queries(queries, batch_size=batch),
            [_valid_query(q) for q in queries])
    limit = tiny_model.text_encoder.max_query_tokens
    assert all(v.shape[0] <= limit and np.isfinite(v).all() for v in vectors or [])


# ------------------------------------------------------------------------------------ scorer
ARRAYS = st.one_of(
    st.builds(lambda n, d, fill, dt: np.full((n, d), fill, dtype=dt),
              st.integers(0, 4), st.sampled_from([0, 1, 8, 128]),
              st.sampled_from([0.0, 1.0, -2.5, np.nan, np.inf, 1e30]),
              st.sampled_from([np.float32, np.float16, np.float64, np.int64])),
    st.builds(lambda shape: np.ones(shape, np.float32),
              st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple)),
    st.sampled_from([None, "text", 3, [[1.0, 2.0]], [], [[]]]),
)


@pytest.mark.filterwarnings("ignore:.*encountered in cast:RuntimeWarning")  # building NaN ints
@FUZZ
@given(queries=st.lists(ARRAYS, max_size=3), pages=st.lists(ARRAYS, max_size=3),
       backend=st.sampled_from(["numpy", "auto"]))
def test_scorer_scores_or_raises_scoring_error(queries, pages, backend):
    try:
        scores = colembed.score(queries, pages, backend=backend)
    except ScoringError:
        return
    assert scores.shape == (len(queries), len(pages)) and np.isfinite(scores).all()


# --------------------------------------------------------------------------------- manifests
JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2, 2**40), st.floats(),
                        st.sampled_from(["", "../x", "/etc/passwd", "a\\b", "C:x", "fp32"]),
                        st.just([]), st.just({}), st.lists(st.integers(-1, 3), max_size=4))


def _paths(node, prefix=()):
    yield prefix
    children = node.items() if isinstance(node, dict) else enumerate(node) \
        if isinstance(node, list) else ()
    for key, child in children:
        yield from _paths(child, prefix + (key,))


@pytest.fixture(scope="module")
def manifest_json(exported_tiny):
    return json.loads((exported_tiny.folder / MANIFEST_NAME).read_text())


@FUZZ
@given(data=st.data())
def test_mutated_manifest_loads_or_raises_manifest_error(manifest_json, data):
    mutated = copy.deepcopy(manifest_json)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from([p for p in _paths(mutated) if p]))
        parent = mutated
        for key in path[:-1]:
            parent = parent[key]
        if data.draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(JSON_VALUES)
    try:
        manifest = Manifest.from_dict(mutated)
    except ManifestError as e:
        assert str(e)
        return
    assert Manifest.from_dict(manifest.to_dict()) == manifest
