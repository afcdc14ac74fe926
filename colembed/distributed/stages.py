"""The work of each pipeline stage, as plain functions and one class over rows and batches.

Ray-free (Ray Data calls these; a test or a debugger can call them alone). Rows between stages:

    document row   {"path": str}                                      (the driver's list)
    page row       path, page, pages, sha256, width, height, pixels (raw RGB bytes), status, reason
    point row      the page row's keys (pixels dropped) + id, payload (JSON), page/rows/cols
                   vectors (raw float32 bytes, `dim` wide)

`status` is "page" (to embed / embedded), "skipped" (a document whose pages are all in the
target: one row) or "failed" (a document or page that cannot be indexed: one row naming the reason).
Pixels travel as raw bytes and vectors as raw float32 bytes, so every stage hands the next exactly
what the single-process indexer hands its model and its store.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..errors import InputError
from ..index.schema import COLS_VECTOR, PAGE_VECTOR, ROWS_VECTOR, PagePoint, make_point, point_id
from ..index.sources import HASH_CHUNK, Document, SourceError, file_sha256

PAGE, SKIPPED, FAILED = "page", "skipped", "failed"
VECTOR_COLUMNS = {PAGE_VECTOR: "page_vectors", ROWS_VECTOR: "rows_vectors", COLS_VECTOR: "cols_vectors"}
META_COLUMNS = ("path", "page", "pages", "sha256", "status", "reason")
COPY_PREFIX = "colembed-doc-"


def _row(path: str, *, page: int = 0, pages: int = 0, sha256: str = "", status: str = PAGE,
         reason: str = "", size: tuple[int, int] = (0, 0), pixels: bytes = b"") -> dict[str, Any]:
    return {"path": path, "page": page, "pages": pages, "sha256": sha256, "width": size[0],
            "height": size[1], "pixels": pixels, "status": status, "reason": reason}


def render_document(row: dict[str, Any], *, stored: frozenset[str], max_pixels: int,
                    dpi: float | None, filesystem=None) -> Iterator[dict[str, Any]]:
    """Page rows of the pages of one document that `stored` (point ids) lacks, rendered by
    `sources.Document` exactly as the single-process indexer renders them; a document that
    cannot be read becomes one "failed" row, one with every page stored one "skipped" row."""
    path = row["path"]
    try:
        with _local_copy(path, filesystem) as (local, sha):
            with Document(local, max_pixels=max_pixels, dpi=dpi) as doc:
                todo = [n for n in range(1, doc.pages + 1)
                        if point_id(sha, n, path) not in stored]
                if not todo:
                    yield _row(path, pages=doc.pages, sha256=sha, status=SKIPPED,
                               reason="already indexed")
                for page, image in doc.iter_pages(todo):
                    yield _row(path, page=page, pages=doc.pages, sha256=sha, size=image.size,
                               pixels=image.tobytes())
    except SourceError as e:
        yield _row(path, status=FAILED, reason=e.reason)


class _local_copy:
    """(a local path, the file's sha256): the file itself when local, else a private temporary
    copy (pdfium and PIL read local files), hashed while copied and deleted on exit."""

    def __init__(self, path: str, filesystem) -> None:
        self.path, self.filesystem, self.copy = path, filesystem, None

    def __enter__(self) -> tuple[Path, str]:
        if self.filesystem is None:
            return Path(self.path), file_sha256(Path(self.path))
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
    """Holds one loaded model (sessions created once, in the constructor) and turns a batch of
    page rows into point rows; Ray Data runs one per actor of the pool.

    `crash_once`: fault injection for resumability checks, real code on purpose: the first
    embedder anywhere to finish its `crash_once[1]`-th batch creates the marker file
    `crash_once[0]` and exits its process before returning that batch (the marker keeps the
    restarted actor and the others alive), as a node lost mid-job would.
    """

    def __init__(self, folder: str, identity: dict[str, Any], *, load_options: dict[str, Any],
                 crash_once: tuple[str, int] | None = None) -> None:
        from ..model import load

        self.model = load(folder, **load_options)
        self.identity = dict(identity)
        self.crash_once, self.batches = crash_once, 0

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        rows = [{k: batch[k][i] for k in batch} for i in range(len(batch["path"]))]
        out = [self._passthrough(r) for r in rows if r["status"] != PAGE]
        pages = [r for r in rows if r["status"] == PAGE]
        while pages:
            images = [_image(r) for r in pages]
            try:
                embedded, bad = self.model.embed_pages(images, batch_size=len(images)), None
            except InputError as e:
                embedded, bad = getattr(e, "completed", []), e
            out += [self._point_row(r, v, lay) for r, (v, lay) in zip(pages, embedded)]
            if bad is None:
                break
            failed = pages[len(embedded)]
            out.append(self._passthrough(failed, FAILED, f"page {failed['page']}: {bad.reason}"))
            pages = pages[len(embedded) + 1:]
        self.batches += 1
        self._maybe_crash()
        return _columns(out)

    def _point_row(self, row: dict[str, Any], vectors: np.ndarray, layout) -> dict[str, Any]:
        payload = dict(self.identity, path=str(row["path"]), page=int(row["page"]),
                       pages=int(row["pages"]), sha256=str(row["sha256"]),
                       width=int(row["width"]), height=int(row["height"]))
        point = make_point(vectors, layout, payload)
        out = self._passthrough(row)
        out.update(id=point.id, payload=json.dumps(point.payload, sort_keys=True),
                   **{VECTOR_COLUMNS[n]: point.vectors[n].tobytes() for n in VECTOR_COLUMNS})
        return out

    @staticmethod
    def _passthrough(row: dict[str, Any], status: str | None = None, reason: str | None = None):
        out = {k: _plain(row[k]) for k in META_COLUMNS}
        if status is not None:
            out.update(status=status, reason=reason)
        out.update(id="", payload="", **{c: b"" for c in VECTOR_COLUMNS.values()})
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


def _image(row: dict[str, Any]):
    from PIL import Image

    return Image.frombytes("RGB", (int(row["width"]), int(row["height"])), row["pixels"])


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
        vectors = {name: np.frombuffer(batch[col][i], dtype=np.float32).reshape(-1, dim)
                   for name, col in VECTOR_COLUMNS.items()}
        points.append(PagePoint(str(batch["id"][i]), vectors, json.loads(batch["payload"][i])))
    return points


def summary_rows(batch: dict[str, Any]) -> dict[str, list]:
    """The batch without its vectors and payloads: what the driver collects to report."""
    return {k: [_plain(v) for v in batch[k]] for k in (*META_COLUMNS, "id")}

