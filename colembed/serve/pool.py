"""The bounded worker pool: model and store calls run here, never on the event loop.

`workers` threads run calls (onnxruntime releases the GIL, and each run already uses the
machine's cores, so 1-2 workers is right on a small machine); up to `queue` more calls wait.
A call beyond that is refused at once with `Busy` (the app answers 503 with Retry-After), so a
burst costs memory for at most `workers + queue` requests and the event loop stays free to answer
`/healthz`, refusals and the page.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class Busy(Exception):
    """Every worker is busy and the queue is full."""

    def __init__(self, limit: int, retry_after: int, message: str | None = None) -> None:
        self.limit, self.retry_after = limit, retry_after
        super().__init__(
            message
            or f"server busy: {limit} requests running or queued "
            f"(--workers + --queue); retry after {retry_after} s"
        )


class WorkerPool:
    def __init__(self, workers: int, queue: int, retry_after: int = 1) -> None:
        if workers < 1 or queue < 0:
            raise ValueError("workers must be >= 1 and queue >= 0")
        self.workers, self.queue, self.retry_after = workers, queue, retry_after
        self.limit = workers + queue
        self._executor = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="colembed-serve"
        )
        self._lock = threading.Lock()
        self._pending = 0
        self.refused = 0

    @property
    def pending(self) -> int:
        return self._pending

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        with self._lock:
            if self._pending >= self.limit:
                self.refused += 1
                raise Busy(self.limit, self.retry_after)
            self._pending += 1
        try:
            future = self._executor.submit(fn, *args)
            # A client that goes away cancels its await, not the call: the pending count is
            # released when the call really ends, so the bound always counts running work.
            future.add_done_callback(self._release)
        except BaseException:
            self._release(None)
            raise
        return await asyncio.wrap_future(future)

    def _release(self, _future) -> None:
        with self._lock:
            self._pending -= 1

    def shutdown(self) -> None:
        """Let running calls finish; calls still waiting are cancelled."""
        self._executor.shutdown(wait=True, cancel_futures=True)
