"""Connections that send nothing useful are closed, so slow clients cannot lock others out.

uvicorn (h11) bounds idle time between requests (`timeout_keep_alive`) but not the time a
client takes to send a request head: a socket that sends half a request line and stops is held
forever, and uvicorn's connection cap (`limit_concurrency`) then answers every request, /healthz
included, with 503. `GuardedH11Protocol` is uvicorn's own h11 protocol with two additions:

- **Head deadline.** From the moment a connection waits for a request head (opened, or its last
  response sent) the whole head must arrive within `HEAD_TIMEOUT_S`, however it trickles in;
  otherwise the connection is closed. Heads are capped at `MAX_HEAD_BYTES` (h11's buffer).
- **Eviction.** Past `max_open` open connections, a new connection closes the ones that have
  waited longest for a head: a connection that sends its request at once is served while any
  number of slow ones are held, and open sockets stay bounded.

A request whose head has arrived is the app's: its body is bounded by the key check (no body is
read before it, guards.py) and `--max-body-bytes`; the server-wide cap of uvicorn stays above
`max_open` as the last bound on requests in flight.
"""

from __future__ import annotations

import asyncio
import itertools
import weakref

from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 10.0  # a request head (line + headers) must arrive within this
KEEP_ALIVE_S = 5  # an idle connection between requests is closed after this (uvicorn's default)
MAX_HEAD_BYTES = 16 * 1024  # a longer request head is refused (400) by h11
MAX_OPEN = 1024  # open connections before the slowest waiting ones are closed
RESERVED_FDS = 128  # file descriptors kept for the model, the index and the render workers


# per uvicorn server: the connections waiting for a request head, oldest first
_waiting: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class GuardedH11Protocol(H11Protocol):
    head_timeout: float = HEAD_TIMEOUT_S
    max_open: int = MAX_OPEN

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._waiting_for = None  # the cycle before the head being waited for
        self._waiting = _waiting.setdefault(self.server_state, {})
        self._await_head()
        excess = len(self.connections) - self.max_open
        if excess > 0:
            waiting = self._waiting
            for slow in list(itertools.islice((p for p in waiting if p is not self), excess)):
                slow._close_slow()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_timer is not None and self.cycle is not self._waiting_for:
            self._head_arrived()  # a request started: its head is complete

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()
        if not self.transport.is_closing() and self.cycle is cycle:  # no pipelined request
            self._await_head()

    def connection_lost(self, exc) -> None:
        self._head_arrived()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        self._head_arrived()
        self._waiting_for = self.cycle
        self._head_timer = self.loop.call_later(self.head_timeout, self._close_slow)
        self._waiting[self] = None

    def _head_arrived(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._waiting.pop(self, None)

    def _close_slow(self) -> None:
        self._head_arrived()
        if not self.transport.is_closing():
            self.transport.close()
        # no longer counted against the bounds (uvicorn's too) while the close completes
        self.connections.discard(self)


def protocol_class(head_timeout: float = HEAD_TIMEOUT_S, max_open: int = MAX_OPEN) -> type:
    """`GuardedH11Protocol` with these bounds, for `uvicorn.Config(http=...)`."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"head_timeout": head_timeout, "max_open": max_open},
    )


def open_file_budget(wanted: int = MAX_OPEN + RESERVED_FDS) -> int:
    """Raise this process's soft limit on open files towards `wanted` (up to the hard limit);
    the number of connections it then leaves room for."""
    try:
        import resource
    except ImportError:  # Windows: no such limit on sockets
        return MAX_OPEN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    room = wanted if soft == resource.RLIM_INFINITY else soft - RESERVED_FDS
    return max(16, min(MAX_OPEN, room))
