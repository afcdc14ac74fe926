"""The one collection schema every store writes: vector names, payload fields, point ids, pooling.

A page is one point with three multivectors (MaxSim over dot products; ColQwen2 vectors are unit
length, so dot = cosine) and one plain vector:

- `page`: every output row of the page (~750 x 128). The exact score; no HNSW graph (it is only
  ever a full scan or a rerank target).
- `rows` / `cols`: the image-token grid mean-pooled along each row / each column, plus the page's
  non-image rows (prompt tokens) unchanged: Qdrant's ColPali recipe, ~40 vectors instead of ~750,
  for a cheap first stage.
- `mean` (schema 2): the mean of the page's image-token rows, one 128-d vector scored by dot with
  the sum of the query's tokens (= the page's average token similarity summed over query tokens):
  the cheapest stage, the outermost filter of two-stage search (store.py).

Schema 1 (colembed 0.1.0) had no `mean`: such an index still opens, adds pages without it and
searches with the schema-1 plan (`SCHEMA_VECTORS`, store.py); `store.upgrade_index` rewrites an
Edge folder at schema 2 from its stored vectors.

Payload (one dict per page, `PAYLOAD_FIELDS`): path, 1-based page, page count, file sha256, the
rendered size, the image-token grid, model name, variant, manifest hash and schema version (and
what records.py adds: image budget, render policy, source). An index refuses vectors made another
way by comparing `records.ModelIdentity` with what it holds.
Standard library and numpy only: no store client is imported here.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

SCHEMA_VERSION = 2
PAGE_VECTOR = "page"
ROWS_VECTOR = "rows"
COLS_VECTOR = "cols"
MEAN_VECTOR = "mean"
MULTI_VECTORS = (PAGE_VECTOR, ROWS_VECTOR, COLS_VECTOR)  # MaxSim; MEAN_VECTOR is a plain vector
SCHEMA_VECTORS = {1: MULTI_VECTORS, 2: (*MULTI_VECTORS, MEAN_VECTOR)}  # version -> vector names
VECTOR_NAMES = SCHEMA_VECTORS[SCHEMA_VERSION]
DEFAULT_COLLECTION = "colembed"

# Point ids: uuid5 in a fixed namespace of "sha256/page/path", so re-running over the same files
# makes the same ids (idempotent upserts) and a changed file makes new ones.
POINT_NAMESPACE = uuid.UUID("5b0c1f3e-8f4a-5d2b-9c61-2f6a7e0d4c11")

PAYLOAD_FIELDS = ("path", "page", "pages", "sha256", "width", "height", "grid", "image_start",
                  "model", "variant", "manifest_sha256", "schema")


def point_id(sha256: str, page: int, path: str) -> str:
    """Deterministic id of page `page` (1-based) of the file with this content at this path."""
    return str(uuid.uuid5(POINT_NAMESPACE, f"{sha256}/{page}/{path}"))


@dataclass(frozen=True)
class PagePoint:
    """One page ready for a store: its id, its vectors by name (float32) and payload."""

    id: str
    vectors: dict[str, np.ndarray]
    payload: dict[str, Any]


def pooled_vectors(vectors: np.ndarray, layout) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols): the image-token grid mean-pooled per row and per column, each followed by the
    page's non-image rows. `layout` is the model's `PageLayout`."""
    image = vectors[layout.image_rows].reshape(layout.grid_rows, layout.grid_cols, -1)
    others = np.concatenate([vectors[:layout.image_start], vectors[layout.image_rows.stop:]])
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
    return page[start:start + image_row_count(payload)]


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

    payload = dict(payload, grid=[layout.grid_rows, layout.grid_cols],
                   image_start=layout.image_start)
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
    return PagePoint(point_id(payload["sha256"], payload["page"], payload["path"]),
                     {PAGE_VECTOR: page, ROWS_VECTOR: rows, COLS_VECTOR: cols,
                      MEAN_VECTOR: mean}, payload)
