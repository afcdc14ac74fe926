"""Pages embedded elsewhere (a GPU box, a Ray job's Parquet target) stored in an index.

`Index.add_embedded(pages)` takes `EmbeddedPage`s (per-page vectors, the image-token grid, where
the page came from) or ready `PagePoint`s (as `colembed.distributed.read_points` returns them)
and stores them with the schema `Index.add` writes: same point ids, payload, pooled vectors and
token table, and the same identity check (a page of another model, variant or export is refused
with the fields that differ). Every page is checked before any is stored, and a bad one is named
(path and page, and for a Parquet row its file and row): the whole payload against the schema
(`schema.payload_problems`: every field's type, page 1..pages), a wrong width, values that are
not finite in the stored precision (float16), rows whose norms are not a ColQwen model's (unit
length, or zero at masked rows, within `NORM_TOLERANCE`), a grid that does not fit the vectors.

`colembed index --from-parquet DIR --db DB` loads what the Ray job's Parquet target wrote; with
no --model the index takes the identity the rows carry (they must all agree). numpy only here;
the Parquet reader needs pyarrow (the ray extra).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ..errors import InputError
from .pooling import CLUSTERS_FIELD, decode_clusters
from .records import ModelIdentity, identity_mismatches
from .schema import PAGE_VECTOR, STORED_DTYPE, PagePoint, make_point, payload_problems, point_id
from .errors import ModelMismatchError
from .store import UPSERT_BATCH, Store

IDENTITY_FIELDS = (*ModelIdentity.CHECKED, "model_source")  # what pages carry of their model


def identity_mismatch(stored: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """`ModelIdentity.mismatches` between two payloads (a field one side predates is not one)."""
    return identity_mismatches(stored, ours, "these pages")


# The pixels one merged image token saw along each side is the model's patch x merge, which its
# manifest declares (`preprocess.resize_factor`): 28 for ColQwen2 / 2.5 (14 x 2), 32 for ColQwen3
# (16 x 2). There is no default: a page's rendered size is taken from its `size`, else its
# `token_px`, else the index's model.


@dataclass(frozen=True)
class EmbeddedPage:
    """One page embedded elsewhere. `vectors`: the model's output rows for the page (tokens, dim),
    prompt rows included; `grid`: (rows, cols) of its image tokens, which start at row
    `image_start`; `path` / 1-based `page` of `pages`: the source; `sha256`: the file's content
    hash (computed from `path` when omitted, so the file must then exist); `size`: the rendered
    (width, height) in pixels (default: the grid at `token_px` pixels a token); `token_px`: the
    pixels one image token saw along each side, the model's patch x merge (its manifest's
    `preprocess.resize_factor`: 28 for ColQwen2 / 2.5, 32 for ColQwen3; default: the index's
    model's)."""

    path: str | os.PathLike
    page: int
    vectors: np.ndarray
    grid: tuple[int, int]
    image_start: int
    pages: int = 1
    sha256: str | None = None
    size: tuple[int, int] | None = None
    token_px: int | None = None


# ColQwen models L2-normalise every output row and zero the rows of padding, so each row of a
# page is unit length or zero. A row further than this from both is not this model family's (a
# page scaled x1000 would top every query). 0.01 leaves room for fp16 / int8 variants and vectors
# that went through a float16 store (both within ~1e-3 of unit length).
NORM_TOLERANCE = 0.01


def _name(path: Any, page: Any, origin: str = "") -> str:
    return f"{origin + ': ' if origin else ''}{_short(path)} page {_short(page)}"


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 200 else text[:197] + "..."


def check_vectors(
    vectors: Any, dim: int, grid: Sequence[int], image_start: int, where: str
) -> np.ndarray:
    """The page's vectors as float32 (tokens, dim), or InputError naming the page."""
    try:
        v = np.asarray(vectors, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise InputError(
            f"{where}: vectors are not a (tokens, {dim}) array of numbers ({e})"
        ) from None
    if v.ndim != 2 or v.shape[1] != dim:
        raise InputError(f"{where}: vectors of shape {v.shape}, the index holds {dim}-d rows")
    if not np.isfinite(v).all():
        raise InputError(f"{where}: vectors hold NaN or infinite values")
    with np.errstate(over="ignore"):
        if not np.isfinite(v.astype(STORED_DTYPE)).all():
            raise InputError(
                f"{where}: vectors hold values beyond {np.dtype(STORED_DTYPE).name}'s "
                f"range (|x| > {float(np.finfo(STORED_DTYPE).max):g}), the precision "
                "the index stores"
            )
    norms = np.linalg.norm(v.astype(np.float64), axis=1)
    off = np.flatnonzero((np.abs(norms - 1.0) > NORM_TOLERANCE) & (norms > NORM_TOLERANCE))
    if off.size:
        raise InputError(
            f"{where}: row {int(off[0])} has norm {norms[off[0]]:.4g} ({off.size} "
            "row(s) off): a ColQwen model's rows are unit length (or zero), within "
            f"{NORM_TOLERANCE}; these vectors were not made by one, or were scaled"
        )
    if not (isinstance(image_start, (int, np.integer)) and len(grid) == 2):
        raise InputError(f"{where}: grid and image_start must be ints")
    rows, cols = (int(x) for x in grid)
    if rows < 1 or cols < 1 or image_start < 0 or image_start + rows * cols > len(v):
        raise InputError(
            f"{where}: a {rows} x {cols} image-token grid from row {image_start} "
            f"does not fit {len(v)} vectors"
        )
    return v


def page_point(
    page: EmbeddedPage, identity: dict[str, Any], dim: int, token_px: int | None = None
) -> PagePoint:
    """The point `Index.add` would store for this page; `token_px`: the index's model's (used
    when the page gives neither its size nor its own)."""
    from ..model import PageLayout

    where = _name(page.path, page.page)
    numbers = {
        "page": page.page,
        "pages": page.pages,
        "image_start": page.image_start,
        "grid": list(page.grid) if isinstance(page.grid, (list, tuple)) else page.grid,
    }
    problems = [p for p in payload_problems(dict(_VALID_PAYLOAD, **numbers), strict=False)]
    if problems:
        raise InputError(f"{where}: " + "; ".join(problems))
    v = check_vectors(page.vectors, dim, page.grid, page.image_start, where)
    path = str(Path(page.path).expanduser().resolve())
    sha = page.sha256
    if sha is None:
        from .sources import file_sha256

        if not Path(path).is_file():
            raise InputError(f"{where}: no sha256 given and the file is not here to hash")
        sha = file_sha256(Path(path))
    rows, cols = (int(x) for x in page.grid)
    px = page.token_px or token_px
    if px is None and page.size is None:
        raise InputError(
            f"{where}: its rendered size is not known: give size=(width, height) or "
            "token_px= (the model's patch x merge: 28 for ColQwen2 / 2.5, 32 for "
            "ColQwen3), or add it to an index opened with its model"
        )
    if px is not None and (isinstance(px, bool) or not isinstance(px, (int, np.integer)) or px < 1):
        raise InputError(f"{where}: token_px must be a positive int, got {px!r}")
    width, height = page.size or (cols * int(px), rows * int(px))
    # the layout's token_px is not stored (make_point reads the grid and where it starts)
    layout = PageLayout(
        grid_rows=rows,
        grid_cols=cols,
        image_start=int(page.image_start),
        num_tokens=len(v),
        token_px=int(px or 1),
    )
    point = make_point(
        v,
        layout,
        dict(
            identity,
            path=path,
            page=int(page.page),
            pages=int(page.pages),
            sha256=sha,
            width=int(width),
            height=int(height),
        ),
    )
    _check_payload(point.payload, where)
    return point


# A payload every rule accepts: page_point checks a page's own numbers against the rules before
# its payload exists (the payload it makes is checked whole at the end).
_VALID_PAYLOAD = {
    "path": "/p",
    "page": 1,
    "pages": 1,
    "sha256": "0" * 64,
    "width": 1,
    "height": 1,
    "grid": [1, 1],
    "image_start": 0,
    "model": "",
    "variant": "",
    "manifest_sha256": "",
    "schema": 1,
}


def _check_payload(payload: Any, where: str) -> None:
    problems = payload_problems(payload, strict=True)
    if problems:
        raise InputError(
            f"{where}: the payload does not fit the index's schema: " + "; ".join(problems)
        )


def checked_point(point: PagePoint, identity: dict[str, Any] | None, dim: int) -> PagePoint:
    """A ready point (a Parquet row) checked as a page would be: id, vectors, grid, identity."""
    p = point.payload
    if not isinstance(p, dict):
        raise InputError(
            f"{_name('?', '?', point.origin)}: the payload must be an object, got "
            f"{type(p).__name__}"
        )
    where = _name(p.get("path"), p.get("page"), point.origin)
    _check_payload(p, where)
    if point.id != point_id(p["sha256"], p["page"], p["path"]):
        raise InputError(
            f"{where}: point id {point.id} is not the one its path, page and sha256 make"
        )
    if p.get(CLUSTERS_FIELD):  # a pooled page: the grid's tokens went into fewer rows
        clusters = decode_clusters(p[CLUSTERS_FIELD])
        rows, cols = (int(x) for x in p["grid"])
        if len(clusters) != rows * cols:
            raise InputError(
                f"{where}: {len(clusters)} pooled token assignments for a {rows} x {cols} grid"
            )
        check_vectors(
            point.vectors.get(PAGE_VECTOR),
            dim,
            (1, int(clusters.max()) + 1),
            p["image_start"],
            where,
        )
    else:
        check_vectors(point.vectors.get(PAGE_VECTOR), dim, p["grid"], p["image_start"], where)
    if identity is not None:
        problems = identity_mismatch(identity, p)
        if problems:
            raise ModelMismatchError(
                f"{where}: embedded by another model or export than the "
                "index's (" + "; ".join(problems) + ")"
            )
    return point


def add_embedded(
    store: Store,
    items: Iterable[EmbeddedPage | PagePoint],
    identity: dict[str, Any] | None,
    source: str,
    token_px: Callable[[], int | None] | int | None = None,
) -> int:
    """Check every item, then store them all (in upsert batches); returns the pages stored.
    `identity`: the model identity the pages must carry (None: the index's stored pages', or, for
    an empty index, that of the first ready point); `source`: the writer's name (records.py) for
    pages that carry none; `token_px`: the model's pixels per image token (or a function giving
    it, asked only when a page gives neither its size nor its own token_px)."""
    stored = store.any_payload()
    if identity is None and stored:
        identity = {f: stored[f] for f in (*IDENTITY_FIELDS, "model_source") if f in stored}
    points: list[PagePoint] = []
    for item in items:
        if isinstance(item, PagePoint):
            if identity is None and isinstance(item.payload, dict):
                identity = {
                    f: item.payload[f]
                    for f in (*IDENTITY_FIELDS, "model_source")
                    if f in item.payload
                }
            point = checked_point(item, identity, store.dim)
            point = PagePoint(
                point.id, point.vectors, {"source": source, **point.payload, "schema": store.schema}
            )
            points.append(point)
        else:
            if identity is None:
                raise InputError(
                    "the index is empty and holds no model identity: give a model "
                    "(Index(..., model=...)) or identity="
                )
            px = None
            if item.size is None and item.token_px is None:
                px = token_px() if callable(token_px) else token_px
            points.append(
                page_point(item, dict(identity, schema=store.schema, source=source), store.dim, px)
            )
    if stored and points:
        problems = identity_mismatch(stored, dict(points[0].payload))
        if problems:
            raise ModelMismatchError(
                f"{store.location}: these pages were embedded by another "
                "model or export (" + "; ".join(problems) + ")"
            )
    if len({p.id for p in points}) != len(points):
        raise InputError("the same page (path, page, sha256) is given twice")
    for lo in range(0, len(points), UPSERT_BATCH * 4):
        store.upsert(points[lo : lo + UPSERT_BATCH * 4])
    store.flush()
    return len(points)


def parquet_points(folder: str | os.PathLike) -> list[PagePoint]:
    """Every page a Ray job's Parquet target wrote (`colembed.distributed.read_points`)."""
    try:
        from ..distributed.targets import read_points
    except ImportError as e:
        raise InputError(
            f"reading Parquet needs pyarrow: pip install 'colembed[ray]' ({e})"
        ) from None
    return list(read_points(str(folder)).values())


def parquet_dim(points: Sequence[PagePoint]) -> int:
    if not points:
        raise InputError("no pages to store")
    return int(points[0].vectors[PAGE_VECTOR].shape[1])


def open_for_embedded(location, dim: int) -> None:
    """Create an empty index folder of `dim`-d vectors when none is there yet, so pages embedded
    elsewhere can be stored without loading a model (`colembed index --from-parquet`)."""
    from .backends import open_store

    if not Path(location).exists() or not any(Path(location).iterdir()):
        open_store(location, dim=dim).close()
