"""Indexing a list of documents: plan per file, render in one thread, embed, store, report.

    render thread (pdfium is not thread-safe: the only thread that touches it)
      file -> sha256 -> plan against what the store holds -> open -> render the pages to do
      -> queue of events (bounded: rendering stays at most `QUEUE_PAGES` pages ahead)
    calling thread
      pages -> model.embed_pages in batches -> points (all three vectors + payload) -> upsert
      a file whose pages are all stored -> delete its pages from an older version of the file

Resumable and idempotent: point ids come from (sha256, page, path); a page that is stored is never
embedded again; a point is one upsert with all its vectors, so a killed run leaves whole pages only
and the next run does the rest.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import InputError
from .schema import make_point
from .sources import Document, SourceError, file_sha256

QUEUE_PAGES = 8


@dataclass
class FileReport:
    path: str
    pages: int = 0
    reason: str = ""


@dataclass
class AddResult:
    """What `Index.add` did: files added (with their new pages), skipped and failed (with why)."""

    added: list[FileReport] = field(default_factory=list)
    skipped: list[FileReport] = field(default_factory=list)
    failed: list[FileReport] = field(default_factory=list)
    removed: list[FileReport] = field(default_factory=list)

    @property
    def pages_added(self) -> int:
        return sum(r.pages for r in self.added)

    @property
    def ok(self) -> bool:
        return not self.failed


@dataclass
class _Plan:
    """One file's work: which pages to render and which older points to drop once it is stored."""

    path: Path
    sha256: str
    pages: int
    todo: list[int]
    stale: list[str]
    size: dict[int, tuple[int, int]] = field(default_factory=dict)
    stored: int = 0
    failed: str = ""


def stored_by_path(payloads: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, dict[int, str]]]:
    """path -> sha256 -> page -> point id, from the store's payloads."""
    out: dict[str, dict[str, dict[int, str]]] = {}
    for pid, p in payloads:
        out.setdefault(p.get("path", ""), {}).setdefault(p.get("sha256", ""), {})[int(p.get("page", 0))] = pid
    return out


class _Renderer(threading.Thread):
    """Plans and renders every file in order, posting events to `events`; never raises."""

    def __init__(self, files: list[Path], stored, *, max_pixels: int, dpi: float | None) -> None:
        super().__init__(name="colembed-render", daemon=True)
        self.files, self.stored = files, stored
        self.max_pixels, self.dpi = max_pixels, dpi
        self.events: queue.Queue = queue.Queue(maxsize=QUEUE_PAGES)
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            for path in self.files:
                if self.stop.is_set():
                    return
                self._one(path)
        finally:
            self.events.put(("end",))

    def _one(self, path: Path) -> None:
        try:
            sha = file_sha256(path)
            versions = self.stored.get(str(path), {})
            have = versions.get(sha, {})
            stale = [pid for s, pages in versions.items() if s != sha for pid in pages.values()]
            with Document(path, max_pixels=self.max_pixels, dpi=self.dpi) as doc:
                todo = [n for n in range(1, doc.pages + 1) if n not in have]
                plan = _Plan(path, sha, doc.pages, todo, stale)
                self.events.put(("file", plan))
                for page, image in doc.iter_pages(todo):
                    if self.stop.is_set():
                        return
                    plan.size[page] = image.size
                    self.events.put(("page", plan, page, image))
        except SourceError as e:
            self.events.put(("failed", path, e.reason))
            return
        self.events.put(("done", plan))


def ingest(files: list[Path], store, model, identity: dict[str, Any], *, dpi: float | None,
           batch_size: int, result: AddResult, on_pages: Callable[[int], None],
           on_total: Callable[[int], None]) -> None:
    """Index `files` into `store` with `model`, filling `result` (see the module docstring)."""
    renderer = _Renderer(files, stored_by_path(store.payloads()),
                         max_pixels=model.config.max_pixels, dpi=dpi)
    renderer.start()
    pending: list[tuple[_Plan, int, Any]] = []
    finished: list[_Plan] = []
    try:
        while True:
            event = renderer.events.get()
            kind = event[0]
            if kind == "end":
                break
            if kind == "failed":
                result.failed.append(FileReport(str(event[1]), reason=event[2]))
            elif kind == "file":
                on_total(len(event[1].todo))
            elif kind == "page":
                pending.append(event[1:])
            elif kind == "done":
                finished.append(event[1])
            if len(pending) >= batch_size or (kind in ("done", "failed") and not pending):
                _store_batch(pending, store, model, identity, batch_size, on_pages)
                pending = []
                finished = _finish(finished, store, result)
        _store_batch(pending, store, model, identity, batch_size, on_pages)
        _finish(finished, store, result)
    finally:
        renderer.stop.set()
        while renderer.is_alive():  # unblock a renderer waiting on a full queue
            try:
                renderer.events.get(timeout=0.1)
            except queue.Empty:
                pass
        store.flush()


def _store_batch(pending, store, model, identity, batch_size, on_pages) -> None:
    """Embed pending pages and upsert their points; a page the model refuses fails its file."""
    while pending:
        try:
            embedded = model.embed_pages([image for _, _, image in pending], batch_size=batch_size)
            bad = None
        except InputError as e:
            embedded, bad = getattr(e, "completed", []), e
        points = [make_point(vectors, layout, _payload(plan, page, identity))
                  for (plan, page, _), (vectors, layout) in zip(pending, embedded)]
        store.upsert(points)
        for plan, _, _ in pending[:len(embedded)]:
            plan.stored += 1
        on_pages(len(embedded))
        if bad is None:
            return
        plan, page, _ = pending[len(embedded)]
        plan.failed = f"page {page}: {bad.reason}"
        pending = [p for p in pending[len(embedded) + 1:] if p[0] is not plan]


def _payload(plan: _Plan, page: int, identity: dict[str, Any]) -> dict[str, Any]:
    width, height = plan.size[page]
    return dict(identity, path=str(plan.path), page=page, pages=plan.pages, sha256=plan.sha256,
                width=width, height=height)


def _finish(finished: list[_Plan], store, result: AddResult) -> list[_Plan]:
    """Report files whose pages are all stored (dropping their older version); keep the rest."""
    waiting = []
    for plan in finished:
        if plan.failed:
            result.failed.append(FileReport(str(plan.path), plan.stored, plan.failed))
        elif plan.stored < len(plan.todo):
            waiting.append(plan)
        else:
            store.delete(plan.stale)
            if plan.todo:
                result.added.append(FileReport(str(plan.path), len(plan.todo),
                                               "replaced an older version" if plan.stale else ""))
            else:
                result.skipped.append(FileReport(str(plan.path), 0, "already indexed"))
    return waiting
