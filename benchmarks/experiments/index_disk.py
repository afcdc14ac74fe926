"""Question: How much disk does a long index run use, and does a killed run reopen whole?
Answer: peak disk 1.09x final with the cadence (3.27x without); after SIGKILL all 5,000 pages reopen
Note: benchmarks/results/experiments/index_disk.md

Disk in use during a long index run, and reopening after a SIGKILL.

    python -m benchmarks.experiments.index_disk --pages 10000 [--unflushed-pages 3000]

What it models: the write side of `colembed index` at scale, through the index's own store
(`colembed.index.open_store`: Qdrant Edge in a folder, with the store's flush cadence), fed pages of
the real shape: 760 x 128 unit float32 vectors (a 27 x 27 image-token grid plus the prompt rows, as
ColQwen2 gives a page at its default budget of 768 image tokens), made into points by
`schema.make_point` (so rows / cols / mean are pooled as in a real run), payloads like a real
page's, upserted 4 pages at a time (the writer's batch). It measures:

- peak disk used by the index folder, sampled every 0.25 s while the pages are written (allocated
  blocks, not apparent sizes: Edge's WAL and segment files are sparse), beside the final disk
  after the run (the ratio the disk target bounds at ~1.2x), the flushes the cadence made and what
  one cost;
- the same for a run with the cadence off (`--unflushed-pages`, only the final flush, as before
  #26), to show what it replaces;
- a run killed with SIGKILL mid-way (at half the pages): the WAL left behind (allocated bytes),
  and the time to open the folder again (open + count) beside opening the uninterrupted index.

What it does not model: the embedding (no model runs; a real run is ~1 page/s per core, so the
time-based flush, every `edge.FLUSH_SECONDS`, dominates there and keeps the WAL smaller still),
real pages' vector statistics (random unit vectors compress like real ones: not at all), and
another filesystem than the one holding COLEMBED_BENCH_DIR.
Results: benchmarks/results/experiments/index_disk.*.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.shared.machine import (  # noqa: E402
    DiskSampler,
    disk_mib,
    load_average,
    machine_info,
    markdown_header,
)

from colembed.layout import BASE_VARIANT  # noqa: E402

DIM = 128
GRID = 27  # 27 x 27 = 729 image tokens
PROMPT_ROWS = 31  # 729 + 31 = 760 rows
BATCH = 4  # pages per upsert, as the indexer's writer hands them
RESULTS = Path(__file__).resolve().parents[1] / "results" / "experiments"


def wal_mib(folder: Path) -> float:
    return disk_mib(folder / "shard" / "wal")


def pages(start: int, count: int, seed: int = 0):
    """`count` points of the real shape, deterministic per page number."""
    from colembed.index.schema import make_point
    from colembed.model import PageLayout

    layout = PageLayout(
        grid_rows=GRID,
        grid_cols=GRID,
        image_start=14,
        num_tokens=GRID * GRID + PROMPT_ROWS,
        token_px=28,
    )
    out = []
    for n in range(start, start + count):
        rng = np.random.default_rng((seed, n))
        v = rng.standard_normal((layout.num_tokens, DIM), dtype=np.float32)
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        out.append(
            make_point(
                v,
                layout,
                {
                    "path": f"/archive/doc-{n // 10:05d}.pdf",
                    "page": n % 10 + 1,
                    "pages": 10,
                    "sha256": f"{n // 10:064x}",
                    "width": 756,
                    "height": 980,
                    "model": "colqwen2",
                    "variant": BASE_VARIANT,
                    "manifest_sha256": "0" * 64,
                    "schema": 2,
                    "max_image_tokens": 768,
                    "render": "pixel budget",
                    "source": "bench",
                    "model_source": "/models/colqwen2",
                },
            )
        )
    return out


def write(folder: Path, total: int, *, cadence: bool, report_every: int = 0) -> dict:
    """Write `total` pages into a new index folder; disk sampled; flushes timed."""
    from colembed.index import edge, open_store

    if not cadence:
        edge.FLUSH_MIN_PAGES = edge.FLUSH_MAX_PAGES = 1 << 40
        edge.FLUSH_SECONDS = float("inf")
    store = open_store(folder, dim=DIM)
    real_flush, flush_times = store.flush, []

    def timed_flush() -> None:
        t = time.perf_counter()
        real_flush()
        flush_times.append(time.perf_counter() - t)

    store.flush = timed_flush
    sampler = DiskSampler(folder, every=0.25)
    sampler.start()
    start = time.perf_counter()
    for lo in range(0, total, BATCH):
        store.upsert(pages(lo, min(BATCH, total - lo)))
        if report_every and (lo + BATCH) % report_every == 0:
            print(f"stored {lo + BATCH}", flush=True)
    wrote = time.perf_counter() - start
    before_final = disk_mib(folder)
    store.close()
    sampler.done.set()
    sampler.join()
    final = disk_mib(folder)
    return {
        "pages": total,
        "cadence": cadence,
        "seconds": round(wrote, 1),
        "pages_per_s": round(total / wrote, 1),
        "flushes": len(flush_times),
        "flush_s_median": round(float(np.median(flush_times)), 3) if flush_times else None,
        "flush_s_max": round(max(flush_times), 3) if flush_times else None,
        "flush_s_total": round(sum(flush_times), 1),
        "peak_disk_mb": round(max(sampler.peak, before_final)),
        "final_disk_mb": round(final),
        "peak_over_final": round(max(sampler.peak, before_final) / final, 2),
    }


def reopen_seconds(folder: Path) -> tuple[float, int]:
    """Time to open the folder and count its pages, in a fresh process (the WAL is replayed)."""
    code = (
        "import sys, time; t = time.perf_counter()\n"
        "from colembed.index import open_store\n"
        "s = open_store(sys.argv[1]); n = s.count(); s.close()\n"
        "print(time.perf_counter() - t, n)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(folder)], capture_output=True, text=True, check=True
    ).stdout.split()
    return float(out[0]), int(out[1])


def killed_run(folder: Path, total: int) -> dict:
    """A run of `total` pages killed with SIGKILL once half are stored."""
    child = subprocess.Popen(
        [sys.executable, "-m", __spec__.name, "--child", str(folder), str(total)],
        stdout=subprocess.PIPE,
        text=True,
    )
    for line in child.stdout:
        if int(line.split()[1]) >= total // 2:
            os.kill(child.pid, signal.SIGKILL)
            break
    child.wait()
    wal = wal_mib(folder)
    seconds, count = reopen_seconds(folder)
    return {
        "killed_after_pages": total // 2,
        "wal_left_mb": round(wal),
        "reopen_s": round(seconds, 2),
        "pages_after_reopen": count,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=10_000)
    parser.add_argument(
        "--unflushed-pages",
        type=int,
        default=3_000,
        help="pages of the run without the cadence (0: skip it)",
    )
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        write(Path(args.child[0]), int(args.child[1]), cadence=True, report_every=BATCH * 25)
        return
    info = machine_info()
    base = Path(os.environ.get("COLEMBED_BENCH_DIR") or tempfile.gettempdir()) / "index_disk"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    runs = []
    load = [load_average()]
    clean = write(base / "cadence", args.pages, cadence=True)
    clean["reopen_s"], _ = reopen_seconds(base / "cadence")
    clean["reopen_s"] = round(clean["reopen_s"], 2)
    clean["wal_after_close_mb"] = round(wal_mib(base / "cadence"))
    runs.append(clean)
    load.append(load_average())
    killed = killed_run(base / "killed", args.pages)
    load.append(load_average())
    shutil.rmtree(base / "killed", ignore_errors=True)
    if args.unflushed_pages:
        subprocess.run(
            [
                sys.executable,
                "-c",
                (
                    "import sys, json; from benchmarks.experiments import index_disk as b; "
                    "from pathlib import Path; "
                    "print(json.dumps(b.write(Path(sys.argv[1]), int(sys.argv[2]), cadence=False)))"
                ),
                str(base / "unflushed"),
                str(args.unflushed_pages),
            ],
            check=True,
            stdout=open(base / "unflushed.json", "w"),
        )
        runs.append(json.loads((base / "unflushed.json").read_text()))
        load.append(load_average())
    shutil.rmtree(base, ignore_errors=True)
    from colembed.index import edge

    result = {
        "machine": info,
        "load": load,
        "runs": runs,
        "killed": killed,
        "cadence": {
            k: getattr(edge, k)
            for k in ("FLUSH_FRACTION", "FLUSH_MIN_PAGES", "FLUSH_MAX_PAGES", "FLUSH_SECONDS")
        },
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "index_disk.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        markdown_header(info),
        "",
        f"Load average before / after each phase: {load}. Under concurrent load (8 engineers "
        "share 2 cores).",
        "",
        f"Flush cadence: {result['cadence']}.",
        "",
        "| run | pages | pages/s | flushes | flush median / max s | peak disk MB | final MB "
        "| peak / final |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {'cadence' if r['cadence'] else 'no cadence (before #26)'} | {r['pages']} "
            f"| {r['pages_per_s']} | {r['flushes']} | {r['flush_s_median']} / "
            f"{r['flush_s_max']} | {r['peak_disk_mb']} | {r['final_disk_mb']} "
            f"| {r['peak_over_final']} |"
        )
    lines += [
        "",
        f"Reopen (fresh process: open + count) after the uninterrupted run: "
        f"{clean['reopen_s']} s (WAL after close {clean['wal_after_close_mb']} MB). "
        f"Killed with SIGKILL after {killed['killed_after_pages']} pages: WAL left "
        f"{killed['wal_left_mb']} MB, reopen {killed['reopen_s']} s, "
        f"{killed['pages_after_reopen']} pages there.",
        "",
    ]
    (RESULTS / "index_disk.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
