"""Where a distributed job writes: a Qdrant collection (the single-machine schema) or Parquet.

Both answer the driver's question "which point ids are already there?" before anything is
embedded, and both make a retried write harmless:

- `QdrantTarget`: the index's own stores (`colembed.index.backends.open_store`: a Qdrant server by
  url, a Qdrant Edge folder, or qdrant-client's local mode), so the collection, vectors, payload
  and point ids are exactly those of `colembed.Index`. Upserts are by deterministic id: a page
  written twice is the same point. A server is written by `writers` actors in parallel; an Edge
  shard or a local-mode folder is an embedded store with one writer, the driver.
- `ParquetTarget`: one Parquet file per written batch, named by the hash of its point ids and moved
  into place only when complete (a retried batch rewrites the same name with the same rows);
  pages already in the folder are skipped; `read_points` keeps one row per id whatever happens.
  Columns: path, page, pages, sha256, id, the `page`/`rows`/`cols` multivectors as
  list<fixed_size_list<float32, dim>>, and the payload as JSON.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..errors import InputError
from ..index.backends import open_store
from ..index.errors import StoreError
from ..index.schema import SERVER_SCHEMA, PagePoint
from .stages import VECTOR_COLUMNS, page_points, summary_rows

PART_PREFIX = "part-"
PART_SUFFIX = ".parquet"
PART_NAME_HEX = 32  # hex digits of the ids' sha256 in a part file's name


class QdrantTarget:
    """A collection with `colembed.Index`'s schema: `location` (an Edge folder, or a local-mode
    folder with `local=True`) or `url` (+ `api_key`) of a Qdrant server."""

    def __init__(
        self,
        location: str | None = None,
        *,
        url: str | None = None,
        api_key: str | None = None,
        collection: str | None = None,
        local: bool = False,
    ) -> None:
        self.options = dict(
            location=location, url=url, api_key=api_key, collection=collection, local=local
        )
        self.location = f"{url or location} (collection {collection or 'default'})"
        self.store = None

    @property
    def parallel(self) -> bool:
        """Whether workers may write (a server), or only the driver (an embedded store)."""
        return self.options["url"] is not None

    def open(self, dim: int) -> list[tuple[str, dict[str, Any]]]:
        """Open (creating the collection if new) on the driver; (id, payload) of stored points."""
        self.store = open_store(
            self.options["location"],
            url=self.options["url"],
            api_key=self.options["api_key"],
            dim=dim,
            collection=self.options["collection"],
            local=self.options["local"],
        )
        return self.store.payloads()

    @property
    def schema(self) -> int:
        """The schema of the open collection (an older index keeps its own)."""
        return self.store.schema

    def write(self, batch: dict[str, Any]) -> None:
        """Upsert a batch's points through the driver's store (embedded stores: Edge flushes on
        its own cadence, edge.py)."""
        self.store.upsert(page_points(batch, self.store.dim))

    def flush(self) -> None:
        self.store.flush()

    def writer_args(self) -> dict[str, Any]:
        return dict(self.options, dim=self.store.dim)

    def delete(self, ids: list[str]) -> None:
        self.store.delete(ids)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None


class StoreWriter:
    """A worker's connection to a Qdrant server: upserts each batch, returns its summary."""

    def __init__(self, *, dim: int, **options: Any) -> None:
        self.dim = dim
        self.store = open_store(options.pop("location"), dim=dim, **options)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        self.store.upsert(page_points(batch, self.dim))
        return summary_rows(batch)


class ParquetTarget:
    """A folder of Parquet part files (local, or on `filesystem`, any pyarrow FileSystem)."""

    parallel = True
    schema = SERVER_SCHEMA  # its rows carry every vector (rows / cols too)

    def __init__(self, folder: str, *, filesystem: pafs.FileSystem | None = None) -> None:
        if filesystem is None:
            filesystem, folder = (
                pafs.FileSystem.from_uri(str(folder))
                if "://" in str(folder)
                else (pafs.LocalFileSystem(), str(folder))
            )
        self.folder, self.filesystem, self.dim = str(folder), filesystem, None
        self.location = f"{self.folder} (Parquet)"

    def open(self, dim: int) -> list[tuple[str, dict[str, Any]]]:
        """Create the folder if new; (id, payload) of the rows already written."""
        self.filesystem.create_dir(self.folder, recursive=True)
        self.dim = dim
        parts = self.parts()
        if not parts:
            return []
        table = pads.dataset(parts, format="parquet", filesystem=self.filesystem).to_table(
            columns=["id", "payload"]
        )
        return [
            (i, json.loads(p))
            for i, p in dict(zip(table["id"].to_pylist(), table["payload"].to_pylist())).items()
        ]

    def parts(self) -> list[str]:
        """The finished part files (temporary ones start with a dot and are not listed)."""
        try:
            infos = self.filesystem.get_file_info(pafs.FileSelector(self.folder))
        except FileNotFoundError:
            return []
        return sorted(
            i.path
            for i in infos
            if i.is_file
            and i.base_name.startswith(PART_PREFIX)
            and i.base_name.endswith(PART_SUFFIX)
        )

    def writer_args(self) -> dict[str, Any]:
        return dict(folder=self.folder, filesystem=self.filesystem, dim=self.dim)

    def delete(self, ids: list[str]) -> None:
        """Parquet parts are immutable: an older version of a changed file stays (its rows carry
        the old sha256)."""

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def part_schema(dim: int) -> pa.Schema:
    multivector = pa.list_(pa.list_(pa.float32(), dim))
    return pa.schema(
        [
            ("path", pa.string()),
            ("page", pa.int32()),
            ("pages", pa.int32()),
            ("sha256", pa.string()),
            ("id", pa.string()),
            *[(col, multivector) for col in VECTOR_COLUMNS.values()],
            ("payload", pa.string()),
        ]
    )


def write_part(
    batch: dict[str, Any], *, folder: str, filesystem: pafs.FileSystem, dim: int
) -> dict[str, list]:
    """Write a batch's points as one part file, atomically (a hidden temporary name, then a move);
    the name is the hash of the sorted ids, so a retried batch replaces its own file."""
    points = page_points(batch, dim)
    if points:
        ids = sorted(p.id for p in points)
        name = PART_PREFIX + hashlib.sha256("\n".join(ids).encode()).hexdigest()[:PART_NAME_HEX]
        final = f"{folder}/{name}{PART_SUFFIX}"
        temporary = f"{folder}/.{name}.{uuid.uuid4().hex}.tmp"  # dot: invisible to readers
        pq.write_table(_table(points, dim), temporary, filesystem=filesystem)
        filesystem.move(temporary, final)
    return summary_rows(batch)


def _table(points: list[PagePoint], dim: int) -> pa.Table:
    columns: dict[str, Any] = {
        "path": [p.payload["path"] for p in points],
        "page": [p.payload["page"] for p in points],
        "pages": [p.payload["pages"] for p in points],
        "sha256": [p.payload["sha256"] for p in points],
        "id": [p.id for p in points],
    }
    for name, col in VECTOR_COLUMNS.items():
        columns[col] = _multivectors([p.vectors[name] for p in points], dim)
    columns["payload"] = [json.dumps(p.payload, sort_keys=True) for p in points]
    return pa.table(columns, schema=part_schema(dim))


def _multivectors(arrays: list[np.ndarray], dim: int) -> pa.Array:
    flat = pa.array(np.concatenate([a.reshape(-1) for a in arrays]), type=pa.float32())
    rows = pa.FixedSizeListArray.from_arrays(flat, dim)
    offsets = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), rows)


def read_points(folder: str, *, filesystem: pafs.FileSystem | None = None) -> dict[str, PagePoint]:
    """Every page of a Parquet target, one per point id (float32 vectors, payload dict, `origin`
    naming its file and row). Rows of an older version of a changed file remain in the folder:
    compare `payload["sha256"]`. A part that is not what `write_part` writes (a column missing
    or of another type, a row's vectors of mixed widths, a payload that is not JSON) raises
    InputError naming the file, row and column; what a payload holds is checked by
    `Index.add_embedded` (index/embedded.py)."""
    target = ParquetTarget(folder, filesystem=filesystem)
    parts = target.parts()
    if not parts:
        raise StoreError(f"{folder}: no Parquet pages here")
    points: dict[str, PagePoint] = {}
    for part in parts:
        for point in _part_points(part, target.filesystem):
            points.setdefault(point.id, point)
    return points


REQUIRED_COLUMNS = ("id", "payload", *VECTOR_COLUMNS.values())


def _part_points(part: str, filesystem: pafs.FileSystem) -> list[PagePoint]:
    try:
        table = pq.read_table(part, filesystem=filesystem)
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{part}: not a readable Parquet file ({e})") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise InputError(
            f"{part}: no column {', '.join(missing)} (a part of a colembed Parquet "
            f"target has {', '.join(REQUIRED_COLUMNS)})"
        )
    columns = {
        col: _ragged(table[col].combine_chunks(), part, col) for col in VECTOR_COLUMNS.values()
    }
    points = []
    for i, (pid, payload) in enumerate(zip(table["id"].to_pylist(), table["payload"].to_pylist())):
        where = f"{part} row {i}"
        if not isinstance(pid, str):
            raise InputError(f"{where}, column id: not a string ({type(pid).__name__})")
        try:
            data = json.loads(payload)
        except (TypeError, ValueError) as e:
            raise InputError(f"{where}, column payload: not JSON ({e})") from None
        vectors = {name: columns[col][i] for name, col in VECTOR_COLUMNS.items()}
        points.append(PagePoint(pid, vectors, data, origin=where))
    return points


def _ragged(column: pa.Array, part: str, name: str) -> list[np.ndarray]:
    """A column of per-row lists of equal-width float vectors (what `write_part` writes:
    list<fixed_size_list<float32, dim>>; variable-size inner lists are taken when every vector
    of a row has the same width) as one (vectors, width) float32 array per row."""
    kind = column.type
    if (
        not (pa.types.is_list(kind) or pa.types.is_large_list(kind))
        or not (
            pa.types.is_fixed_size_list(kind.value_type)
            or pa.types.is_list(kind.value_type)
            or pa.types.is_large_list(kind.value_type)
        )
        or not (
            pa.types.is_floating(kind.value_type.value_type)
            or pa.types.is_integer(kind.value_type.value_type)
        )
    ):
        raise InputError(f"{part}, column {name}: expected lists of float vectors, got {kind}")
    if column.null_count:
        row = int(np.flatnonzero(np.asarray(column.is_null()))[0])
        raise InputError(f"{part} row {row}, column {name}: no vectors (null)")
    offsets = column.offsets.to_numpy()
    rows = column.values  # every vector of every row
    if rows.null_count:
        row = int(
            np.searchsorted(offsets, np.flatnonzero(np.asarray(rows.is_null()))[0], side="right")
            - 1
        )
        raise InputError(f"{part} row {row}, column {name}: a null vector")
    if pa.types.is_fixed_size_list(rows.type):
        width = rows.type.list_size
    else:
        lengths = np.asarray(rows.value_lengths())
        widths = np.unique(lengths)
        if widths.size > 1:
            first = int(np.flatnonzero(lengths != lengths[0])[0])
            row = int(np.searchsorted(offsets, first, side="right") - 1)
            raise InputError(
                f"{part} row {row}, column {name}: vectors of different widths "
                f"({lengths[0]} and {lengths[first]})"
            )
        width = int(widths[0]) if widths.size else 0
    values = rows.flatten() if not pa.types.is_fixed_size_list(rows.type) else rows.values
    if values.null_count:
        raise InputError(f"{part}, column {name}: null numbers inside vectors")
    flat = values.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    flat = flat.reshape(len(rows), width) if width else flat.reshape(len(rows), 0)
    return [flat[offsets[i] : offsets[i + 1]] for i in range(len(column))]
