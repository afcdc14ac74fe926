"""Time and peak memory per export step, read from /proc (Linux) without extra dependencies.

At the start of a step the kernel's peak-RSS mark is reset (`/proc/self/clear_refs`, "5"), so
`VmHWM` at its end is that step's own peak. Where the reset is not available (not Linux, or a
kernel refusing it) the figure is the process's peak so far (`ru_maxrss`), which is still an upper
bound. At the end of each step what it freed is handed back to the system (`release_memory`), so
the next step starts from what is really still held.

RSS counts the memory-mapped weight files' resident pages too (onnx_ir and an unpacked
onnxruntime session read external data through mmap): the kernel can drop those under pressure,
so a step's RSS peak overstates what it needs. Each step also records its peak anonymous memory
(`RssAnon`, what cannot be dropped), sampled every `ANON_SAMPLE_SECONDS` by a thread: the kernel
keeps no peak mark for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import resource
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

_GB = 1e9


def _status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def glibc_function(name: str):
    """glibc's function `name` (malloc_trim, mallopt), or None where there is no glibc (other
    systems, other C libraries: musl has neither)."""
    lib = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    try:
        return getattr(ctypes.CDLL(lib), name) if lib else None
    except (OSError, AttributeError):
        return None


def release_memory() -> None:
    """gc, then glibc's `malloc_trim`: freed tensors below glibc's mmap threshold (which grows to
    32 MB) otherwise stay in the heap, counted in RSS and unavailable to other processes."""
    gc.collect()
    malloc_trim = glibc_function("malloc_trim")
    if malloc_trim is not None:
        malloc_trim(0)


def peak_rss_bytes() -> int:
    """The peak RSS since the last reset (or since the process started)."""
    hwm = _status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def rss_bytes() -> int:
    return _status_bytes("VmRSS") or peak_rss_bytes()


ANON_SAMPLE_SECONDS = 0.05


class _AnonPeak:
    """The largest `RssAnon` seen since the last `restart`, sampled by a daemon thread between
    `start` and `stop` (None where /proc has no RssAnon: not Linux)."""

    def __init__(self) -> None:
        self.peak = _status_bytes("RssAnon")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.peak is None or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="colembed-anon-peak", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _sample(self) -> None:
        while not self._stop.wait(ANON_SAMPLE_SECONDS):
            self.take()

    def take(self) -> int | None:
        """Sample now; the peak so far."""
        now = _status_bytes("RssAnon")
        with self._lock:
            if now is not None and self.peak is not None:
                self.peak = max(self.peak, now)
            return self.peak

    def restart(self) -> int | None:
        """The peak so far (sampled now too), and a new mark from the current value."""
        now = _status_bytes("RssAnon")
        with self._lock:
            before, self.peak = self.peak, now
        return None if before is None or now is None else max(before, now)


@dataclass(frozen=True)
class StepRecord:
    step: str
    seconds: float
    peak_rss_gb: float  # this step's own peak when `per_step_peak`, else the process's so far
    rss_after_gb: float
    per_step_peak: bool
    parent: str | None = None  # the enclosing step of a sub-step (its peak includes this one's)
    peak_anon_gb: float | None = None  # this step's peak anonymous memory (sampled; else None)


@dataclass
class StepMeter:
    """`with meter.step("load"):` records the step and reports it through `progress`."""

    progress: Callable[[str], None]
    records: list[StepRecord] = field(default_factory=list)
    # enclosing steps, innermost last: [name, the largest peak of their finished sub-steps,
    # the same for anonymous memory]
    _open: list[list] = field(default_factory=list)
    _anon: _AnonPeak = field(default_factory=_AnonPeak)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """A step; nested inside another it is a sub-step (where a step's peak arises). A
        sub-step resets the kernel's peak mark, so the enclosing step's peak is the largest of
        its sub-steps' and of what it held itself after the last of them."""
        self.progress(name)
        parent = self._open[-1][0] if self._open else None
        if not self._open:
            self._anon.start()
        anon_before = self._anon.restart()
        if self._open:  # what the enclosing step peaked at before this sub-step
            self._open[-1][1] = max(self._open[-1][1], peak_rss_bytes())
            self._open[-1][2] = max(self._open[-1][2], anon_before or 0)
        own_peak = _reset_peak()
        start = time.perf_counter()
        self._open.append([name, 0, 0])
        try:
            yield
        finally:
            _, inner, inner_anon = self._open.pop()
        anon = self._anon.take()  # before release_memory: what the step itself held
        release_memory()
        peak = max(peak_rss_bytes(), inner)
        anon = None if anon is None else max(anon, inner_anon)
        if self._open:
            self._open[-1][1] = max(self._open[-1][1], peak)
            self._open[-1][2] = max(self._open[-1][2], anon or 0)
        self._anon.restart()  # the enclosing step goes on from what is held now
        if not self._open:
            self._anon.stop()
        record = StepRecord(
            step=name,
            seconds=round(time.perf_counter() - start, 2),
            peak_rss_gb=round(peak / _GB, 3),
            rss_after_gb=round(rss_bytes() / _GB, 3),
            per_step_peak=own_peak,
            parent=parent,
            peak_anon_gb=None if anon is None else round(anon / _GB, 3),
        )
        self.records.append(record)
        anon_text = "" if anon is None else f" (anonymous {record.peak_anon_gb:.2f} GB)"
        self.progress(
            f"{name}: {record.seconds:.1f} s, peak RSS {record.peak_rss_gb:.2f} GB{anon_text}"
        )

    def as_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.records]

    @property
    def peak_rss_gb(self) -> float:
        return max((r.peak_rss_gb for r in self.records), default=0.0)
