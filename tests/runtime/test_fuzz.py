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

FUZZ = settings(
    max_examples=25,
    deadline=2000,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
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
        data = data[: draw(st.integers(0, len(data)))]
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
    images = [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(mode)
        for _ in range(frames)
    ]
    data = bytearray(_encode(images, fmt))
    return _damage(draw, data)


PAGE_SOURCES = st.one_of(
    page_bytes(),
    st.binary(max_size=256),
    st.sampled_from([None, 3, 1.5, [], "no/such/file.png", object()]),
)


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
def test_a_batch_of_pages_keeps_the_pages_before_the_first_bad_one(
    tiny_model, config, pages, batch
):
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
    pages = [
        Image.fromarray(
            rng.integers(
                0, 256, (draw(st.integers(8, 40)), draw(st.integers(8, 40)), 3), dtype=np.uint8
            )
        )
        for _ in range(draw(st.integers(1, 3)))
    ]
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
LONG_QUERY = st.builds(
    lambda word, n: word * n, st.text(min_size=1, max_size=8), st.integers(100, 800)
)
QUERIES = st.lists(
    st.one_of(QUERY_TEXT, LONG_QUERY, st.sampled_from([None, 7, b"bytes"])), min_size=1, max_size=6
)


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
            [_valid_query(q) for q in queries],
        )
    limit = tiny_model.text_encoder.max_query_tokens
    assert all(v.shape[0] <= limit and np.isfinite(v).all() for v in vectors or [])


# ------------------------------------------------------------------------------------ scorer
ARRAYS = st.one_of(
    st.builds(
        lambda n, d, fill, dt: np.full((n, d), fill, dtype=dt),
        st.integers(0, 4),
        st.sampled_from([0, 1, 8, 128]),
        st.sampled_from([0.0, 1.0, -2.5, np.nan, np.inf, 1e30]),
        st.sampled_from([np.float32, np.float16, np.float64, np.int64]),
    ),
    st.builds(
        lambda shape: np.ones(shape, np.float32),
        st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple),
    ),
    st.sampled_from([None, "text", 3, [[1.0, 2.0]], [], [[]]]),
)


@pytest.mark.filterwarnings("ignore:.*encountered in cast:RuntimeWarning")  # building NaN ints
@FUZZ
@given(
    queries=st.lists(ARRAYS, max_size=3),
    pages=st.lists(ARRAYS, max_size=3),
    backend=st.sampled_from(["numpy", "auto"]),
)
def test_scorer_scores_or_raises_scoring_error(queries, pages, backend):
    try:
        scores = colembed.score(queries, pages, backend=backend)
    except ScoringError:
        return
    assert scores.shape == (len(queries), len(pages)) and np.isfinite(scores).all()


# --------------------------------------------------------------------------------- manifests
JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 2**40),
    st.floats(),
    st.sampled_from(["", "../x", "/etc/passwd", "a\\b", "C:x", "fp32"]),
    st.just([]),
    st.just({}),
    st.lists(st.integers(-1, 3), max_size=4),
)


def _paths(node, prefix=()):
    yield prefix
    children = (
        node.items()
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
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


# ---------------------------------------------------- declared sizes and the index's decoder
FUZZ_HOSTILE = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)


def _declare_size(data: bytes, fmt: str, width: int, height: int) -> bytes:
    """A real file whose header claims `width` x `height` (the pixels stay the small image's)."""
    import struct
    import zlib

    out = bytearray(data)
    if fmt == "PNG":  # IHDR right after the signature; its CRC made to match
        out[16:24] = struct.pack(">II", width, height)
        out[29:33] = struct.pack(">I", zlib.crc32(bytes(out[12:29])) & 0xFFFFFFFF)
    elif fmt == "GIF":  # the logical screen and the first image descriptor
        out[6:10] = struct.pack("<HH", min(width, 65535), min(height, 65535))
        at = out.find(b"\x2c", 13)
        if at > 0:
            out[at + 5 : at + 9] = struct.pack("<HH", min(width, 65535), min(height, 65535))
    elif fmt == "BMP":
        out[18:26] = struct.pack("<ii", min(width, 2**31 - 1), min(height, 2**31 - 1))
    elif fmt == "JPEG":  # the first start-of-frame marker
        at = out.find(b"\xff\xc0")
        if at > 0:
            out[at + 5 : at + 9] = struct.pack(">HH", min(height, 65535), min(width, 65535))
    elif fmt == "TIFF":  # ImageWidth / ImageLength entries of the first directory (little-endian)
        ifd = struct.unpack("<I", out[4:8])[0]
        for i in range(struct.unpack("<H", out[ifd : ifd + 2])[0]):
            at = ifd + 2 + 12 * i
            tag = struct.unpack("<H", out[at : at + 2])[0]
            if tag in (256, 257):
                out[at + 2 : at + 12] = struct.pack("<HII", 4, 1, width if tag == 256 else height)
    return bytes(out)


@st.composite
def declared_huge(draw) -> bytes:
    fmt = draw(st.sampled_from(["PNG", "GIF", "BMP", "JPEG", "TIFF"]))
    image = Image.fromarray(
        np.random.default_rng(draw(st.integers(0, 99))).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    )
    side = st.integers(1, 2**31 - 1) if fmt in ("PNG", "TIFF") else st.integers(1, 65535)
    return _damage(
        draw, bytearray(_declare_size(_encode([image], fmt), fmt, draw(side), draw(side)))
    )


EPS_LIKE = st.sampled_from(
    [
        b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 100 100\n",
        b"\xc5\xd0\xd3\xc6" + b"\0" * 28,
        b"%PDF-1.4\n",
        b"P6\n8 8\n255\n" + b"\0" * 192,
        b"II*\0" + b"\xff" * 60,
    ]
)
HOSTILE_PAGES = st.one_of(page_bytes(), declared_huge(), st.binary(max_size=512), EPS_LIKE)


@pytest.mark.filterwarnings("ignore::UserWarning")
@FUZZ_HOSTILE
@given(
    data=HOSTILE_PAGES,
    suffix=st.sampled_from([".png", ".jpg", ".tiff", ".gif"]),
    index=st.integers(0, 99),
)
def test_every_decode_path_decodes_within_the_limit_or_names_the_item(
    tmp_path, data, suffix, index
):
    """embed's decoder and the index's reader, on the same bytes: a success within the pixel
    limit, or the typed error naming the item; never another exception, never Ghostscript."""
    from colembed.index.sources import Document, SourceError
    from colembed.preprocess.images import load_image, pixel_limit

    try:
        image = load_image(data, index=index)
        assert image.mode == "RGB" and image.width * image.height <= pixel_limit()
    except ImageError as e:
        assert e.index == index and f"item {index}" in str(e)
    path = tmp_path / f"page{suffix}"
    path.write_bytes(data)
    try:
        with Document(path, max_pixels=40_000) as document:
            for page in range(1, document.pages + 1):
                image = document.page_image(page)
                assert image.width * image.height <= pixel_limit()
    except SourceError as e:
        assert e.path == path and str(path) in str(e)


# ---------------------------------------------- ready points, Parquet rows and add_embedded
P_DIM, P_ROWS, P_COLS, P_START = 8, 2, 2, 1
JSON_VALUES = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**40), 2**40),
        st.floats(allow_nan=True),
        st.text(max_size=8),
    ),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=4), inner, max_size=2),
    max_leaves=6,
)


def _valid_payload() -> dict:
    from colembed.index.schema import SCHEMA_VERSION

    return {
        "path": "/docs/a.pdf",
        "page": 1,
        "pages": 1,
        "sha256": "a" * 64,
        "width": 56,
        "height": 56,
        "grid": [P_ROWS, P_COLS],
        "image_start": P_START,
        "model": "m",
        "variant": "fp32",
        "manifest_sha256": "h",
        "schema": SCHEMA_VERSION,
        "model_source": "/m",
    }


@st.composite
def ready_points(draw):
    """A valid ready point, then maybe: fields replaced by any JSON value, removed or added,
    vectors scaled, reshaped, made non-finite or ragged."""
    from colembed.index.schema import PagePoint, point_id

    payload = _valid_payload()
    for _ in range(draw(st.integers(0, 3))):
        action = draw(st.sampled_from(["replace", "remove", "add"]))
        name = draw(st.sampled_from(sorted(payload) + ["token_clusters", "pool_factor"]))
        if action == "replace":
            payload[name] = draw(JSON_VALUES)
        elif action == "remove":
            payload.pop(name, None)
        else:
            payload[draw(st.text(min_size=1, max_size=6))] = draw(JSON_VALUES)
    n = P_START + P_ROWS * P_COLS + draw(st.integers(-2, 2))
    rng = np.random.default_rng(draw(st.integers(0, 99)))
    v = rng.standard_normal((max(n, 0), P_DIM))
    v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-9)
    v = v * draw(st.sampled_from([1.0, 1.0, 1.0, 1.004, 0.0, 3.0, 1e6, float("nan")]))
    vectors = draw(st.sampled_from(["ok", "wide", "flat", "list"]))
    page = {
        "ok": v,
        "wide": np.hstack([v, v]),
        "flat": v.reshape(-1),
        "list": [list(r) for r in v] + [[1.0]],
    }[vectors]
    try:
        pid = point_id(payload.get("sha256"), payload.get("page"), payload.get("path"))
    except Exception:  # noqa: BLE001 (a payload that cannot even make an id: any id then)
        pid = "00000000-0000-5000-8000-000000000000"
    if draw(st.booleans()):
        pid = draw(st.sampled_from([pid, "not-a-uuid", ""]))
    return PagePoint(pid, {"page": page}, payload, origin="part-x.parquet row 0")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@FUZZ_HOSTILE
@given(points=st.lists(ready_points(), min_size=1, max_size=3))
def test_ready_points_are_stored_whole_or_refused_by_name_before_any_is_written(
    tmp_path_factory, points
):
    from colembed.errors import ColembedError
    from colembed.index import Index, open_store

    db = tmp_path_factory.mktemp("ready") / "db"
    open_store(db, dim=P_DIM).close()
    with Index(db) as index:
        try:
            stored = index.add_embedded(points)
        except ColembedError as e:
            assert len(index) == 0  # every point checked before any is written
            assert "parquet row 0" in str(e) or "given twice" in str(e) or "model" in str(e)
            return
        from colembed.index.schema import payload_problems

        assert stored == len(index) == len(points)
        payloads = index.store.payloads()
        assert len(payloads) == stored  # every stored point reads back, and fits the schema
        assert not any(payload_problems(p, strict=False) for _, p in payloads)


@FUZZ_HOSTILE
@given(data=st.data())
def test_any_parquet_part_is_read_or_refused_naming_the_file(tmp_path_factory, data):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from colembed.distributed.targets import read_points
    from colembed.errors import ColembedError

    folder = tmp_path_factory.mktemp("parquet")
    rows = data.draw(st.integers(0, 3))
    floats = st.lists(st.lists(st.floats(width=32), max_size=3), max_size=3)
    column = st.one_of(
        st.lists(floats, min_size=rows, max_size=rows).map(
            lambda v: pa.array(v, type=pa.list_(pa.list_(pa.float32())))
        ),
        st.lists(st.text(max_size=5), min_size=rows, max_size=rows).map(pa.array),
        # a Parquet integer column is at most 64 bits: what a file can hold
        st.lists(st.integers(-(2**63), 2**63 - 1), min_size=rows, max_size=rows).map(pa.array),
    )
    names = data.draw(
        st.lists(
            st.sampled_from(
                ["id", "payload", "page_vectors", "rows_vectors", "cols_vectors", "path"]
            ),
            unique=True,
        )
    )
    table = (
        pa.table({name: data.draw(column) for name in names})
        if names
        else pa.table({"x": pa.array([0] * rows)})
    )
    pq.write_table(table, folder / "part-0.parquet")
    try:
        points = read_points(str(folder))
    except ColembedError as e:
        assert "part-0.parquet" in str(e)
        return
    assert all(p.origin.startswith(str(folder / "part-0.parquet")) for p in points.values())
