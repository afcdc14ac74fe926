"""numpy's BLAS held to one thread for the calls that are too small to share.

Why: OpenBLAS (numpy's wheels) splits even a (800 x 128) @ (128 x 16) product over every core and
spin-waits for its helper threads. When those cores are busy (onnxruntime embedding the next page,
Qdrant Edge writing, another process), each such call waits for a descheduled thread: on the
2-core EPYC a page's k-means (tokens.page_centroids) took 0.53 s with two BLAS threads beside one
busy writer and 0.03 s with one (the same work: ~6 ms on a quiet core). The small products of the
ingest path and the scorer's per-worker GEMMs therefore run single-threaded, each thread its own.

OpenBLAS >= 0.3.27 has a per-calling-thread limit (`openblas_set_num_threads_local`, returning the
previous value), so the limit does not leak into other threads' large GEMMs. It is found in the
OpenBLAS numpy loaded (/proc/self/maps); with another BLAS or OS the calls run as they did.
numpy and the standard library only.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from typing import Callable, Iterator

_LIMIT: Callable[[int], int] | None | bool = False  # not looked up yet


def local_thread_limit() -> Callable[[int], int] | None:
    """`openblas_set_num_threads_local` of the OpenBLAS numpy loaded (sets this thread's BLAS
    thread count, returns the previous one), or None (another BLAS, another OS, an older
    OpenBLAS). Looked up once."""
    global _LIMIT
    if _LIMIT is False:
        _LIMIT = _find_local_limit()
    return _LIMIT  # type: ignore[return-value]


def _find_local_limit() -> Callable[[int], int] | None:
    import numpy  # noqa: F401  (loads the BLAS whose mapping is searched)

    try:
        with open("/proc/self/maps") as maps:
            paths = {
                line.split()[-1]
                for line in maps
                if "openblas" in line.lower() and line.split()[-1].startswith("/")
            }
    except OSError:
        return None
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).openblas_set_num_threads_local
        except (OSError, AttributeError):
            continue
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
        return fn
    return None


@contextmanager
def one_thread() -> Iterator[None]:
    """numpy's BLAS calls made by this thread inside the block use one thread."""
    limit = local_thread_limit()
    if limit is None:
        yield
        return
    previous = limit(1)
    try:
        yield
    finally:
        limit(previous)
