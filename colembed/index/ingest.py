"""Indexing a list of documents: plan per file, render in one thread, embed, write in another.

    render thread (pdfium is not thread-safe: the only thread that touches it)
      file -> sha256 -> plan against the store's catalog and the files before it in this run
      -> render the pages no stored point holds -> events (at most `RENDER_AHEAD` pages ahead)
    embedding thread (the caller)
      pages -> model.embed_pages in batches -> jobs for the writer
    writer thread (jobs in order, at most `WRITE_AHEAD` waiting)
      pooled vectors + upsert; copies of stored points; a file's end: drop its older version's
      points, report it

Embedding is the expensive part, so a page is embedded once per content, not per path: a file
whose content (sha256) is already stored under another path (moved, renamed, copied) gets those
points copied under its own ids and path; two identical files in one run are embedded once, the
second copied when the first is done. `prune` later drops the old path's points.

Resumable and idempotent: point ids come from (sha256, page, path); a stored page is never
embedded again; a point is one upsert with all its vectors, so a killed run leaves whole pages only
and the next run does the rest. A page that fails (rendering or the model) does not stop its
file: the other pages are stored, the file is reported failed naming each bad page, and a re-run
tries only those pages again, so it ends with the store an uninterrupted run makes. Any exception
on a page (a decoder's, the model's, a MemoryError) is that page's failure; an exception in a
thread outside any page ends the run with that error, never with a short run reported as done.
What a page's payload, a stale page and a file's report are is decided in records.py, shared
with colembed.distributed.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from .metadata import merged
from .records import (
    AddResult,
    Catalog,
    FileReport,
    ModelIdentity,
    embed_keeping_going,  # noqa: F401
    file_report,
    page_failure,
    page_payload,
    stale_ids,
)
from .schema import META_FIELD, PagePoint, make_point, point_id
from .sources import Document, SourceError, open_source, sha256_of
from .store import UPSERT_BATCH

RENDER_AHEAD = 8  # pages rendered ahead of the model (at least two batches)
WRITE_AHEAD = 4  # jobs waiting for the writer
# File events (reports, copies, stale deletions) waiting behind a partial batch: past this many,
# the partial batch is embedded now, so a run of skipped files after one changed page is written
# (and survives a kill) as it goes instead of at the end.
HELD_LIMIT = 64


@dataclass
class _Plan:
    """One file's work. `todo`: pages to render and embed; `reuse`: page -> id of a stored point
    of the same content elsewhere; `follows`: an earlier file of this run with the same content
    (its points are copied once it is done); `stale`: points of an older version of this file."""

    path: Path
    sha256: str
    pages: int
    have: set[int]
    stale: list[str]
    todo: list[int] = field(default_factory=list)
    reuse: dict[int, str] = field(default_factory=dict)
    follows: _Plan | None = None
    size: dict[int, tuple[int, int]] = field(default_factory=dict)
    text: dict[int, str | None] = field(default_factory=dict)  # page -> its PDF text layer
    errors: dict[int, str] = field(default_factory=dict)
    stored: int = 0
    reused: int = 0
    reused_from: str = ""

    @property
    def expected(self) -> int:
        """Points this run should write for the file."""
        copies = self.pages - len(self.have) if self.follows else len(self.reuse)
        return len(self.todo) + copies


class _Renderer(threading.Thread):
    """Plans and renders every file in order, posting events to `events`. A file or page that
    fails is an event; anything that escapes (it should not) is kept in `error` and raised by the
    caller, so the run cannot end early looking complete."""

    def __init__(
        self,
        files: list[Path],
        catalog: Catalog,
        *,
        max_pixels: int,
        dpi: float | None,
        ahead: int,
        source: str,
        within=None,
    ) -> None:
        super().__init__(name="colembed-render", daemon=True)
        self.files, self.catalog, self.source, self.within = files, catalog, source, within
        self.max_pixels, self.dpi = max_pixels, dpi
        self.events: queue.Queue = queue.Queue(maxsize=ahead)
        self.stop = threading.Event()
        self.claimed: dict[str, _Plan] = {}  # sha256 -> the first file of this run with it
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for path in self.files:
                if self.stop.is_set():
                    return
                self._one(path)
        except BaseException as e:  # noqa: BLE001 (raised again by ingest)
            self.error = e
        finally:
            self.events.put(("end",))

    def _one(self, path: Path) -> None:
        plan, posted = None, False
        try:
            # opened once: the bytes hashed are the bytes decoded (sources.py)
            with open_source(path, self.within) as handle:
                sha = sha256_of(handle, path)
                plan = self._plan(path, sha, None)
                if plan is not None and not plan.todo:  # nothing to render: not decoded
                    self.claimed.setdefault(sha, plan)
                    self.events.put(("file", plan))
                    posted = True
                else:
                    with Document(
                        path, max_pixels=self.max_pixels, dpi=self.dpi, handle=handle, sha256=sha
                    ) as doc:
                        plan = self._plan(path, sha, doc.pages)
                        self.claimed.setdefault(sha, plan)
                        self.events.put(("file", plan))
                        posted = True
                        self._render(doc, plan)
        except Exception as e:  # noqa: BLE001 (a file that cannot be read fails, the run goes on)
            reason = e.reason if isinstance(e, SourceError) else page_failure(0, e)
            if not posted:
                self.events.put(("failed", path, reason))
                return
            plan.errors.update(
                {n: reason for n in plan.todo if n not in plan.size and n not in plan.errors}
            )
        self.events.put(("done", plan))

    def _plan(self, path: Path, sha: str, count: int | None) -> _Plan | None:
        """The file's plan; None when its page count is unknown without opening it."""
        have = self.catalog.have(str(path), sha)
        stale = stale_ids(self.catalog, str(path), sha, self.source)
        first = self.claimed.get(sha)
        if first is not None:
            return _Plan(path, sha, first.pages, have, stale, follows=first)
        count = count or self.catalog.pages.get(sha)
        if count is None:
            return None
        elsewhere = self.catalog.by_sha.get(sha, {})
        missing = [n for n in range(1, count + 1) if n not in have]
        return _Plan(
            path,
            sha,
            count,
            have,
            stale,
            todo=[n for n in missing if n not in elsewhere],
            reuse={n: elsewhere[n] for n in missing if n in elsewhere},
        )

    def _render(self, doc: Document, plan: _Plan) -> None:
        for page in plan.todo:
            if self.stop.is_set():
                return
            try:
                image = doc.page_image(page)
            except Exception as e:  # noqa: BLE001 (MemoryError on a poster page: that page fails)
                plan.errors[page] = page_failure(page, e)
                continue
            plan.size[page] = image.size
            try:
                plan.text[page] = doc.text(page)
            except SourceError:  # the page's pixels are indexed; it has no text to keep
                plan.text[page] = None
            self.events.put(("page", plan, page, image))

    def iter_events(self) -> Iterator[tuple]:
        while (event := self.events.get())[0] != "end":
            yield event

    def finish(self) -> None:
        self.stop.set()
        while self.is_alive():  # unblock a renderer waiting on a full queue
            try:
                self.events.get(timeout=0.1)
            except queue.Empty:
                pass


class _Writer(threading.Thread):
    """Runs store jobs in order off the embedding thread; the first failure is kept in `error`
    (raised by `put` in the embedding thread) and later jobs are dropped."""

    def __init__(
        self,
        store,
        identity: ModelIdentity,
        source: str,
        result: AddResult,
        on_pages: Callable[[int], None],
        metadata: dict[str, dict[str, Any]] | None = None,
        catalog: Catalog | None = None,
    ) -> None:
        super().__init__(name="colembed-write", daemon=True)
        self.store, self.identity, self.source = store, identity, source
        self.metadata = metadata or {}  # path -> the checked metadata this run gives the file
        self.catalog = catalog or Catalog()
        self.result, self.on_pages = result, on_pages
        self.jobs: queue.Queue = queue.Queue(maxsize=WRITE_AHEAD)
        self.error: BaseException | None = None
        self.end_sent = False
        # Set as the last thing run() does. The run waits on this flag, never on Thread.join() or
        # is_alive(): on CPython 3.11 a Ctrl-C that lands inside join() can mark a running thread
        # stopped (bpo-45274's handling releases the lock the live thread holds), and the wait
        # would end with pages still in the queue.
        self.ended = threading.Event()

    def put(self, job: tuple) -> None:
        if self.error is not None:
            raise self.error
        self.jobs.put(job)

    def run(self) -> None:
        try:
            while (job := self.jobs.get())[0] != "end":
                if self.error is None:
                    try:
                        getattr(self, f"_{job[0]}")(*job[1:])
                    except BaseException as e:  # noqa: BLE001 (raised in the embedding thread)
                        self.error = e
        finally:
            self.ended.set()

    def finish(self) -> None:
        """Let the writer finish its queue and stop. Idempotent: `_to_the_end` runs it again
        when a Ctrl-C interrupts it. The wait polls `ended` with sleeps (only the main thread
        gets Ctrl-C, and an interrupted sleep leaves no lock or thread state half-changed),
        so however many Ctrl-Cs arrive, it ends only when the writer's run() has."""
        self._put_end()
        while not self.ended.is_set():
            time.sleep(0.05)

    def _put_end(self) -> None:
        while not self.end_sent:
            try:
                self.jobs.put(("end",), timeout=0.1)
                self.end_sent = True
            except queue.Full:
                if self.ended.is_set():
                    return

    def _points(self, embedded: list[tuple[_Plan, int, Any, Any]]) -> None:
        """Pool and store embedded pages. A page whose pooling fails (a MemoryError on a huge
        grid, say) is that page's failure, as an embedding failure is: its file is reported
        failed naming it, the other pages are stored, a re-run tries it again."""
        points = []
        for plan, page, vectors, layout in embedded:
            try:
                points.append(
                    (
                        plan,
                        make_point(
                            vectors,
                            layout,
                            page_payload(
                                self.identity,
                                path=str(plan.path),
                                page=page,
                                pages=plan.pages,
                                sha256=plan.sha256,
                                size=plan.size[page],
                                source=self.source,
                                meta=self._meta(plan),
                                text=plan.text.get(page),
                            ),
                        ),
                    )
                )
            except Exception as e:  # noqa: BLE001 (that page fails, the run goes on)
                plan.errors[page] = page_failure(page, e)
        if points:
            self.store.upsert([point for _, point in points])
        for plan, _ in points:
            plan.stored += 1
        self.on_pages(len(points))

    def _copy(self, plan: _Plan) -> None:
        """Store `plan`'s pages from stored points of the same content under its ids and path."""
        if plan.follows is None:
            sources = plan.reuse
        else:
            first = plan.follows
            sources = {
                n: point_id(plan.sha256, n, str(first.path))
                for n in range(1, plan.pages + 1)
                if n not in plan.have
            }
            plan.errors.update(
                {
                    n: f"{why} (as in {first.path})"
                    for n, why in first.errors.items()
                    if n in sources
                }
            )
        pages = sorted(n for n in sources if n not in plan.errors)
        for lo in range(0, len(pages), UPSERT_BATCH):
            chunk = pages[lo : lo + UPSERT_BATCH]
            found = self.store.points([sources[n] for n in chunk])
            copies = [
                self._copied(found[sources[n]], plan, n) for n in chunk if sources[n] in found
            ]
            plan.errors.update(
                {
                    n: "its stored vectors vanished during the run"
                    for n in chunk
                    if sources[n] not in found
                }
            )
            self.store.upsert(copies)
            if found and not plan.reused_from:
                plan.reused_from = next(iter(found.values())).payload.get("path", "")
            plan.stored += len(copies)
            plan.reused += len(copies)
            self.on_pages(len(copies))

    def _copied(self, source: PagePoint, plan: _Plan, page: int) -> PagePoint:
        """`source` (a stored page of the same content) as page `page` of `plan`'s file: its
        vectors and text, with the metadata of this path (never the other path's: metadata may
        say who may see a file)."""
        payload = dict(
            source.payload, **self.identity.payload(), path=str(plan.path), source=self.source
        )
        payload.pop(META_FIELD, None)
        meta = self._meta(plan)
        if meta:
            payload[META_FIELD] = meta
        return PagePoint(point_id(plan.sha256, page, str(plan.path)), source.vectors, payload)

    def _meta(self, plan: _Plan) -> dict[str, Any]:
        """A new page's metadata: the file's older version's (same path, replaced), updated with
        what this run gives the file."""
        base = next((self.catalog.meta[i] for i in plan.stale if i in self.catalog.meta), {})
        return merged(base, self.metadata.get(str(plan.path), {}))

    def _done(self, plan: _Plan) -> None:
        """Every page of the file was tried: its stored pages get this run's metadata, its
        older version goes, it is reported."""
        given = self.metadata.get(str(plan.path))
        if given:
            ids = [point_id(plan.sha256, n, str(plan.path)) for n in plan.have]
            changes: dict[str, list[str]] = {}
            for pid in ids:
                stored = self.catalog.meta.get(pid, {})
                new = merged(stored, given)
                if new != stored:
                    changes.setdefault(repr(sorted(new.items())), []).append(pid)
                    self.catalog.meta[pid] = new
            for group in changes.values():
                self.store.set_payload(group, {META_FIELD: self.catalog.meta[group[0]]})
        self.store.delete(plan.stale)
        file_report(
            self.result,
            str(plan.path),
            pages=plan.pages,
            stored=plan.stored,
            had=len(plan.have),
            errors=plan.errors,
            stale=bool(plan.stale),
            reused=plan.reused,
            reused_from=plan.reused_from,
        )
        self.on_pages(0)  # a progress callback sees the file's report now

    def _failed(self, path: Path, reason: str) -> None:
        self.result.failed.append(FileReport(str(path), reason=reason))
        self.on_pages(0)


def ingest(
    files: list[Path],
    store,
    model,
    identity: ModelIdentity,
    *,
    dpi: float | None,
    batch_size: int,
    result: AddResult,
    on_pages: Callable[[int], None],
    on_total: Callable[[int], None],
    source: str,
    stop: threading.Event | None = None,
    metadata: dict[str, dict[str, Any]] | None = None,
    within=None,
) -> None:
    """Index `files` into `store` with `model`, filling `result` (see the module docstring).
    `stop` set: the pages already embedded are written and the run ends (files not finished
    get no report; their stored pages are whole, and the next run does the rest). `metadata`:
    path -> checked metadata (metadata.py) merged into each page of that file, stored or new.
    `within`: the folders every file must lie in when it is opened (sources.open_source)."""
    catalog = Catalog.of(store.payloads())
    renderer = _Renderer(
        files,
        catalog,
        max_pixels=model.config.max_pixels,
        dpi=dpi,
        ahead=max(RENDER_AHEAD, 2 * batch_size),
        source=source,
        within=within,
    )
    writer = _Writer(store, identity, source, result, on_pages, metadata, catalog)
    renderer.start()
    writer.start()
    pending: list[tuple[_Plan, int, Any]] = []
    held: list[tuple] = []  # file events waiting for the pages before them to be embedded
    failure: BaseException | None = None
    try:
        for event in renderer.iter_events():
            if stop is not None and stop.is_set():
                pending, held = [], []  # unembedded pages and unfinished files: the next run's
                break
            kind = event[0]
            if kind == "page":
                pending.append(event[1:])
            elif kind == "file":
                on_total(event[1].expected)
                if event[1].reuse or event[1].follows:
                    held.append(("copy", event[1]))
            else:
                held.append(event)
            if len(pending) >= batch_size or (held and not pending) or len(held) >= HELD_LIMIT:
                _embed(pending, model, writer, batch_size)
                pending = []
                for job in held:
                    writer.put(job)
                held = []
        _embed(pending, model, writer, batch_size)
        for job in held:
            writer.put(job)
    except BaseException as e:
        failure = e
        raise
    finally:
        interrupted = _to_the_end(renderer.finish, writer.finish)
        try:
            store.flush()
        except Exception as e:  # noqa: BLE001 (never hide the error that ended the run)
            if failure is None and writer.error is None and renderer.error is None:
                raise
            (failure or writer.error or renderer.error).add_note(
                f"flushing the index then failed too: {e}"
            )
        if interrupted is not None and failure is None:
            raise interrupted
    if writer.error is not None:
        raise writer.error
    if renderer.error is not None:
        raise renderer.error


def _to_the_end(*steps: Callable[[], None]) -> KeyboardInterrupt | None:
    """Run each cleanup step to its end, in order, through any Ctrl-C: an interrupted step is
    run again (each is idempotent) and the interrupt is returned, to be raised once the threads
    have stopped. So a second Ctrl-C while the first is being handled can neither leave the
    writer running while the store is closed under it nor drop the pages already handed to it."""
    interrupted = None
    for step in steps:
        while True:
            try:
                step()
                break
            except KeyboardInterrupt as e:
                interrupted = e
    return interrupted


def _embed(pending: list[tuple[_Plan, int, Any]], model, writer: _Writer, batch_size: int) -> None:
    """Embed pending pages and hand their vectors to the writer; a page that fails (the model
    refuses it, or anything else) is recorded in its file's errors and the others go on."""
    if not pending:
        return

    def hand(first: int, results: list) -> None:
        writer.put(
            (
                "points",
                [
                    (plan, page, vectors, layout)
                    for (plan, page, _), (vectors, layout) in zip(pending[first:], results)
                ],
            )
        )

    errors = embed_keeping_going(model, [image for _, _, image in pending], batch_size, hand)
    for i, why in errors.items():
        plan, page, _ = pending[i]
        plan.errors[page] = why
