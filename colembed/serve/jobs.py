"""Index jobs: `POST /v1/index` queues one, a thread of its own runs them one at a time.

A job is the same ingestion as `colembed index` (`Index.add`: resumable, stored pages skipped,
moved files copied, a bad file reported and the rest indexed), called `FILES_PER_CALL` files at a
time so that the job reports progress (files done, pages added, pages/s, the files at work) and
can stop between calls: shutdown cancels a job at the next call's boundary, and a killed
process loses at most the pages not yet written (the index stores a page whole or not at all;
running the job again does the rest). Paths were confined to their roots when the job was
accepted (`roots.py`); the job hands `Index.add` resolved paths only.

pdfium is not thread-safe: while a job indexes a PDF it holds `render_lock`, which page-image
requests for PDFs also take (`app.py`), so two threads never render at once.
"""

from __future__ import annotations

import collections
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .roots import Root, Roots

KEEP_FINISHED = 100  # finished jobs remembered for GET /v1/jobs/{id}
# Files per `Index.add` call: progress and cancellation happen between calls, and each call reads
# the store's catalog (every payload: 1.5-2 s at 10,000 pages on this loaded 2-core machine), so
# one file per call would cost that per file; 8 keeps it to a fraction of embedding a page.
FILES_PER_CALL = 8


@dataclass
class Job:
    id: str
    targets: list[tuple[Root, Path]]
    state: str = "queued"  # queued, running, done, failed, cancelled
    created: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    files_total: int | None = None
    files_done: int = 0
    pages_added: int = 0
    pages_reused: int = 0
    current: str | None = None
    added: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    failed: list[dict] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        end = self.finished or time.time()
        elapsed = (end - self.started) if self.started else 0.0
        return {
            "id": self.id, "state": self.state, "created": self.created, "started": self.started,
            "finished": self.finished, "elapsed_s": round(elapsed, 3),
            "files_total": self.files_total, "files_done": self.files_done,
            "pages_added": self.pages_added, "pages_reused": self.pages_reused,
            "pages_per_s": round(self.pages_added / elapsed, 3) if elapsed > 0 else 0.0,
            "current_file": self.current, "added": self.added, "skipped": self.skipped,
            "failed": self.failed, "error": self.error,
        }


class JobQueueFull(Exception):
    pass


class JobRunner:
    def __init__(self, index, roots: Roots, *, render_lock: threading.Lock,
                 max_queued: int = 8) -> None:
        self.index, self.roots, self.render_lock = index, roots, render_lock
        self.max_queued = max_queued
        self.jobs: dict[str, Job] = {}
        self._finished: collections.deque[str] = collections.deque()
        self._queue: collections.deque[Job] = collections.deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="colembed-serve-jobs", daemon=True)
        self._thread.start()

    @property
    def running(self) -> Job | None:
        return next((j for j in self.jobs.values() if j.state == "running"), None)

    def submit(self, targets: list[tuple[Root, Path]]) -> Job:
        with self._wake:
            if self._stopping:
                raise JobQueueFull("the server is shutting down")
            if len(self._queue) >= self.max_queued:
                raise JobQueueFull(f"{len(self._queue)} index jobs are queued (the limit, "
                                   "--max-queued-jobs); retry when one is done")
            job = Job(uuid.uuid4().hex, targets)
            self.jobs[job.id] = job
            self._queue.append(job)
            self._wake.notify()
        return job

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    return
                job = self._queue.popleft()
            self._run(job)
            self._remember(job)

    def _run(self, job: Job) -> None:
        job.state, job.started = "running", time.time()
        try:
            files: list[Path] = []
            for root, target in job.targets:
                found, left = self.roots.files(root, target, exclude=self._own_folders())
                files.extend(found)
                job.skipped.extend({"file": self.roots.display(p), "reason": r} for p, r in left)
            files = list(dict.fromkeys(files))
            job.files_total = len(files)
            for start in range(0, len(files), FILES_PER_CALL):
                if self._stopping:
                    job.state = "cancelled"
                    job.error = "the server shut down; run the job again to index the rest"
                    return
                batch = files[start:start + FILES_PER_CALL]
                job.current = self.roots.display(batch[0]) + (
                    f" (+{len(batch) - 1} more)" if len(batch) > 1 else "")
                self._add_some(job, batch)
                job.files_done += len(batch)
            job.state = "done"
        except Exception as e:  # noqa: BLE001 (a job must never take the server down)
            job.state, job.error = "failed", f"{type(e).__name__}: {e}"
            traceback.print_exc()
        finally:
            job.current, job.finished = None, time.time()

    def _own_folders(self) -> tuple[Path, ...]:
        location = Path(str(self.index.store.location))
        return (location,) if location.is_dir() else ()  # a server's url is no folder

    def _add_some(self, job: Job, paths: list[Path]) -> None:
        pdf = any(p.suffix.lower() == ".pdf" for p in paths)
        if pdf:
            self.render_lock.acquire()
        try:
            result = self.index.add(paths, progress=False)
        finally:
            if pdf:
                self.render_lock.release()
        for report in result.added:
            job.pages_added += report.pages
            job.pages_reused += report.reused
            job.added.append({"file": self.roots.display(report.path), "pages": report.pages})
        for report in result.skipped:
            job.skipped.append({"file": self.roots.display(report.path), "reason": report.reason})
        for report in result.failed:
            job.failed.append({"file": self.roots.display(report.path), "reason": report.reason})

    def _remember(self, job: Job) -> None:
        self._finished.append(job.id)
        while len(self._finished) > KEEP_FINISHED:
            self.jobs.pop(self._finished.popleft(), None)

    def shutdown(self, timeout: float | None = None) -> None:
        """Cancel queued jobs, stop the running one after its current call, wait for it."""
        with self._wake:
            self._stopping = True
            for job in self._queue:
                job.state, job.finished = "cancelled", time.time()
                job.error = "the server shut down before the job started"
            self._queue.clear()
            self._wake.notify_all()
        self._thread.join(timeout)
