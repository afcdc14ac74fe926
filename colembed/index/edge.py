"""Qdrant Edge (`qdrant-edge-py`, pinned in pyproject): the embedded store, one shard in a folder.

Everything Edge-specific lives here. Folder layout: `<db>/colembed_index.json` (schema version,
vector size), `<db>/shard/` (Edge's segments and write-ahead log, so an update that returned
survives a killed process), `<db>/colembed_index.lock` (one process at a time, readers included,
as Edge requires: lock.py) and `<db>/tokens/` (the token stage's centroid table, tokens.py,
written after each shard write and checked against the shard's page ids on open).

Vectors are float16 (half the disk; scores move far below the gaps that order pages:
docs/index.md), with no HNSW graph (full-scan MaxSim is exact and Edge's brute force is fast).
A new folder is schema 3 (schema.py): the `page` multivector and the `mean` vector only. Every
multivector is memory-mapped (`on_disk`) and only `mean` is held in RAM, because Edge reads an
in-RAM vector whole at every open while a search touches a few hundred pages
(benchmarks/results/experiments/search-reopen.md). Older folders keep the storage they were
created with and search as they did, saying when they lack a current token table;
`colembed upgrade` rewrites them at schema 3.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
import time
import uuid
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import qdrant_edge as qe

from ..safe_fs import (
    REPLACED_PURPOSE,
    STAGING_MARKER,
    commit_folder,
    discard_staging,
    is_staging_folder,
    remove_tree,
    staging_folder,
)
from .errors import DiskFullError, IndexBusyError, IndexNotFoundError, StoreError
from .lock import LOCK_FILE, FolderLock
from .errors import OldIndexWarning
from .plan import HYBRID_CANDIDATES, RRF_K, TOKENS_STAGE, Stage, stage_query
from .schema import (
    BULKY_FIELDS,
    COLS_VECTOR,
    LEXICAL_VECTOR,
    MEAN_VECTOR,
    PAGE_VECTOR,
    ROWS_VECTOR,
    SCHEMA_VECTORS,
    SCHEMA_VERSION,
    PagePoint,
    image_tokens,
)
from .store import INDEXED_FIELDS, SCROLL_PAGE, UPSERT_BATCH, Store, as_point
from .where import QdrantTerms, Where, to_qdrant
from .tokens import CENTROIDS, COMPACTING, SET_ASIDE, TokenTable, page_centroids

META_FILE = "colembed_index.json"
SHARD_DIR = "shard"
TOKENS_DIR = "tokens"
VERIFIED_FILE = "verified.json"  # in TOKENS_DIR: the last clean close found the table current
CREATING_MARKER = ".colembed-creating"  # present from a new folder's first write to its meta file
# An upgrade of a folder that cannot be renamed (a mount point) builds the new shard in
# IN_PLACE_NEW inside it, moves the old entries to IN_PLACE_OLD, then the new ones in (the meta
# file out first and in last, so "no meta file" means a swap under way); both carry the staging
# marker with UPGRADE_PURPOSE.
IN_PLACE_NEW = ".colembed-upgrade-new"
IN_PLACE_OLD = ".colembed-upgrade-old"
UPGRADE_PURPOSE = "colembed index upgrade"
SET_ASIDE_DONE = ".colembed-set-aside"  # in IN_PLACE_OLD once every old entry is in it
# A folder that rename() cannot move: a mount point (EBUSY on Linux), or across devices (EXDEV).
_CANNOT_RENAME = frozenset({errno.EBUSY, errno.EXDEV})
_NO_GRAPH = dict(m=0, ef_construct=100, full_scan_threshold=1 << 30)

# Flush cadence. Edge appends every upsert to its write-ahead log (~2.5x the page's stored bytes:
# the request's float32 vectors) and truncates the log only on flush, so a run that never flushes
# needs ~3.5x the index's size in free disk and a kill leaves all of it to replay on the next
# open. A flush is due after FLUSH_FRACTION of the pages stored (the log then holds at most ~20% of
# the stored bytes: disk stays within ~1.2x what is stored), at least FLUSH_MIN_PAGES (a flush
# costs ~ a fixed part plus the segments written) and at most FLUSH_MAX_PAGES (bounds the log a
# killed run replays), or FLUSH_SECONDS after the last one with anything unflushed (a slow run's
# replay stays small too). Measured: benchmarks/experiments/index_disk.py, benchmarks/results/experiments/index_disk.md.
FLUSH_FRACTION = 0.08
FLUSH_MIN_PAGES = 64
FLUSH_MAX_PAGES = 1000
FLUSH_SECONDS = 60.0
# ... or once the batches since the last flush carried FLUSH_MAX_LOG_BYTES of float32 vectors
# (the log holds ~1.15x that). Why bytes as well as pages: a killed run's next open replays the
# log at about the speed Edge stores pages, so the page bounds alone could leave ~1,000 pages
# to replay; the rule is that a killed run's next open takes at most ~5 s more than a clean one,
# and 32 MiB of vectors is about that (benchmarks/results/index/index-long-6k.md).
FLUSH_MAX_LOG_BYTES = 32 << 20
# Free disk kept in hand before a write, so that a run meeting a full disk stops with DiskFullError
# while the index can still be opened: Edge's log and segments grow by ~1.7x the float32 bytes a
# batch carries until the next flush (log ~1.2x, float16 segments 0.5x), and opening a shard
# allocates its in-RAM vector storages' chunk files in full (32 MiB each: rows and cols vectors and
# offsets, mean; measured on a tmpfs, where a shard written sparse took 164 MB more on its next
# open, and an open without that space died of SIGBUS). Twice the batch's bytes plus the margin
# must be free.
EDGE_CHUNK_BYTES = 32 << 20
IN_RAM_CHUNK_FILES = 5
DISK_MARGIN_BYTES = IN_RAM_CHUNK_FILES * EDGE_CHUNK_BYTES + (16 << 20)


@contextlib.contextmanager
def _edge_errors(action: str, where: Path) -> Iterator[None]:
    """Qdrant Edge raises its own exception types: report them as StoreError naming the folder
    (DiskFullError when the disk is full)."""
    try:
        yield
    except StoreError:
        raise
    except Exception as e:  # noqa: BLE001 (the binding's types are not part of its API)
        if _is_disk_full(e):
            raise DiskFullError(where, _free(where), DISK_MARGIN_BYTES, e) from e
        raise StoreError(f"{where}: Qdrant Edge failed to {action}: {e}") from e


def _is_disk_full(error: BaseException) -> bool:
    return (
        getattr(error, "errno", None) == errno.ENOSPC
        or "No space left" in str(error)
        or "os error 28" in str(error)
    )


def _free(folder: Path) -> int:
    for path in (folder, *folder.parents):
        try:
            return shutil.disk_usage(path).free
        except OSError:
            continue
    return 0


def _write_meta(folder: Path, meta: dict[str, Any]) -> None:
    """The meta file, replaced atomically (a kill leaves the old one or the new one)."""
    tmp = folder / f".{META_FILE}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(meta) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / META_FILE)


def _read_meta(folder: Path) -> dict[str, Any]:
    path = folder / META_FILE
    try:
        meta = json.loads(path.read_text())
        if not isinstance(meta, dict) or "dim" not in meta:
            raise ValueError("not a JSON object with a `dim`")
        int(meta["dim"])
    except PermissionError as e:
        raise StoreError(f"{path}: cannot read the index's meta file ({e.strerror})") from e
    except (ValueError, TypeError, OSError) as e:
        raise StoreError(
            f"{path}: the index's meta file is damaged ({e}); it records the schema "
            "and vector size of the shard beside it: restore it from a backup, or "
            "index into a new folder"
        ) from e
    return meta


def _release(shard, lock) -> None:
    """A garbage-collected EdgeStore's shard and folder lock, closed (weakref.finalize)."""
    try:
        if shard is not None:
            shard.flush()
            shard.close()
    except Exception:  # noqa: BLE001 (finaliser: nothing to report to)
        pass
    finally:
        if lock is not None:
            lock.release()


# The lexical (BM25) sparse vector of hybrid search (lexical.py): Qdrant's IDF modifier weighs
# each term by its document frequency over the shard at query time.
def _LEXICAL_PARAMS() -> qe.EdgeSparseVectorParams:
    return qe.EdgeSparseVectorParams(modifier=qe.Modifier.Idf)


# The vectors a new shard keeps memory-mapped (the rest, `mean`, in RAM): see the module docstring.
MAPPED_VECTORS = (PAGE_VECTOR, ROWS_VECTOR, COLS_VECTOR)


def _vector_params(dim: int, name: str) -> qe.EdgeVectorParams:
    multi = None if name == MEAN_VECTOR else qe.MultiVectorConfig(qe.MultiVectorComparator.MaxSim)
    return qe.EdgeVectorParams(
        size=dim,
        distance=qe.Distance.Dot,
        multivector_config=multi,
        datatype=qe.VectorStorageDatatype.Float16,
        hnsw_config=qe.HnswIndexConfig(**_NO_GRAPH),
        on_disk=name in MAPPED_VECTORS,
    )


def _prefetch(
    query: np.ndarray, stage: Stage, token_ids: Sequence[str], where: qe.Filter | None = None
) -> qe.Prefetch:
    """A plan stage as Edge's prefetch; `token_ids`: the centroid scan's pages for this query
    (`TOKENS_STAGE`, computed for every query of a batch in one scan), passed in by id; they are
    among the pages the search's filter allows, so that stage needs no other condition. `where`:
    the search's filter, applied in every other stage."""
    if stage.using == TOKENS_STAGE:
        ids = {uuid.UUID(i) for i in token_ids}
        return qe.Prefetch(
            limit=stage.limit,
            filter=qe.Filter(must=[qe.HasIdCondition(ids)]),
            query=qe.Query.Nearest(stage_query(query, MEAN_VECTOR), using=MEAN_VECTOR),
        )
    inner = [_prefetch(query, stage.within, token_ids, where)] if stage.within else None
    return qe.Prefetch(
        limit=stage.limit,
        prefetches=inner,
        filter=where,
        query=qe.Query.Nearest(stage_query(query, stage.using), using=stage.using),
    )


_EDGE_TERMS = QdrantTerms(
    equal=lambda key, value: qe.FieldCondition(key, match=qe.MatchValue(value)),
    one_of=lambda key, values: qe.FieldCondition(key, match=qe.MatchAny(values)),
    within=lambda key, bounds: qe.FieldCondition(key, range=qe.RangeFloat(**bounds)),
    prefix=lambda key, text: qe.FieldCondition(key, match=qe.MatchPrefix(text)),
    combine=qe.Filter,
)


def edge_filter(where: Where | None) -> qe.Filter | None:
    """A checked filter (where.py) as Qdrant Edge's `Filter` (globs resolved by the store)."""
    return to_qdrant(where, _EDGE_TERMS)


class EdgeStore(Store):
    """An index folder holding one Qdrant Edge shard."""

    upgrade_hint = (
        "`colembed upgrade --db FOLDER` (or colembed.index.upgrade_index) rewrites it "
        "from its stored vectors, without embedding a page again"
    )
    lexical_hint = (
        "`colembed upgrade --db FOLDER` adds it from the pages' stored text "
        "(nothing is embedded again)"
    )

    def __init__(self, folder: Path, *, dim: int | None = None) -> None:
        self.folder = Path(folder)
        self.location = str(self.folder)
        self.shard = self.lock = None
        self._finalizer = None
        _recover_interrupted_swap(self.folder)
        if (self.folder / META_FILE).is_file() or _is_upgrade_folder(self.folder / IN_PLACE_OLD):
            self.lock = FolderLock(self.folder)  # no upgrade can be running: this holds the lock
            _finish_interrupted_upgrade(self.folder)
            self.lock.release()
            self.lock = None
        if (self.folder / META_FILE).is_file():
            meta = _read_meta(self.folder)
            if meta.get("schema") not in SCHEMA_VECTORS:
                raise StoreError(
                    f"{self.folder}: index schema {meta.get('schema')} is not one "
                    f"this colembed reads ({', '.join(map(str, SCHEMA_VECTORS))})"
                )
            self.dim, self.schema = int(meta["dim"]), int(meta["schema"])
            self.has_lexical = bool(meta.get("lexical"))
            self._locked(lambda: qe.EdgeShard.load(str(self.folder / SHARD_DIR)), "open the shard")
            if (self.folder / CREATING_MARKER).exists():  # killed after the meta file: complete
                (self.folder / CREATING_MARKER).unlink(missing_ok=True)
        else:
            self._create(dim)
        self._cadence_start()
        self._open_tokens()
        self._generation = 0  # counts writes: what a cached filter's page list was made at
        self._allowed: dict[str, tuple[int, frozenset[str], qe.Filter]] = {}
        self._index_payload()

    def _open_tokens(self) -> None:
        """The centroid table, current when its live rows are exactly the shard's pages (by id:
        a count alone would take a kill between a delete and its replacement's write for a
        current table); compacted first when it is mostly dead rows (tokens.MAX_DEAD_FRACTION).
        The id comparison lists every page of the shard (~1.5 s at 50,000 pages), so a clean
        close that found the table current leaves a mark (`VERIFIED_FILE`) and the next open
        trusts it instead when nothing has been written since (see `_mark_verified`)."""
        self.tokens = TokenTable(self.folder / TOKENS_DIR, self.dim, CENTROIDS)
        self._verified_dropped = False
        with _edge_errors("read the token table", self.folder):
            self.tokens.compact_if_due()
            self._tokens_current = self._marked_verified() or self._table_matches()
        if not self._tokens_current:
            self._drop_verified()

    def _table_sizes(self) -> dict[str, int]:
        return {
            name: (self.folder / TOKENS_DIR / name).stat().st_size
            if (self.folder / TOKENS_DIR / name).is_file()
            else 0
            for name in self.tokens.files()
        }

    def _marked_verified(self) -> bool:
        """The mark of the last clean close, and it still describes the folder: the table files
        of the sizes it wrote and the shard's page count. A write removes the mark before it
        touches the shard or the table (`_drop_verified`), so a run killed after any write
        leaves no mark and its next open compares ids."""
        try:
            mark = json.loads((self.folder / TOKENS_DIR / VERIFIED_FILE).read_text())
        except (OSError, ValueError):
            return False
        return mark == {"pages": self.count(), **self._table_sizes()}

    def _drop_verified(self) -> None:
        """Before the first write of this open: the mark goes (then the shard and the table may
        change; only a clean close that still finds them matching writes it again)."""
        if not self._verified_dropped:
            (self.folder / TOKENS_DIR / VERIFIED_FILE).unlink(missing_ok=True)
            self._verified_dropped = True

    def _mark_verified(self) -> None:
        """At a clean close (the shard flushed): the table is current (checked at the open and
        kept so by every write since), so the next open can trust it without listing ids."""
        path = self.folder / TOKENS_DIR / VERIFIED_FILE
        mark = {"pages": self.count(), **self._table_sizes()}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(mark))
        os.replace(tmp, path)

    def _table_matches(self) -> bool:
        table = self.tokens.ids()
        return len(table) == self.count() and set(table) == set(self.ids())

    def ids(self, where: qe.Filter | None = None) -> list[str]:
        """Every stored page's id (no payload, no vectors); with `where`, those it allows."""
        out: list[str] = []
        offset = None
        while True:
            with _edge_errors("list pages", self.folder):
                records, offset = self.shard.scroll(
                    qe.ScrollRequest(
                        offset=offset,
                        limit=4096,
                        filter=where,
                        with_payload=False,
                        with_vector=False,
                    )
                )
            out.extend(str(r.id) for r in records)
            if offset is None:
                return out

    def _index_payload(self) -> None:
        """Payload indexes on the fields every filter and listing reads (`INDEXED_FIELDS`),
        created when missing (a folder written before them gets them at its next open)."""
        with _edge_errors("read the shard's payload indexes", self.folder):
            have = set(self.shard.info().payload_schema)
        kinds = {"keyword": qe.PayloadSchemaType.Keyword, "integer": qe.PayloadSchemaType.Integer}
        for name, kind in INDEXED_FIELDS.items():
            if name not in have:
                with _edge_errors(f"index the payload field {name!r}", self.folder):
                    self.shard.update(qe.UpdateOperation.create_field_index(name, kinds[kind]))

    def allowed_ids(self, where: Where) -> frozenset[str]:
        """The pages `where` allows, listed by Qdrant (one home for the filter's meaning); kept
        until the next write, so a filter used again (a tenant's, a folder's) is listed once."""
        return self._allowed_pages(where)[0]

    def _allowed_pages(self, where: Where) -> tuple[frozenset[str], qe.Filter]:
        """`allowed_ids` and the same pages as a filter by id. A search filters by id once they
        are listed: Qdrant then checks a point's id, not its payload (which it reads from disk
        for a field it has no index of, such as a metadata key)."""
        key = where.cache_key()
        cached = self._allowed.get(key)
        if cached is not None and cached[0] == self._generation:
            return cached[1], cached[2]
        ids = frozenset(self.ids(edge_filter(where)))
        by_id = qe.Filter(must=[qe.HasIdCondition({uuid.UUID(i) for i in ids})])
        if len(self._allowed) >= 32:
            self._allowed.pop(next(iter(self._allowed)))
        self._allowed[key] = (self._generation, ids, by_id)
        return ids, by_id

    def file_paths(self) -> list[str]:
        """The distinct stored paths (a `path` glob is matched against them)."""
        return self._cached_paths(self._stored_paths)

    def _stored_paths(self) -> set[str]:
        """Every point's `path`, read alone (Qdrant Edge reads a payload field by itself)."""
        only_path = qe.PayloadSelector.Include(["path"])
        return {
            p["path"]
            for records in self.payload_pages(SCROLL_PAGE, "list pages", selector=only_path)
            for _, p in records
            if isinstance(p.get("path"), str)
        }

    def has_tokens(self) -> bool:
        """Whether this folder holds a current token table; says once when it does not."""
        if (
            not self._tokens_current
            and self.schema >= 2
            and not getattr(self, "_told_tokens", False)
        ):
            self._told_tokens = True
            why, fallback = (
                (
                    "an interrupted write, or its files removed",
                    "two-stage search "
                    "uses the table it has, so a page missing from it is found by its "
                    "mean vector only",
                )
                if self.schema >= 3
                else (
                    "written by an older colembed, or interrupted",
                    "two-stage search "
                    "uses the mean-gated plan, which can miss a page whose answer is a "
                    "small part of it",
                )
            )
            warnings.warn(
                f"{self.location}: this index has no current token table ({why}), so "
                f"{fallback}; {self.upgrade_hint}.",
                OldIndexWarning,
                stacklevel=4,
            )
        return self._tokens_current

    def searches_with_tokens(self) -> bool:
        """A current table, or a schema-3 folder whatever its table (it stores no rows / cols
        for the mean-gated plan: the table it has and the `mean` vector find the pages)."""
        return self.has_tokens() or self.schema >= 3

    def _create(self, dim: int | None) -> None:
        """A new index: the marker first, then the shard, then the meta file (atomically), then
        the marker goes. A kill anywhere leaves either an index or a folder this recognises as
        its own unfinished creation (the marker), which is cleared and started again."""
        interrupted = (self.folder / CREATING_MARKER).is_file()
        ours = {LOCK_FILE, STAGING_MARKER, CREATING_MARKER, SHARD_DIR, f".{META_FILE}.tmp"}
        if self.folder.exists() and (
            not self.folder.is_dir()
            or any(
                f.name not in (ours if interrupted else {LOCK_FILE, STAGING_MARKER})
                for f in self.folder.iterdir()
            )
        ):
            raise StoreError(
                f"{self.folder}: exists and is not a colembed index; give a new or empty folder"
            )
        if dim is None:
            raise IndexNotFoundError(
                f"{self.folder}: no index here"
                + (
                    " (an interrupted creation was left: index into it to start it again)"
                    if interrupted
                    else ""
                )
            )
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(
                f"{self.folder}: cannot create the index folder ({e.strerror or e})"
            ) from e
        self.lock = FolderLock(self.folder)
        try:
            if interrupted:
                shutil.rmtree(self.folder / SHARD_DIR, ignore_errors=True)
            (self.folder / CREATING_MARKER).write_text(f"{os.getpid()}\n")
            config = qe.EdgeConfig(
                vectors={
                    name: _vector_params(dim, name) for name in SCHEMA_VECTORS[SCHEMA_VERSION]
                },
                sparse_vectors={LEXICAL_VECTOR: _LEXICAL_PARAMS()},
            )
            with _edge_errors("create the shard", self.folder):
                self.shard = qe.EdgeShard.create(str(self.folder / SHARD_DIR), config)
            _write_meta(
                self.folder,
                {"schema": SCHEMA_VERSION, "dim": dim, "store": "qdrant-edge", "lexical": True},
            )
            self.has_lexical = True
            (self.folder / CREATING_MARKER).unlink()
        except OSError as e:
            self._abandon()
            if _is_disk_full(e):
                raise DiskFullError(self.folder, _free(self.folder), DISK_MARGIN_BYTES, e) from e
            raise StoreError(f"{self.folder}: cannot create the index ({e.strerror or e})") from e
        except BaseException:
            self._abandon()
            raise
        self.dim, self.schema = dim, SCHEMA_VERSION

    def _abandon(self) -> None:
        if self.shard is not None:
            with contextlib.suppress(Exception):
                self.shard.close()
            self.shard = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _locked(self, open_shard, action: str) -> None:
        """Take the folder's lock, then let Edge open the shard (released again if Edge fails)."""
        self.lock = FolderLock(self.folder)
        try:
            with _edge_errors(action, self.folder):
                self.shard = open_shard()
        except StoreError as e:
            self.lock.release()
            self.lock = None
            if "WouldBlock" in str(e):  # Edge's own WAL lock: a holder that took no folder lock
                raise IndexBusyError(self.folder, {}) from e
            raise

    def _cadence_start(self) -> None:
        self._finalizer = weakref.finalize(self, _release, self.shard, self.lock)
        self._unflushed, self._flushed_at = 0, time.monotonic()
        self._unflushed_bytes = 0  # float32 vector bytes upserted since the last flush
        self._stored = None  # pages at the last flush, counted when first needed
        self.flushes = 0
        self.flush_seconds = 0.0  # spent in flush() since the open (what the cadence costs)

    def _flush_due(self) -> bool:
        if self._unflushed == 0:
            return False
        if (
            time.monotonic() - self._flushed_at >= FLUSH_SECONDS
            or self._unflushed_bytes >= FLUSH_MAX_LOG_BYTES
        ):
            return True
        if self._unflushed < FLUSH_MIN_PAGES:
            return False
        if self._stored is None:
            self._stored = self.count()
        return self._unflushed >= min(FLUSH_MAX_PAGES, FLUSH_FRACTION * self._stored)

    def _check_space(self, points: Sequence[PagePoint]) -> None:
        """Stop before Edge would meet a full disk: the batch's log bytes and the margin must be
        free (after a flush, which returns the log's space, if need be)."""
        needed = DISK_MARGIN_BYTES + 2 * sum(v.nbytes for p in points for v in p.vectors.values())
        free = _free(self.folder)
        if free >= needed:
            return
        if self._unflushed:
            self.flush()
            free = _free(self.folder)
        if free < needed:
            raise DiskFullError(self.folder, free, needed)

    def upsert(self, points: Sequence[PagePoint]) -> None:
        for lo in range(0, len(points), UPSERT_BATCH):
            chunk = points[lo : lo + UPSERT_BATCH]
            stored = [self.stored_vectors(p) for p in chunk]
            # Edge takes lists: tolist() is exact and ~25% cheaper than its reading numpy rows
            batch = [
                qe.Point(id=p.id, payload=p.payload, vector=self._named_vectors(p, vectors))
                for p, vectors in zip(chunk, stored)
            ]
            self._check_space(chunk)
            centroids = [
                page_centroids(image_tokens(p.vectors[PAGE_VECTOR], p.payload), CENTROIDS)
                for p in chunk
            ]
            self._generation += 1
            current, self._tokens_current = self._tokens_current, False  # until both are written
            self._drop_verified()
            with _edge_errors("store pages", self.folder):
                self.shard.update(qe.UpdateOperation.upsert_points(batch))
            with _edge_errors("store the token table", self.folder):
                self.tokens.append([p.id for p in chunk], centroids)
            self._tokens_current = current
            self._unflushed += len(batch)
            self._unflushed_bytes += sum(4 * v.size for vectors in stored for v in vectors.values())
            if self._flush_due():
                self.flush()

    def _named_vectors(self, point: PagePoint, vectors: dict[str, np.ndarray]) -> dict[str, Any]:
        out: dict[str, Any] = {k: v.tolist() for k, v in vectors.items()}
        terms = self.lexical_terms(point)
        if terms is not None:
            out[LEXICAL_VECTOR] = qe.SparseVector(*terms)
        return out

    def set_payload(self, ids: Sequence[str], payload: dict[str, Any]) -> None:
        if ids:
            self._generation += 1
            with _edge_errors("update page payloads", self.folder):
                self.shard.update(
                    qe.UpdateOperation.set_payload([uuid.UUID(i) for i in ids], payload)
                )
            self._unflushed += 1
            if self._flush_due():
                self.flush()

    def delete(self, ids: Sequence[str]) -> None:
        if ids:
            self._generation += 1
            current, self._tokens_current = self._tokens_current, False  # until both are written
            self._drop_verified()
            with _edge_errors("delete pages", self.folder):
                self.shard.update(qe.UpdateOperation.delete_points(list(ids)))
            with _edge_errors("update the token table", self.folder):
                self.tokens.delete(list(ids))
            self._tokens_current = current

    def count(self) -> int:
        with _edge_errors("count pages", self.folder):
            return int(self.shard.count(qe.CountRequest(exact=True)))

    def payload_page(
        self, offset: Any, limit: int, doing: str, selector: Any = None
    ) -> tuple[list[tuple[str, dict[str, Any]]], Any]:
        """`Store.payload_page`; `selector` reads other fields than the default's (a part of a
        payload: the caller cannot judge it against the schema)."""
        if selector is None:
            selector = qe.PayloadSelector.Exclude(list(BULKY_FIELDS))
        with _edge_errors(doing, self.folder):
            records, offset = self.shard.scroll(
                qe.ScrollRequest(
                    offset=offset, limit=limit, with_payload=selector, with_vector=False
                )
            )
        return [(str(r.id), dict(r.payload or {})) for r in records], offset

    def search_points(
        self, queries: list[np.ndarray], k: int, mode: str, where: Where | None, texts
    ) -> list[list[tuple[str, float, dict[str, Any]]]]:
        """`Store.search_points`; `where` holds in every stage: the centroid scan ranks only
        the pages it allows (listed by Qdrant: `allowed_ids`), the other stages and the exact
        rerank filter in Qdrant, by those pages' ids once listed. "hybrid": the two-stage
        result's best HYBRID_CANDIDATES and the BM25 search's, fused by RRF in one request."""
        stages = (
            []
            if mode == "exact"
            else self.plan(max(k, HYBRID_CANDIDATES) if mode == "hybrid" else k)
        )
        scans = [s.limit for s in stages if s.using == TOKENS_STAGE]
        allowed = None
        flt = edge_filter(where)
        if scans and where:  # the centroid scan needs the pages listed: filter by id from then on
            allowed, flt = self._allowed_pages(where)
        token_ids = (
            self.tokens.top_many(queries, max(scans), allowed) if scans else [[] for _ in queries]
        )
        if mode == "hybrid":
            from .lexical import query_terms

            requests = [
                self._hybrid(
                    self._request(q, max(k, HYBRID_CANDIDATES), stages, ids, flt),
                    query_terms(text),
                    k,
                    flt,
                )
                for q, ids, text in zip(queries, token_ids, texts)
            ]
        else:
            requests = [self._request(q, k, stages, ids, flt) for q, ids in zip(queries, token_ids)]
        with _edge_errors("search", self.folder):
            results = self.shard.query_batch(qe.QueryBatchRequest(requests))
        return [
            [(str(p.id), float(p.score), dict(p.payload or {})) for p in points]
            for points in results
        ]

    @staticmethod
    def _hybrid(
        dense: qe.QueryRequest,
        terms: tuple[list[int], list[float]],
        k: int,
        where: qe.Filter | None,
    ) -> qe.QueryRequest:
        """The dense request as one prefetch, the BM25 search as another, fused by RRF."""
        stages = [
            qe.Prefetch(
                limit=dense.limit, query=dense.query, prefetches=dense.prefetches, filter=where
            )
        ]
        if terms[0]:  # a query of stop words only has no terms: the dense ranking alone
            stages.append(
                qe.Prefetch(
                    limit=dense.limit,
                    filter=where,
                    query=qe.Query.Nearest(qe.SparseVector(*terms), using=LEXICAL_VECTOR),
                )
            )
        return qe.QueryRequest(
            limit=k,
            prefetches=stages,
            query=qe.Fusion.Rrf(k=RRF_K),
            filter=where,
            with_payload=True,
        )

    @staticmethod
    def _request(
        query: np.ndarray,
        k: int,
        stages: Sequence[Stage],
        token_ids: Sequence[str],
        where: qe.Filter | None = None,
    ) -> qe.QueryRequest:
        """Exact MaxSim over the page vectors, of every page (`stages` empty: exact mode) or of
        the union of the plan's stages' pages; of the pages `where` allows."""
        exact = qe.Query.Nearest(query, using=PAGE_VECTOR)
        if not stages:
            return qe.QueryRequest(limit=k, query=exact, with_payload=True, filter=where)
        return qe.QueryRequest(
            limit=k,
            query=exact,
            with_payload=True,
            filter=where,
            prefetches=[_prefetch(query, stage, token_ids, where) for stage in stages],
        )

    def points(self, ids: Sequence[str]) -> dict[str, PagePoint]:
        with _edge_errors("read pages", self.folder):
            records = self.shard.retrieve(
                [uuid.UUID(i) for i in ids], with_payload=True, with_vector=True
            )
        return {
            str(r.id): as_point(r)
            for r in records
            if self.readable(str(r.id), dict(r.payload or {}))
        }

    def flush(self) -> None:
        started = time.perf_counter()
        with _edge_errors("flush", self.folder):
            self.shard.flush()
        if self._stored is not None:
            self._stored += self._unflushed
        self._unflushed, self._unflushed_bytes, self._flushed_at = 0, 0, time.monotonic()
        self.flushes += 1
        self.flush_seconds += time.perf_counter() - started

    def close(self) -> None:
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer.detach()
        try:
            if getattr(self, "shard", None) is not None:
                with _edge_errors("close", self.folder):
                    self.shard.flush()
                    if getattr(self, "_tokens_current", False):
                        self._mark_verified()
                    self.shard.close()
                self.shard = None
        finally:
            if getattr(self, "lock", None) is not None:
                self.lock.release()
                self.lock = None


# What colembed writes in an index folder (the token table's compaction siblings included)
_OWN_ENTRIES = frozenset(
    {
        META_FILE,
        f".{META_FILE}.tmp",
        SHARD_DIR,
        TOKENS_DIR,
        TOKENS_DIR + COMPACTING,
        TOKENS_DIR + SET_ASIDE,
        LOCK_FILE,
        CREATING_MARKER,
        STAGING_MARKER,
        IN_PLACE_NEW,
        IN_PLACE_OLD,
    }
)
# What an in-place swap moves (the lock file stays: the upgrade holds it throughout)
_SWAPPED = tuple(
    sorted(_OWN_ENTRIES - {META_FILE, LOCK_FILE, STAGING_MARKER, IN_PLACE_NEW, IN_PLACE_OLD})
) + (META_FILE,)


def _is_index_folder(path: Path) -> bool:
    return (path / META_FILE).is_file() and (path / SHARD_DIR).is_dir()


def _recover_interrupted_swap(folder: Path) -> None:
    """An upgrade killed between `commit_folder`'s two renames leaves no index at `folder` and the
    old one beside it as `.NAME.replaced-*`: put it back (it is whole; the upgrade is simply run
    again), so the next run never mistakes the folder for a new, empty index."""
    if _is_index_folder(folder) or (folder.exists() and any(folder.iterdir())):
        return
    replaced = sorted(folder.parent.glob(f".{folder.name}.replaced-*"), key=os.path.getmtime)
    old = next((p for p in reversed(replaced) if _is_index_folder(p)), None)
    if old is None:
        return
    if folder.exists():
        folder.rmdir()
    os.rename(old, folder)
    (folder / STAGING_MARKER).unlink(missing_ok=True)


def _is_upgrade_folder(path: Path) -> bool:
    """A folder an upgrade made: its staging marker, recording the upgrade's purpose (or
    `commit_folder`'s for the old index it set aside). Never a user's folder."""
    if not (path.is_dir() and not path.is_symlink() and is_staging_folder(path)):
        return False
    try:
        purpose = json.loads((path / STAGING_MARKER).read_text()).get("purpose")
    except (OSError, ValueError, AttributeError):
        return False
    return purpose in (UPGRADE_PURPOSE, REPLACED_PURPOSE)


def _finish_interrupted_upgrade(folder: Path) -> None:
    """What a killed `colembed upgrade` left, with the folder's lock held (so no upgrade is
    running): an in-place swap under way is finished (the new shard was complete before it
    began), and the upgrade's own leftovers (a staging copy beside or inside the folder, the old
    index set aside) are removed. Only folders carrying the upgrade's marker are touched."""
    new, old = folder / IN_PLACE_NEW, folder / IN_PLACE_OLD
    if not (folder / META_FILE).is_file() and _is_upgrade_folder(old):
        if (old / SET_ASIDE_DONE).is_file():  # the new shard was complete; moving it in
            _move_entries(new, folder)
        elif _is_upgrade_folder(new) and _is_index_folder(new):
            _move_entries(folder, old)  # whatever of the old index was not moved out yet
            _move_entries(new, folder)
        else:  # the new shard was never complete: put the old index back
            _move_entries(old, folder)
    leftovers = [p for p in (new, old) if p.exists()] + [
        p
        for pattern in (f".{folder.name}.staging-*", f".{folder.name}.replaced-*")
        for p in folder.parent.glob(pattern)
    ]
    for path in leftovers:
        if _is_upgrade_folder(path):
            remove_tree(path, owner=_is_upgrade_folder)
    (folder / STAGING_MARKER).unlink(missing_ok=True)  # a swap killed before its last step


def _move_entries(source: Path, dest: Path) -> None:
    """Move an index's own entries from `source` into `dest` (each one rename, on one
    filesystem), the meta file last."""
    for name in _SWAPPED:
        if (source / name).exists() and not (dest / name).exists():
            os.rename(source / name, dest / name)


def _upgrade_in_place(old: EdgeStore, progress) -> int:
    """`upgrade_index` for a folder that cannot be renamed: the new shard is built inside it, then
    the entries are swapped (`_move_entries`; a kill is finished by the next open)."""
    folder = old.folder
    for path in (folder / IN_PLACE_NEW, folder / IN_PLACE_OLD):
        if path.exists():
            remove_tree(path, owner=_is_upgrade_folder)
    new_folder = folder / IN_PLACE_NEW
    new_folder.mkdir()
    _write_upgrade_marker(new_folder)
    try:
        copied = _copy_points(old, new_folder, progress)
        with _edge_errors("close the shard", folder):
            old.shard.flush()
            old.shard.close()
        old.shard = None
        aside = folder / IN_PLACE_OLD
        aside.mkdir()
        _write_upgrade_marker(aside)
        os.rename(folder / META_FILE, aside / META_FILE)  # from here, the next open finishes it
        _move_entries(folder, aside)
        (aside / SET_ASIDE_DONE).write_text("")
        _move_entries(new_folder, folder)
    except BaseException:
        if not (folder / IN_PLACE_OLD).exists():
            remove_tree(new_folder, owner=_is_upgrade_folder)
        raise
    for path in (new_folder, folder / IN_PLACE_OLD):
        remove_tree(path, owner=_is_upgrade_folder)
    return copied


def _write_upgrade_marker(folder: Path) -> None:
    (folder / STAGING_MARKER).write_text(
        json.dumps({"purpose": UPGRADE_PURPOSE, "pid": os.getpid(), "created": time.time()}) + "\n"
    )


@dataclass(frozen=True)
class Upgraded:
    """What `upgrade_index` did: `rewritten` pages copied into a new shard at this schema (from
    schema `old_schema`, the vectors `dropped` not kept), `tokens_rebuilt` pages whose token-table
    rows were computed again (a current shard with a missing or stale table), `rows_compacted`
    dead table rows dropped. All 0: already current."""

    rewritten: int = 0
    tokens_rebuilt: int = 0
    rows_compacted: int = 0
    lexical_added: int | None = None  # pages given BM25 terms when the lexical vector was added
    old_schema: int = SCHEMA_VERSION
    dropped: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(
            self.rewritten
            or self.tokens_rebuilt
            or self.rows_compacted
            or self.lexical_added is not None
        )

    def describe(self) -> str:
        """One line for `colembed upgrade` (what was done, never more)."""
        if self.lexical_added is not None:
            done = Upgraded(
                self.rewritten,
                self.tokens_rebuilt,
                self.rows_compacted,
                old_schema=self.old_schema,
                dropped=self.dropped,
            )
            lexical = (
                f"added the lexical (BM25) vector for hybrid search ({self.lexical_added} "
                "page(s) with text)"
            )
            return lexical + ("; " + done.describe() if done else "")
        if self.rewritten:
            dropped = (
                f"; dropped the {' / '.join(self.dropped)} vectors, which its search does not read"
                if self.dropped
                else ""
            )
            return (
                f"rewrote {self.rewritten} page(s) from schema {self.old_schema} at the "
                f"current schema {SCHEMA_VERSION} (nothing embedded again{dropped})"
            )
        if self.tokens_rebuilt:
            return (
                f"rebuilt the token table of {self.tokens_rebuilt} page(s) from their stored "
                "vectors (the pages were not rewritten)"
            )
        if self.rows_compacted:
            return f"compacted the token table ({self.rows_compacted} dead row(s) dropped)"
        return "already at the current schema"


def upgrade_index(folder: Path, progress: Callable[[int, int], None] | None = None) -> Upgraded:
    """Bring an index folder up to date from its stored vectors (no page is embedded again):
    an older schema is rewritten at this one (the `mean` vector comes from each page's vectors
    and payload, the `rows` / `cols` of schemas 1-2 are not kept; a new shard and token table are
    filled in a staging folder beside it, which then replaces the folder: free disk of about the
    new index's size is needed meanwhile, and a folder holding anything colembed did not write is
    refused, naming it, as the replacement would delete it); at this schema, a missing or stale
    token table is rebuilt and one with dead rows compacted. Returns what was done (`Upgraded`);
    `progress(pages_done, total)` after each batch. Edge cannot add or drop a vector of an
    existing shard, hence the copy: 58 pages/s measured at 1,000 synthetic pages on 2 loaded
    cores (storing them took 81 pages/s), ~3 min at 10,000."""
    folder = Path(folder)
    old = EdgeStore(folder)
    try:
        if old.schema == SCHEMA_VERSION:
            lexical = None if old.has_lexical else add_lexical(old, progress)
            if not old._tokens_current:
                return Upgraded(tokens_rebuilt=rebuild_tokens(old, progress), lexical_added=lexical)
            return Upgraded(rows_compacted=old.tokens.compact(), lexical_added=lexical)
        foreign = sorted(p.name for p in folder.iterdir() if p.name not in _OWN_ENTRIES)
        if foreign:
            raise StoreError(
                f"{folder}: also holds {', '.join(foreign)}, which colembed did not "
                "write; the upgrade replaces the whole folder, so move them out "
                "first"
            )
        if not _renamable(folder):
            copied = _upgrade_in_place(old, progress)
        else:
            staging = staging_folder(folder, UPGRADE_PURPOSE)
            try:
                copied = _copy_points(old, staging, progress)
                _swap(old, staging)
            except OSError as e:
                discard_staging(staging)  # nothing to do once the swap has moved it
                if e.errno not in _CANNOT_RENAME or not _is_index_folder(folder):
                    raise
                old.close()  # the rename was refused: nothing moved; do it inside the folder
                old = EdgeStore(folder)
                copied = _upgrade_in_place(old, progress)
            except BaseException:
                discard_staging(staging)
                raise
    finally:
        old.close()
    return Upgraded(
        rewritten=copied,
        old_schema=old.schema,
        dropped=tuple(
            n for n in SCHEMA_VECTORS[old.schema] if n not in SCHEMA_VECTORS[SCHEMA_VERSION]
        ),
    )


def add_lexical(store: EdgeStore, progress: Callable[[int, int], None] | None = None) -> int:
    """Add the lexical sparse vector to a shard created without it (Edge adds a named vector
    in place) and give each page with stored text its BM25 terms; returns those pages. The meta
    file records it last, so a kill midway leaves a folder that adds it again next time."""
    with _edge_errors("add the lexical vector", store.folder):
        store.shard.update(qe.UpdateOperation.create_sparse_vector(LEXICAL_VECTOR, qe.Modifier.Idf))
    store.has_lexical = True
    ids = [pid for pid, _ in store.payloads()]
    done = 0
    for lo in range(0, len(ids), SCROLL_PAGE):
        chunk = ids[lo : lo + SCROLL_PAGE]
        with _edge_errors("read pages", store.folder):
            records = store.shard.retrieve(
                [uuid.UUID(i) for i in chunk], with_payload=True, with_vector=False
            )
        updates = []
        for r in records:
            terms = store.lexical_terms(PagePoint(str(r.id), {}, dict(r.payload or {})))
            if terms is not None:
                updates.append(qe.PointVectors(r.id, {LEXICAL_VECTOR: qe.SparseVector(*terms)}))
        if updates:
            with _edge_errors("store the lexical vectors", store.folder):
                store.shard.update(qe.UpdateOperation.update_vectors(updates))
        done += len(updates)
        if progress is not None:
            progress(min(lo + SCROLL_PAGE, len(ids)), len(ids))
    store.flush()
    _write_meta(store.folder, dict(_read_meta(store.folder), lexical=True))
    return done


def _renamable(folder: Path) -> bool:
    """Whether the folder can be replaced by a rename: not a mount point, and its parent on the
    same device and writable (a Docker volume is all three)."""
    parent = folder.resolve().parent
    try:
        same_device = os.stat(folder).st_dev == os.stat(parent).st_dev
    except OSError:
        return False
    return same_device and not os.path.ismount(folder) and os.access(parent, os.W_OK)


def rebuild_tokens(store: EdgeStore, progress: Callable[[int, int], None] | None = None) -> int:
    """Compute the token table again from the stored page vectors (no page is embedded); returns
    the pages done."""
    ids = [pid for pid, _ in store.payloads()]

    def pages():
        for lo in range(0, len(ids), SCROLL_PAGE):
            for p in store.points(ids[lo : lo + SCROLL_PAGE]).values():
                yield p.id, image_tokens(p.vectors[PAGE_VECTOR], p.payload)

    store._drop_verified()
    with _edge_errors("rebuild the token table", store.folder):
        done = store.tokens.rebuild(pages(), progress and (lambda n: progress(n, len(ids))))
    store._tokens_current = store._table_matches()
    if progress is not None:
        progress(done, len(ids))
    return done


def _swap(old: EdgeStore, staging: Path) -> None:
    """Close the old shard and put the new folder in its place. The folder lock is held across the
    rename so no process opens the old shard meanwhile (on Windows, where a locked open file blocks
    renaming its folder, it is released just before)."""
    with _edge_errors("close the shard", old.folder):
        old.shard.flush()
        old.shard.close()
    old.shard = None
    if sys.platform == "win32":
        old.lock.release()
        old.lock = None
    commit_folder(staging, old.folder, replaceable=_is_index_folder)


def _copy_points(old: EdgeStore, folder: Path, progress) -> int:
    """Every point of `old` into a new shard of the current schema in `folder`, closed after;
    returns how many (all of them, or StoreError)."""
    new = EdgeStore(folder, dim=old.dim)
    try:
        ids = [pid for pid, _ in old.payloads()]
        for lo in range(0, len(ids), SCROLL_PAGE):
            points = old.points(ids[lo : lo + SCROLL_PAGE]).values()
            new.upsert(
                [PagePoint(p.id, p.vectors, dict(p.payload, schema=new.schema)) for p in points]
            )
            if progress is not None:
                progress(min(lo + SCROLL_PAGE, len(ids)), len(ids))
        new.flush()
        if new.count() != len(ids):
            raise StoreError(f"{old.folder}: upgrade copied {new.count()} of {len(ids)} pages")
    finally:
        new.close()
    return len(ids)
