"""Index jobs: `POST /v1/index` queues one, a thread of its own runs them one at a time.

A job is the same ingestion as `colembed index`: one `Index.add` call over the job's files
(resumable, stored pages skipped, moved files copied, a bad file reported and the rest indexed;
the store's catalog read once). `Index.add`'s `on_progress` callback updates the job after every
batch of pages stored and every file reported, so `GET /v1/jobs/{id}` advances per page: pages
stored and planned, pages/s, files done, failures with their reasons as they happen. Shutdown
sets the call's `stop` event: the pages being embedded are written (each whole) and the job ends
`cancelled`; running it again does the rest. Paths were confined to their roots when the job was
accepted (`roots.py`) and are checked again when the job runs: the job hands `Index.add`
resolved paths and the roots as `within`, so each file is opened inside its root with no link
followed (a file swapped for a link after the job was accepted is refused, not read). Reasons
are shown with paths in the roots' naming (`public.py`), never the server's absolute paths.

pdfium is not thread-safe, and the job's renderer is the only thread of this process that calls
it: page images are rendered in worker processes of their own (`app.py`), so they never wait for
a job.
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

from .public import public_message
from .roots import Root, Roots

KEEP_FINISHED = 100  # finished jobs remembered for GET /v1/jobs/{id}


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
    pages_stored: int = 0  # pages written so far (embedded or copied), per batch
    pages_planned: int = 0  # pages the files seen so far need (grows as files are opened)
    pages_added: int = 0  # of finished files, from their reports
    pages_reused: int = 0
    added: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    failed: list[dict] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        end = self.finished or time.time()
        elapsed = (end - self.started) if self.started else 0.0
        return {
            "id": self.id,
            "state": self.state,
            "created": self.created,
            "started": self.started,
            "finished": self.finished,
            "elapsed_s": round(elapsed, 3),
            "files_total": self.files_total,
            "files_done": self.files_done,
            "pages_stored": self.pages_stored,
            "pages_planned": self.pages_planned,
            "pages_added": self.pages_added,
            "pages_reused": self.pages_reused,
            "pages_per_s": round(self.pages_stored / elapsed, 3) if elapsed > 0 else 0.0,
            "added": list(self.added),
            "skipped": list(self.skipped),
            "failed": list(self.failed),
            "error": self.error,
        }


class JobQueueFull(Exception):
    pass


class JobRunner:
    def __init__(self, index, roots: Roots, *, max_queued: int = 8) -> None:
        self.index, self.roots = index, roots
        self.max_queued = max_queued
        self.jobs: dict[str, Job] = {}
        self._finished: collections.deque[str] = collections.deque()
        self._queue: collections.deque[Job] = collections.deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._stop = threading.Event()  # Index.add's: set at shutdown
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
                raise JobQueueFull(
                    f"{len(self._queue)} index jobs are queued (the limit, "
                    "--max-queued-jobs); retry when one is done"
                )
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
            seen = {"added": 0, "skipped": 0, "failed": 0}  # reports already copied to the job
            skipped_before = len(job.skipped)

            def on_progress(stored: int, planned: int, result) -> None:
                """Called by Index.add's writer thread per batch of pages and per file."""
                job.pages_stored, job.pages_planned = stored, planned
                for report in result.added[seen["added"] :]:
                    job.pages_added += report.pages
                    job.pages_reused += report.reused
                    job.added.append(
                        {"file": self.roots.display(report.path), "pages": report.pages}
                    )
                for report in result.skipped[seen["skipped"] :]:
                    job.skipped.append(
                        {"file": self.roots.display(report.path), "reason": report.reason}
                    )
                for report in result.failed[seen["failed"] :]:
                    job.failed.append(
                        {
                            "file": self.roots.display(report.path),
                            "reason": public_message(report.reason, self.roots, [report.path]),
                        }
                    )
                seen.update(
                    added=len(result.added), skipped=len(result.skipped), failed=len(result.failed)
                )
                job.files_done = (
                    len(job.added) + len(job.skipped) - skipped_before + len(job.failed)
                )

            if files and not self._stop.is_set():
                result = self.index.add(
                    files,
                    progress=False,
                    on_progress=on_progress,
                    stop=self._stop,
                    within=[r.folder for r in self.roots.roots],
                )
                on_progress(job.pages_stored, job.pages_planned, result)
            if self._stop.is_set() and job.files_done < len(files):
                job.state = "cancelled"
                job.error = "the server shut down; run the job again to index the rest"
            else:
                job.state = "done"
        except Exception as e:  # noqa: BLE001 (a job must never take the server down)
            job.state = "failed"
            job.error = f"{type(e).__name__}: {public_message(str(e), self.roots)}"
            traceback.print_exc()
        finally:
            job.finished = time.time()

    def _own_folders(self) -> tuple[Path, ...]:
        location = Path(str(self.index.store.location))
        return (location,) if location.is_dir() else ()  # a server's url is no folder

    def _remember(self, job: Job) -> None:
        self._finished.append(job.id)
        while len(self._finished) > KEEP_FINISHED:
            self.jobs.pop(self._finished.popleft(), None)

    def shutdown(self, timeout: float | None = None) -> None:
        """Cancel queued jobs, stop the running one once the pages being embedded are written,
        wait for it."""
        with self._wake:
            self._stopping = True
            self._stop.set()
            for job in self._queue:
                job.state, job.finished = "cancelled", time.time()
                job.error = "the server shut down before the job started"
            self._queue.clear()
            self._wake.notify_all()
        self._thread.join(timeout)
