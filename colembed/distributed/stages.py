"""The work of each pipeline stage, as plain functions and one class over rows and batches.

Ray-free (Ray Data calls these; a test or a debugger can call them alone). Rows between stages:

    document row   {"path": str}                                      (the driver's list)
    point row      path, page, pages, sha256, status, reason, id, payload (JSON),
                   page/rows/cols vectors (raw float32 bytes, `dim` wide)

`status` is "page" (embedded), "file" (a document's end, one row: `page` holds the count of its
pages already in the target, `reason` the JSON {page: why} of its bad pages) or "failed" (a
document that cannot be opened: one row naming the reason). The driver turns them into the same
reports `Index.add` gives (`index.records.file_report`). A bad page (any exception rendering or
embedding it) fails that page only, as in `Index.add`: the document's other pages go on. The actor
that embeds a document also hashes, opens and renders it, once: pixels never leave its process,
and only document paths go in and points come out. Vectors travel as raw float32 bytes, so the
writer gets exactly what the single-process indexer hands its store.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..index.records import (
    ModelIdentity,
    default_source,
    embed_keeping_going,
    page_failure,
    page_payload,
)
from ..index.schema import COLS_VECTOR, PAGE_VECTOR, ROWS_VECTOR, PagePoint, make_point, point_id
from ..index.sources import HASH_CHUNK, Document, SourceError

PAGE, FILE, FAILED = "page", "file", "failed"
VECTOR_COLUMNS = {
    PAGE_VECTOR: "page_vectors",
    ROWS_VECTOR: "rows_vectors",
    COLS_VECTOR: "cols_vectors",
}
META_COLUMNS = ("path", "page", "pages", "sha256", "status", "reason")
COPY_PREFIX = "colembed-doc-"


class _local_copy:
    """(a local path, its sha256 or None): the file itself when local (`Document` hashes the
    bytes it reads), else a private temporary copy (pdfium and PIL read local files), hashed while
    copied and deleted on exit."""

    def __init__(self, path: str, filesystem) -> None:
        self.path, self.filesystem, self.copy = path, filesystem, None

    def __enter__(self) -> tuple[Path, str]:
        if self.filesystem is None:
            return Path(self.path), None
        digest = hashlib.sha256()
        fd, name = tempfile.mkstemp(prefix=COPY_PREFIX, suffix=Path(self.path).suffix)
        self.copy = Path(name)
        try:
            with os.fdopen(fd, "wb") as out, self.filesystem.open_input_stream(self.path) as src:
                while chunk := src.read(HASH_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
        except OSError as e:
            self.__exit__()
            raise SourceError(Path(self.path), f"cannot read: {e}") from e
        return self.copy, digest.hexdigest()

    def __exit__(self, *exc) -> None:
        if self.copy is not None:  # our own mkstemp file, never a user's
            self.copy.unlink(missing_ok=True)
            self.copy = None


class PageEmbedder:
    """Holds one loaded model (sessions created once, in the constructor) and turns document
    rows into point rows: per document, its sha256, the pages `stored` (point ids) lacks,
    rendered by `sources.Document` as the single-process indexer renders them and embedded
    `batch_size` at a time, the next batch rendered by one thread while the model embeds; one
    batch of point rows is yielded per embedded batch. Ray Data runs one per actor of the pool,
    one call at a time (pdfium is not thread-safe: one render at a time per process).

    `crash_once`: fault injection for resumability checks, real code on purpose: the first
    embedder anywhere to embed its `crash_once[1]`-th batch creates the marker file
    `crash_once[0]` and exits its process before yielding that batch (the marker keeps the
    restarted actor and the others alive), as a node lost mid-job would.
    """

    def __init__(
        self,
        folder: str,
        identity: dict[str, Any],
        *,
        load_options: dict[str, Any],
        source: str | None = None,
        stored: frozenset[str] = frozenset(),
        batch_size: int = 4,
        dpi: float | None = None,
        filesystem=None,
        crash_once: tuple[str, int] | None = None,
    ) -> None:
        from ..model import load

        self.model = load(folder, **load_options)
        self.identity, self.source = ModelIdentity(**identity), source or default_source()
        self.stored, self.batch_size, self.dpi, self.filesystem = (
            stored,
            batch_size,
            dpi,
            filesystem,
        )
        self.crash_once, self.batches = crash_once, 0
        self.renderer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="colembed-render")

    def __call__(self, batch: dict[str, np.ndarray]) -> Iterator[dict[str, list]]:
        for path in batch["path"]:
            yield from self.document(str(path))

    def document(self, path: str) -> Iterator[dict[str, list]]:
        """Point rows of one document's missing pages, a batch at a time, then its "file" row;
        a document that cannot be opened is one "failed" row."""
        try:
            with _local_copy(path, self.filesystem) as (local, sha):
                with Document(
                    local, max_pixels=self.model.config.max_pixels, dpi=self.dpi, sha256=sha
                ) as doc:
                    sha = doc.sha256
                    meta = dict(path=path, pages=doc.pages, sha256=sha)
                    todo = [
                        n
                        for n in range(1, doc.pages + 1)
                        if point_id(sha, n, path) not in self.stored
                    ]
                    errors: dict[int, str] = {}
                    yield from self._embed_pages(doc, meta, todo, errors)
        except Exception as e:  # noqa: BLE001 (a document that cannot be read fails, not the job)
            reason = e.reason if isinstance(e, SourceError) else page_failure(0, e)
            yield _columns([_meta_row(dict(path=path, pages=0, sha256=""), 0, FAILED, reason)])
            return
        yield _columns([_meta_row(meta, doc.pages - len(todo), FILE, json.dumps(errors))])

    def _embed_pages(
        self, doc, meta: dict[str, Any], todo: list[int], errors: dict[int, str]
    ) -> Iterator[dict[str, list]]:
        """Embed `todo` a batch at a time while the render thread renders the next batch, as the
        single-process indexer overlaps them (one render in flight: pdfium is not thread-safe;
        none is left running when this returns, so the document can be closed). Bad pages go
        to `errors` and the others on."""
        chunks = [todo[i : i + self.batch_size] for i in range(0, len(todo), self.batch_size)]
        ahead = self.renderer.submit(_render, doc, chunks[0]) if chunks else None
        try:
            for i, pages in enumerate(chunks):
                rendered, ahead = ahead.result(), None
                if i + 1 < len(chunks):
                    ahead = self.renderer.submit(_render, doc, chunks[i + 1])
                errors.update({n: why for n, why in rendered.items() if isinstance(why, str)})
                good = [(n, image) for n, image in rendered.items() if not isinstance(image, str)]
                yield _columns(self._embed(meta, good, errors))
        finally:
            if ahead is not None:
                wait([ahead])

    def _embed(
        self, meta: dict[str, Any], pages: list[tuple[int, Any]], errors: dict[int, str]
    ) -> list[dict]:
        """Point rows of `pages` ((page, image)); a page the model rejects goes to `errors`."""
        out: list[dict] = []

        def hand(first: int, results: list) -> None:
            out.extend(
                self._point_row(meta, n, image.size, v, lay)
                for (n, image), (v, lay) in zip(pages[first:], results)
            )

        bad = embed_keeping_going(self.model, [image for _, image in pages], len(pages) or 1, hand)
        errors.update({pages[i][0]: why for i, why in bad.items()})
        self.batches += 1
        self._maybe_crash()
        return out

    def _point_row(
        self, meta: dict[str, Any], page: int, size: tuple[int, int], vectors: np.ndarray, layout
    ) -> dict[str, Any]:
        point = make_point(
            vectors,
            layout,
            page_payload(
                self.identity,
                path=meta["path"],
                page=page,
                pages=meta["pages"],
                sha256=meta["sha256"],
                size=size,
                source=self.source,
            ),
        )
        out = _meta_row(meta, page, PAGE, "")
        out.update(
            id=point.id,
            payload=json.dumps(point.payload, sort_keys=True),
            **{VECTOR_COLUMNS[n]: point.vectors[n].tobytes() for n in VECTOR_COLUMNS},
        )
        return out

    def _maybe_crash(self) -> None:
        if self.crash_once is None or self.batches < self.crash_once[1]:
            return
        try:
            fd = os.open(self.crash_once[0], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.close(fd)
        os._exit(1)


def _render(doc, pages: list[int]) -> dict[int, Any]:
    """page -> its image, or why it cannot be rendered (any exception: that page's failure)."""
    out: dict[int, Any] = {}
    for n in pages:
        try:
            out[n] = doc.page_image(n)
        except Exception as e:  # noqa: BLE001 (MemoryError on a poster page: that page fails)
            out[n] = page_failure(n, e)
    return out


def _meta_row(meta: dict[str, Any], page: int, status: str, reason: str) -> dict[str, Any]:
    """A row without a point (skipped, failed), or the start of a point row."""
    return dict(
        path=meta["path"],
        page=page,
        pages=meta["pages"],
        sha256=meta["sha256"],
        status=status,
        reason=reason,
        id="",
        payload="",
        **{c: b"" for c in VECTOR_COLUMNS.values()},
    )


def _plain(value: Any) -> Any:
    """A numpy scalar from a batch as the Python value the payload and the ids were made of."""
    return value.item() if isinstance(value, np.generic) else value


def _columns(rows: list[dict[str, Any]]) -> dict[str, list]:
    keys = list(rows[0]) if rows else list(META_COLUMNS)
    return {k: [r[k] for r in rows] for k in keys}


def page_points(batch: dict[str, Any], dim: int) -> list[PagePoint]:
    """The PagePoints of a batch of point rows (rows with another status are left out)."""
    points = []
    for i, status in enumerate(batch["status"]):
        if status != PAGE:
            continue
        vectors = {
            name: np.frombuffer(batch[col][i], dtype=np.float32).reshape(-1, dim)
            for name, col in VECTOR_COLUMNS.items()
        }
        points.append(PagePoint(str(batch["id"][i]), vectors, json.loads(batch["payload"][i])))
    return points


def summary_rows(batch: dict[str, Any]) -> dict[str, list]:
    """The batch without its vectors and payloads: what the driver collects to report."""
    return {k: [_plain(v) for v in batch[k]] for k in (*META_COLUMNS, "id")}
