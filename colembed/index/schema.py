"""The collection schemas every store writes: vector names, payload fields, point ids, pooling.

A page is one point with up to three multivectors (MaxSim over dot products; ColQwen2 vectors are
unit length, so dot = cosine) and one plain vector:

- `page`: every output row of the page (~750 x 128). The exact score; no HNSW graph (it is only
  ever a full scan or a rerank target).
- `rows` / `cols`: the image-token grid mean-pooled along each row / each column, plus the page's
  non-image rows (prompt tokens) unchanged: Qdrant's ColPali recipe, ~40 vectors instead of ~750,
  for a cheap first stage. Read only by the mean-gated plan (a Qdrant server, which has no token
  table) and the schema-1 plan (plan.py).
- `mean` (schema 2 on): the mean of the page's image-token rows, one 128-d vector scored by dot
  with the sum of the query's tokens (= the page's average token similarity summed over query
  tokens): the cheapest stage (plan.py).

Versions (`SCHEMA_VECTORS`):
- 1 (colembed 0.1.0): page, rows, cols.
- 2: page, rows, cols, mean. What a Qdrant server collection is created at (`SERVER_SCHEMA`):
  its two-stage plan reads rows / cols, and what a Parquet target carries.
- 3 (`SCHEMA_VERSION`, the newest): page, mean. What a new Qdrant Edge folder is created at: its
  plan takes candidates from the token table beside the shard (tokens.py) and the `mean` vector,
  so rows / cols (~23% of a pooled folder's disk) were never read there.
An older index still opens, adds pages at its own schema and searches with its plan (store.py);
`colembed upgrade` (edge.upgrade_index) rewrites an Edge folder at schema 3 from its stored
vectors (no page is embedded again). `make_point` always makes every vector; a store keeps those
of its schema (`Store.stored_vectors`).

Payload (one dict per page, `PAYLOAD_FIELDS`): path, 1-based page, page count, file sha256, the
rendered size, the image-token grid, model name, variant, manifest hash and schema version (and
what records.py adds: image budget, render policy, source). An index refuses vectors made another
way by comparing `records.ModelIdentity` with what it holds.
Standard library and numpy only: no store client is imported here.
"""

from __future__ import annotations

import uuid
import re
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .pooling import CLUSTERS_FIELD

SCHEMA_VERSION = 3  # the newest: a new Qdrant Edge folder (page + mean, a token table beside)
SERVER_SCHEMA = (
    2  # a new Qdrant server collection and a Parquet target (their plan reads rows/cols)
)
PAGE_VECTOR = "page"
ROWS_VECTOR = "rows"
COLS_VECTOR = "cols"
MEAN_VECTOR = "mean"
MULTI_VECTORS = (PAGE_VECTOR, ROWS_VECTOR, COLS_VECTOR)  # MaxSim; MEAN_VECTOR is a plain vector
SCHEMA_VECTORS = {
    1: MULTI_VECTORS,
    2: (*MULTI_VECTORS, MEAN_VECTOR),
    3: (PAGE_VECTOR, MEAN_VECTOR),
}  # version -> vector names
ALL_VECTORS = SCHEMA_VECTORS[2]  # what make_point makes (every store keeps a subset)
DEFAULT_COLLECTION = "colembed"
STORED_DTYPE = np.float16  # what both stores keep every vector as (edge.py, server.py)

# Point ids: uuid5 in a fixed namespace of "sha256/page/path", so re-running over the same files
# makes the same ids (idempotent upserts) and a changed file makes new ones.
POINT_NAMESPACE = uuid.UUID("5b0c1f3e-8f4a-5d2b-9c61-2f6a7e0d4c11")

PAYLOAD_FIELDS = (
    "path",
    "page",
    "pages",
    "sha256",
    "width",
    "height",
    "grid",
    "image_start",
    "model",
    "variant",
    "manifest_sha256",
    "schema",
)

# Optional payload fields, declared here once (every store writes them as they come):
# - META_FIELD: the user's metadata of the page's file (a JSON object, checked by metadata.py),
#   nested under one key so that Qdrant filters address it as `meta.<key>` and no user key can
#   shadow a field colembed reads.
# - TEXT_FIELD: the page's PDF text layer, zlib-compressed and base64-encoded (`encode_text`),
#   at most MAX_TEXT_BYTES of UTF-8 before compression (TEXT_TRUNCATED_FIELD set when cut).
#   Absent on images, scans and pages indexed before text was kept.
# - LEXICAL_VECTOR: a sparse vector (BM25 term weights of that text, with Qdrant's IDF modifier)
#   for hybrid search (lexical.py); stored by collections that declare it.
META_FIELD = "meta"
TEXT_FIELD = "text_z"
TEXT_TRUNCATED_FIELD = "text_truncated"
LEXICAL_VECTOR = "lexical"
MAX_TEXT_BYTES = 32 << 10  # a dense A4 page holds ~3-6 KB of text: 32 KiB keeps it whole
# Payload fields the catalog and the prune / remove paths never read: left out of a full listing.
BULKY_FIELDS = (TEXT_FIELD,)


def encode_text(text: str) -> tuple[str, bool]:
    """(the stored form of a page's text, whether it was cut to MAX_TEXT_BYTES)."""
    import base64
    import zlib

    raw = text.encode("utf-8")
    cut = len(raw) > MAX_TEXT_BYTES
    if cut:
        raw = raw[:MAX_TEXT_BYTES].decode("utf-8", "ignore").encode("utf-8")
    return base64.b64encode(zlib.compress(raw, 6)).decode("ascii"), cut


def decode_text(stored: str) -> str:
    """The page's text from its stored form (`encode_text`); ValueError if it is damaged. The
    output is bounded by MAX_TEXT_BYTES, whatever the payload claims."""
    import base64
    import binascii
    import zlib

    try:
        data = zlib.decompressobj().decompress(
            base64.b64decode(stored, validate=True), MAX_TEXT_BYTES
        )
        return data.decode("utf-8", "replace")
    except (binascii.Error, zlib.error, TypeError) as e:
        raise ValueError(f"stored page text is damaged ({e})") from e


def _is_int(v: Any, low: int) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) and v >= low


_SHA256 = re.compile(r"[0-9a-f]{64}")
# What each payload field must be: (in words, the check). Every ready point from outside
# (`Index.add_embedded`, `--from-parquet`, a Ray target's rows) is checked against all of it
# before anything is written (`payload_problems(strict=True)`: every field here, nothing else);
# a reader skips a stored point that fails it (`strict=False`: fields it does not know are left
# alone, so a newer colembed's points stay readable).
PAYLOAD_RULES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "path": ("a non-empty str", lambda v: isinstance(v, str) and v != "" and "\x00" not in v),
    "page": ("an int >= 1", lambda v: _is_int(v, 1)),
    "pages": ("an int >= page", lambda v: _is_int(v, 1)),
    "sha256": (
        "64 lower-case hex digits",
        lambda v: isinstance(v, str) and _SHA256.fullmatch(v) is not None,
    ),
    "width": ("an int >= 1", lambda v: _is_int(v, 1)),
    "height": ("an int >= 1", lambda v: _is_int(v, 1)),
    "grid": (
        "[rows, cols], two ints >= 1",
        lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_int(x, 1) for x in v),
    ),
    "image_start": ("an int >= 0", lambda v: _is_int(v, 0)),
    "model": ("a str", lambda v: isinstance(v, str)),
    "variant": ("a str", lambda v: isinstance(v, str)),
    "manifest_sha256": ("a str", lambda v: isinstance(v, str)),
    "schema": (
        f"a schema version ({', '.join(map(str, SCHEMA_VECTORS))})",
        lambda v: _is_int(v, 1) and int(v) in SCHEMA_VECTORS,
    ),
}
# Fields a page may carry beyond PAYLOAD_FIELDS (records.ModelIdentity's, the writer's source,
# a pooled page's clusters); absent on pages written by older colembeds.
OPTIONAL_PAYLOAD_RULES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "max_image_tokens": ("an int >= 1", lambda v: _is_int(v, 1)),
    "render": ("a str", lambda v: isinstance(v, str)),
    "source": ("a str", lambda v: isinstance(v, str)),
    "model_source": ("a str", lambda v: isinstance(v, str)),
    "pool_factor": ("an int >= 1", lambda v: _is_int(v, 1)),
    "dim": ("an int >= 1", lambda v: _is_int(v, 1)),
    CLUSTERS_FIELD: ("a str", lambda v: isinstance(v, str)),
    # the user's metadata (what a value may be: metadata.py, which checks it where it is set)
    META_FIELD: (
        "an object with str keys",
        lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
    ),
    TEXT_FIELD: ("a str (encode_text's form)", lambda v: isinstance(v, str)),
    TEXT_TRUNCATED_FIELD: ("a bool", lambda v: isinstance(v, bool)),
}


def payload_problems(payload: Any, *, strict: bool = True) -> list[str]:
    """What is wrong with a page's payload ("field: must be ..., got ..."), empty if nothing.
    `strict`: a field the schema does not know is a problem too (points from outside)."""
    if not isinstance(payload, dict):
        return [f"the payload must be an object, got {type(payload).__name__}"]
    problems = []
    for name, (words, ok) in PAYLOAD_RULES.items():
        if name not in payload:
            problems.append(f"{name}: missing")
        elif not ok(payload[name]):
            problems.append(f"{name}: must be {words}, got {_shown(payload[name])}")
    for name, (words, ok) in OPTIONAL_PAYLOAD_RULES.items():
        if name in payload and not ok(payload[name]):
            problems.append(f"{name}: must be {words}, got {_shown(payload[name])}")
    if not problems and payload["pages"] < payload["page"]:
        problems.append(
            f"pages: must be an int >= page ({payload['page']}), got {payload['pages']}"
        )
    if strict:
        unknown = sorted(
            str(k) for k in payload if k not in PAYLOAD_RULES and k not in OPTIONAL_PAYLOAD_RULES
        )
        if unknown:
            problems.append(f"unknown field(s) {unknown}")
    return problems


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def point_id(sha256: str, page: int, path: str) -> str:
    """Deterministic id of page `page` (1-based) of the file with this content at this path."""
    return str(uuid.uuid5(POINT_NAMESPACE, f"{sha256}/{page}/{path}"))


@dataclass(frozen=True)
class PagePoint:
    """One page ready for a store: its id, its vectors by name (float32) and payload; `origin`
    says where a point read from outside came from (a Parquet file and row), for messages."""

    id: str
    vectors: dict[str, np.ndarray]
    payload: dict[str, Any]
    origin: str = ""


def pooled_vectors(vectors: np.ndarray, layout) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols): the image-token grid mean-pooled per row and per column, each followed by the
    page's non-image rows. `layout` is the model's `PageLayout`."""
    return _grid_pooled(vectors, layout.image_start, layout.grid_rows, layout.grid_cols)


def pooled_from_payload(page: np.ndarray, payload: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """`pooled_vectors` of an unpooled page known by its `page` vectors and payload (grid,
    image_start): for a point read from an index that does not store them (schema 3). A pooled
    page (its payload's clusters) is refused: its rows / cols were those of the page before."""
    from .pooling import CLUSTERS_FIELD

    if payload.get(CLUSTERS_FIELD):
        raise ValueError(
            f"page {payload.get('page')} of {payload.get('path')} is stored pooled: "
            "its row / column vectors cannot be made from its stored vectors"
        )
    rows, cols = (int(x) for x in payload["grid"])
    return _grid_pooled(np.asarray(page, dtype=np.float32), int(payload["image_start"]), rows, cols)


def _grid_pooled(
    vectors: np.ndarray, start: int, grid_rows: int, grid_cols: int
) -> tuple[np.ndarray, np.ndarray]:
    stop = start + grid_rows * grid_cols
    image = vectors[start:stop].reshape(grid_rows, grid_cols, -1)
    others = np.concatenate([vectors[:start], vectors[stop:]])
    rows = np.concatenate([image.mean(axis=1), others])
    cols = np.concatenate([image.mean(axis=0), others])
    return rows.astype(np.float32), cols.astype(np.float32)


def mean_vector(vectors: np.ndarray, layout) -> np.ndarray:
    """The mean of the page's image-token rows (the prompt rows are alike on every page)."""
    return vectors[layout.image_rows].mean(axis=0).astype(np.float32)


def image_tokens(page: np.ndarray, payload: dict[str, Any]) -> np.ndarray:
    """The stored image-token rows of a page known by its `page` vectors and payload (grid,
    image_start; on a pooled page, its pooled rows: pooling.image_row_count)."""
    from .pooling import image_row_count

    start = payload["image_start"]
    return page[start : start + image_row_count(payload)]


def mean_from_payload(page: np.ndarray, payload: dict[str, Any]) -> np.ndarray:
    """`mean_vector` of a page known by its `page` vectors and payload (grid, image_start): for
    points carried without it (colembed.distributed's Parquet columns)."""
    return image_tokens(page, payload).mean(axis=0).astype(np.float32)


def schema_of(names) -> int | None:
    """The schema version whose vectors are exactly `names` (None: not a colembed index)."""
    return next((v for v, ours in SCHEMA_VECTORS.items() if set(names) == set(ours)), None)


def make_point(vectors: np.ndarray, layout, payload: dict[str, Any]) -> PagePoint:
    """The point of one embedded page; `payload` must hold every field but the grid's. A payload
    whose `pool_factor` (records.ModelIdentity) is above 1 stores the page's image tokens
    hierarchically pooled (pooling.py) as its `page` vectors, with which token went where; the
    rows / cols / mean vectors are always those of the unpooled page."""
    from .pooling import CLUSTERS_FIELD, check_pool_factor, encode_clusters, pool_page

    payload = dict(
        payload, grid=[layout.grid_rows, layout.grid_cols], image_start=layout.image_start
    )
    missing = [f for f in PAYLOAD_FIELDS if f not in payload]
    if missing:
        raise ValueError(f"page payload lacks {missing}")
    rows, cols = pooled_vectors(vectors, layout)
    mean = mean_vector(vectors, layout)
    factor = check_pool_factor(payload.get("pool_factor", 1))
    page = np.asarray(vectors, dtype=np.float32)
    if factor > 1:
        page, clusters = pool_page(page, layout, factor)
        payload[CLUSTERS_FIELD] = encode_clusters(clusters)
    return PagePoint(
        point_id(payload["sha256"], payload["page"], payload["path"]),
        {PAGE_VECTOR: page, ROWS_VECTOR: rows, COLS_VECTOR: cols, MEAN_VECTOR: mean},
        payload,
    )
