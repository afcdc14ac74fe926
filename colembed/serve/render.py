"""Page images rendered again, in worker processes: `GET /v1/pages/{id}/image` and `/map`.

Its own module: the worker processes import this (and colembed.index.index), not the web app.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ..index.errors import SourceError

log = logging.getLogger("colembed.serve")


def _render(file: str, page: int, payload: dict[str, Any], options: dict[str, Any]):
    """In a worker: (image, None), or (None, (path, reason)) when the file changed or cannot be
    read (SourceError does not pickle: its constructor takes two arguments)."""
    from ..index.index import render_stored_page

    try:
        return render_stored_page(file, page, payload, **options), None
    except SourceError as e:
        return None, (str(e.path), e.reason)


class PageRenderer:
    """Page images rendered again in `workers` processes of their own (spawned, never forked).

    pdfium is not thread-safe and an index job's renderer is already using it in this process;
    in a worker process a page request never waits for a job (nor a job for it), and a renderer
    that dies (a hostile PDF crashing pdfium) takes only its worker: the pool is started again and
    the request retried once. Bounded: at most `workers` renders at once; the requests themselves
    are already bounded by the WorkerPool."""

    def __init__(self, workers: int, options: dict[str, Any]) -> None:
        if workers < 1:
            raise ValueError("render_workers must be >= 1")
        self.workers, self.options = workers, options
        self._lock = threading.Lock()
        self._executor = self._start()

    def _start(self):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        executor = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        executor.submit(int)  # start a worker now: the first page request does not pay for it
        return executor

    def render(self, hit):
        from concurrent.futures.process import BrokenProcessPool

        for attempt in (1, 2):
            executor = self._executor
            try:
                image, refused = executor.submit(_render, hit.file, hit.page, dict(hit.payload),
                                                 self.options).result()
            except BrokenProcessPool:
                log.error("a page-render process died (rendering %s page %d); starting another",
                          hit.file, hit.page)
                with self._lock:
                    if self._executor is executor:
                        self._executor = self._start()
                if attempt == 2:
                    raise
                continue
            if refused is not None:
                raise SourceError(*refused)
            return image

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
