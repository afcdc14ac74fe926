"""The Ray Data job: documents -> a pool of model actors (render + embed) -> target.

    driver        list the documents; open the target; read the ids it holds; check the model
    map_batches   (ActorPool of `actors`, each one `PageEmbedder` = one loaded model) per
                  document: sha256, ids of its pages, render the missing ones with
                  `index.sources.Document` (pypdfium2 at the model's pixel budget) in the actor's
                  own process, embed `batch_size` pages per model call, make each page's point
                  (`index.schema.make_point`); only paths go in and points come out
    write         a Qdrant server: `writers` actors upserting in parallel; an Edge / local-mode
                  folder: the driver, its one writer; Parquet: tasks writing one part per batch
    driver        collect the per-page summary; drop older versions of changed files (Qdrant)

Rendering where the model runs is what keeps Ray's cost per page small: a page's pixels (~1.8 MB
at 768 tokens) never cross the object store, and each PDF is opened and hashed once.

The model folder is read by each actor from a path every node can read (shared storage, or the
same path baked into each node's image): Ray's object store and working_dir are for objects and
code (a runtime_env package is capped far below a 2B model's gigabytes), and a shared path is what
clusters already use for weights. Each actor verifies it against its manifest once; the hash
stamps (`~/.cache/colembed` on each node) make that a stat after a node's first actor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

import ray

from ..index.errors import ModelMismatchError
from ..index.records import (
    AddResult,
    Catalog,
    FileReport,
    ModelIdentity,
    default_source,
    file_report,
    options_of,
    stale_ids,
)
from ..index.sources import discover, kind_of
from ..layout import BASE_VARIANT
from ..manifest import read_manifest
from ..model import check_dim
from .stages import FAILED, FILE, PAGE, PageEmbedder, summary_rows
from .targets import ParquetTarget, StoreWriter, write_part

MAX_DOCUMENT_BLOCKS = 4096  # documents are split into at most this many blocks


def model_identity(
    folder: str | os.PathLike,
    variant: str = BASE_VARIANT,
    max_image_tokens: int | None = None,
    dpi: float | None = None,
    schema: int | None = None,
    dim: int | None = None,
) -> dict[str, Any]:
    """The identity `colembed.Index` stamps on every page (`index.records.ModelIdentity`), read
    from the folder without loading it."""
    from ..index.schema import SCHEMA_VERSION

    return ModelIdentity.of_folder(
        folder,
        variant=variant,
        max_image_tokens=max_image_tokens,
        dpi=dpi,
        schema=schema or SCHEMA_VERSION,
        dim=dim,
    ).payload()


def list_documents(paths: Iterable[str], filesystem=None) -> tuple[list[str], AddResult]:
    """Documents to index (canonical path strings: what ids and payloads are made of) and the
    report of what was left out. Local paths are walked as `Index.add` walks them; with a pyarrow
    `filesystem`, each path is a file or a folder listed recursively on it."""
    if filesystem is None:
        found = discover(paths)
        return [str(p) for p in found.documents], AddResult.of_discovery(
            found.ignored, found.missing
        )
    import pyarrow.fs as pafs

    documents, report = [], AddResult()
    for path in paths:
        info = filesystem.get_file_info(str(path))
        if info.type == pafs.FileType.Directory:
            infos = filesystem.get_file_info(pafs.FileSelector(str(path), recursive=True))
            documents += sorted(i.path for i in infos if i.is_file and kind_of(Path(i.path)))
        elif info.type == pafs.FileType.File and kind_of(Path(info.path)):
            documents.append(info.path)
        else:
            report.failed.append(FileReport(str(path), reason="not a PDF, image or folder"))
    return list(dict.fromkeys(documents)), report


def run(
    paths: Iterable[str],
    target,
    *,
    model: str | os.PathLike,
    actors: int = 1,
    batch_size: int = 4,
    cpus_per_actor: float = 1,
    providers: Any = None,
    variant: str | None = None,
    max_image_tokens: int | None = None,
    dim: int | None = None,
    dpi: float | None = None,
    filesystem=None,
    writers: int = 1,
    actor_options: dict[str, Any] | None = None,
    source: str | None = None,
    crash_once: tuple[str, int] | None = None,
) -> AddResult:
    """Index `paths` into `target` (a `QdrantTarget` or `ParquetTarget`) on the Ray cluster this
    process is connected to (see `index_with_ray` for starting one). Returns what
    `colembed.Index.add` returns: files added, skipped and failed with their reasons. `variant`,
    `max_image_tokens`, `dim` (`colembed.load`'s) and `dpi` default to the target's own, as
    `Index` reopens; `source` as
    `Index`'s (replacement touches only that source's pages)."""
    folder = Path(model).expanduser().resolve()
    source = source or default_source()
    manifest = read_manifest(folder)
    documents, result = list_documents(paths, filesystem)
    check_dim(dim, manifest.embedding_dim)  # a bad dim is refused before the target is touched
    # the width a new target is made with; an existing one keeps its own
    stored = target.open(dim or manifest.embedding_dim)
    try:
        built = options_of(stored[0][1] if stored else None)
        variant = variant or built.get("variant") or BASE_VARIANT
        max_image_tokens = max_image_tokens or built.get("max_image_tokens")
        dim = dim or built.get("dim")
        dpi = dpi if dpi is not None else built.get("dpi")
        identity = ModelIdentity.of_folder(
            folder,
            variant=variant,
            max_image_tokens=max_image_tokens,
            dpi=dpi,
            schema=target.schema,
            pool_factor=built.get("pool_factor", 1),
            dim=dim,
        )
        identity.check(stored[0][1] if stored else None, target.location)
        width = getattr(getattr(target, "store", None), "dim", None)  # a Qdrant target's own
        if width is not None and width != identity.dim:
            raise ModelMismatchError(
                f"{target.location}: this index holds {width}-dim page vectors; this run makes "
                f"{identity.dim}-dim ones (dim {identity.dim}): not comparable. Run it with "
                f"dim={width}, or use another index"
            )
        pages = documents and _pipeline(
            documents,
            actors=actors,
            actor_args=dict(actor_options or {}, num_cpus=cpus_per_actor),
            embedder=dict(
                folder=str(folder),
                identity=identity.payload(),
                crash_once=crash_once,
                stored=frozenset(pid for pid, _ in stored),
                batch_size=batch_size,
                dpi=dpi,
                filesystem=filesystem,
                source=source,
                load_options=dict(
                    variant=variant,
                    providers=providers,
                    max_image_tokens=max_image_tokens,
                    dim=dim,
                    threads=max(1, round(cpus_per_actor)),
                ),
            ),
        )
        rows = _write(pages, target, writers) if documents else []
        _report(rows, documents, stored, target, result, source)
        target.flush()
    finally:
        target.close()
    return result


def _pipeline(documents, *, actors, embedder, actor_args):
    """One document per actor call: the unit Ray retries, and the one PDF an actor opens."""
    blocks = max(1, min(len(documents), MAX_DOCUMENT_BLOCKS))
    return ray.data.from_items(
        [{"path": d} for d in documents], override_num_blocks=blocks
    ).map_batches(
        PageEmbedder,
        batch_size=1,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=actors),
        fn_constructor_kwargs=embedder,
        **actor_args,
    )


def _write(pages, target, writers: int) -> list[dict[str, Any]]:
    """Write the embedded pages; the per-page summary rows (no vectors) for the report."""
    if not target.parallel:  # an embedded store: the driver is its one writer
        rows: list[dict[str, Any]] = []
        for batch in pages.iter_batches(batch_size=None, batch_format="numpy"):
            target.write(batch)
            summary = summary_rows(batch)
            rows += [dict(zip(summary, values)) for values in zip(*summary.values())]
        return rows
    if isinstance(target, ParquetTarget):
        written = pages.map_batches(
            write_part,
            batch_size=None,
            batch_format="numpy",
            num_cpus=0,
            fn_kwargs=target.writer_args(),
        )
    else:
        written = pages.map_batches(
            StoreWriter,
            batch_size=None,
            batch_format="numpy",
            num_cpus=0,
            compute=ray.data.ActorPoolStrategy(size=writers),
            fn_constructor_kwargs=target.writer_args(),
        )
    return written.take_all()


def _report(rows, documents, stored, target, result: AddResult, source: str) -> None:
    """Fill `result` per document from the rows, in `Index.add`'s words
    (`index.records.file_report`); drop the pages of older versions of changed files written by
    this source (Qdrant targets)."""
    by_path: dict[str, dict[tuple, dict[str, Any]]] = {d: {} for d in documents}
    for row in rows:  # a retried document's rows may arrive twice: one per page and status
        by_path.setdefault(row["path"], {})[row["page"], row["status"]] = row
    catalog = Catalog.of(stored)
    for path in documents:
        unique = list(by_path[path].values())
        failed = [r for r in unique if r["status"] == FAILED]
        ends = [r for r in unique if r["status"] == FILE]
        if failed or not ends:
            reason = failed[0]["reason"] if failed else "the Ray job returned no result for it"
            result.failed.append(FileReport(path, 0, reason))
            continue
        end = ends[0]
        stale = stale_ids(catalog, path, end["sha256"], source)
        target.delete(stale)
        file_report(
            result,
            path,
            pages=end["pages"],
            stored=len({r["page"] for r in unique if r["status"] == PAGE}),
            had=end["page"],
            errors={int(n): why for n, why in json.loads(end["reason"]).items()},
            stale=bool(stale),
        )
