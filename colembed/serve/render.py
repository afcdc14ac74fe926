"""Page images rendered again, in worker processes: `GET /v1/pages/{id}/image` and `/map`.

Its own module: the worker processes import this (and colembed.index.index), not the web app.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
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


PARENT_POLL_S = 1.0  # how often a worker checks that its server is alive (the portable watch)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _exit_with_parent(parent: int) -> None:
    """A render worker's initializer: the worker exits when its server process dies, however it
    dies (a SIGKILL included). On Linux the kernel signals it at once (PR_SET_PDEATHSIG); on
    every POSIX system a thread sees the worker re-parented (its parent id changes) within
    `PARENT_POLL_S`. The kernel signal comes when the *thread* that started the worker ends,
    which may be before the process does: the handler exits only once the parent is gone."""

    def parent_gone(*_) -> None:
        if os.getppid() != parent:
            os._exit(0)

    if sys.platform.startswith("linux"):
        import ctypes

        signal.signal(signal.SIGUSR1, parent_gone)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGUSR1), 0, 0, 0)
    parent_gone()  # the server died before the signal was armed

    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            parent_gone()

    threading.Thread(target=watch, name="colembed-render-parent-watch", daemon=True).start()


class PageRenderer:
    """Page images rendered again in `workers` processes of their own (spawned, never forked).

    pdfium is not thread-safe and an index job's renderer is already using it in this process;
    in a worker process a page request never waits for a job (nor a job for it), and a renderer
    that dies (a hostile PDF crashing pdfium) takes only its worker: the pool is started again and
    the request retried once. A worker exits when the server's process dies (`_exit_with_parent`). Bounded: at most `workers` renders at once; the requests themselves
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

        executor = ProcessPoolExecutor(
            self.workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_exit_with_parent,
            initargs=(os.getpid(),),
        )
        executor.submit(int)  # start a worker now: the first page request does not pay for it
        return executor

    def render(self, hit):
        from concurrent.futures.process import BrokenProcessPool

        for attempt in (1, 2):
            executor = self._executor
            try:
                image, refused = executor.submit(
                    _render, hit.file, hit.page, dict(hit.payload), self.options
                ).result()
            except BrokenProcessPool:
                log.error(
                    "a page-render process died (rendering %s page %d); starting another",
                    hit.file,
                    hit.page,
                )
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
