"""What a benchmark ran on: CPU, cores, instruction sets, memory, BLAS, versions, date, command.

Shared by the benchmarks (bench_embed.py, bench_scoring.py and bench_preprocess.py import it with
`from benchmarks.shared.machine import machine_info, ...`) so that every
results file describes its machine the same way. Also the load-average and peak-RSS readers the
benchmarks use, and the disk a folder holds (`disk_mib`, `DiskSampler`). Linux-first (/proc); on other systems the fields it cannot read are None. Imports
only the standard library; versions are read from installed distributions without importing them,
and the OpenBLAS build is asked of the library the process has already loaded (numpy's).
"""

from __future__ import annotations

import ctypes
import datetime as _dt
import importlib.metadata as _md
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

# Instruction sets that decide which GEMM kernels run (fp32 FMA, int8 dot products, bf16/fp16).
INTERESTING_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "neon",
    "asimddp",
    "sve",
)
# Environment variables that change which BLAS kernels run or how many threads they use
# (OPENBLAS_CORETYPE, OPENBLAS_L2_SIZE, OPENBLAS_NUM_THREADS, OMP_NUM_THREADS, MKL_*, ...).
ENVIRONMENT_MARKERS = ("BLAS", "OMP_", "MKL", "CORETYPE", "NUM_THREADS")
DISTRIBUTIONS = (
    "colembed",
    "onnxruntime",
    "onnx",
    "numpy",
    "torch",
    "transformers",
    "tokenizers",
    "pillow",
)


def _cpuinfo() -> dict[str, Any]:
    model, flags, cores = None, set(), set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"model": platform.processor() or None, "flags": [], "physical_cores": None}
    physical = core = None
    for line in text.splitlines() + [""]:
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name" and model is None:
            model = value
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
        elif key == "physical id":
            physical = value
        elif key == "core id":
            core = value
        elif not line.strip():
            if core is not None:
                cores.add((physical, core))
            physical = core = None
    return {
        "model": model,
        "flags": sorted(f for f in INTERESTING_FLAGS if f in flags),
        "physical_cores": len(cores) or None,
    }


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            timeout=5,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def load_average() -> list[float] | None:
    """1/5/15-minute load: other jobs on a shared machine move absolute numbers, not ratios."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def blas_environment() -> dict[str, str]:
    """The BLAS/OpenMP/thread-count environment variables that are set."""
    return {
        k: v
        for k, v in sorted(os.environ.items())
        if any(marker in k for marker in ENVIRONMENT_MARKERS)
    }


def openblas() -> dict[str, Any]:
    """Library, build config, core type and threads of the OpenBLAS this process has loaded.

    Asks the first OpenBLAS in /proc/self/maps (numpy's scipy_openblas once numpy is imported)
    for `openblas_get_config`, `openblas_get_corename` and `openblas_get_num_threads` (64-bit
    interface names first); {"error": ...} when none is loaded or it cannot be read.
    """
    try:
        maps = Path("/proc/self/maps").read_text()
        path = next(
            (line.split()[-1] for line in maps.splitlines() if "openblas" in line.lower()), None
        )
        if path is None:
            return {"error": "no OpenBLAS library loaded"}
        lib = ctypes.CDLL(path)
        info: dict[str, Any] = {"library": os.path.basename(path)}
        for prefix in ("scipy_openblas_", "openblas_"):
            for field, suffix in (
                ("core", "get_corename64_"),
                ("config", "get_config64_"),
                ("core", "get_corename"),
                ("config", "get_config"),
            ):
                fn = getattr(lib, prefix + suffix, None)
                if fn is not None and field not in info:
                    fn.restype = ctypes.c_char_p
                    info[field] = fn().decode()
            fn = getattr(lib, prefix + "get_num_threads64_", None) or getattr(
                lib, prefix + "get_num_threads", None
            )
            if fn is not None and "threads" not in info:
                fn.restype = ctypes.c_int
                info["threads"] = fn()
        return info
    except OSError as e:
        return {"error": str(e)}


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for dist in DISTRIBUTIONS:
        try:
            found[dist] = _md.version(dist)
        except _md.PackageNotFoundError:
            pass
    return found


def machine_info(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The machine, BLAS, versions, date and the command that produced a result.

    Call it at the start of a run (it records the load average then) and after numpy is imported
    (so that `openblas` describes numpy's BLAS).
    """
    cpu = _cpuinfo()
    argv = list(sys.argv if argv is None else argv)
    return {
        "cpu": cpu["model"],
        "physical_cores": cpu["physical_cores"],
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "instruction_sets": cpu["flags"],
        "memory_gib": _memory_gib(),
        "os": f"{platform.system()} {platform.release()}",
        "platform": platform.platform(),
        "openblas": openblas(),
        "environment": blas_environment(),
        "load_average_at_start": load_average(),
        "versions": versions(),
        "git_commit": _git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python " + " ".join(shlex.quote(a) for a in _as_module(argv)),
    }


def _as_module(argv: list[str]) -> list[str]:
    """`python -m benchmarks.x` leaves the module's file path in argv[0]; a result note shows the
    `-m` form, which runs from any checkout (a path names one machine's folder)."""
    if not argv:
        return argv
    script = Path(argv[0]).resolve()
    root = Path(__file__).resolve().parents[2]
    try:
        parts = script.with_suffix("").relative_to(root).parts
    except ValueError:
        return argv
    if script.suffix != ".py" or not parts or parts[0] != "benchmarks":
        return argv
    module = ".".join(parts[:-1] if parts[-1] == "__main__" else parts)
    return ["-m", module, *argv[1:]]


def markdown_header(info: dict[str, Any]) -> str:
    """A few lines describing `machine_info()` for the top of a results table."""
    v = info["versions"]
    return "\n".join(
        [
            f"- machine: {info['cpu']}, {info['physical_cores']} physical cores "
            f"({info['logical_cpus']} logical), {info['memory_gib']} GiB, {info['os']}",
            f"- instruction sets: {', '.join(info['instruction_sets']) or 'unknown'}",
            "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
            f"- date: {info['date']} (load average at start: "
            f"{', '.join(f'{x:.2f}' for x in info['load_average_at_start'] or [])})",
            f"- command: `{info['command']}`",
        ]
    )


def rss_mib() -> dict[str, float | None]:
    """This process's current (VmRSS) and peak (VmHWM) resident set size in MiB."""
    found: dict[str, float | None] = {"rss": None, "peak": None}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                found["rss"] = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                found["peak"] = int(line.split()[1]) / 1024
    except OSError:
        import resource

        found["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return found


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def disk_mib(folder: Path) -> float:
    """Disk blocks really allocated under `folder`, in MiB (st_blocks: Qdrant Edge's WAL and
    segment files are sparse, their apparent size far larger); a file removed between listing and
    stat counts nothing."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total / 2**20


class DiskSampler(threading.Thread):
    """The most disk (`disk_mib`) a folder held, sampled every `every` seconds until `done` is set."""

    def __init__(self, folder: Path, every: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.folder, self.every, self.peak, self.done = folder, every, 0.0, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, disk_mib(self.folder))
            time.sleep(self.every)


if __name__ == "__main__":
    import json

    print(json.dumps(machine_info(), indent=2))
