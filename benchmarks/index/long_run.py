"""Long index runs: one build killed at points and resumed, and what a kill costs.

Driven by `bench_index.py --long-run FOLDER --pages N --kill-at P ... [--ab-cadence]` (each job a
fresh interpreter through its `--worker long|reopen`). What it models: the write side of a long
`colembed index` run, through the index's own store (`open_store`, `Store.upsert` 64 pages a call
with the store's flush cadence), fed `--set` pages of real shape (local_answer.py by default
here), killed with SIGKILL mid-run and resumed from what was stored. Per kill: the write-ahead log
left (allocated bytes), a fresh process's open (Edge replays the log), then a second fresh open
of the same folder, which the first closed cleanly: the uninterrupted open at the same page count
(like-for-like). Peak disk sampled every second beside the final disk; build time, flush cost,
the writer's peak RSS. What it does not model: the embedding (no model runs; a real run stores
~1 page/s per core, so the time-based flush dominates there and the log stays smaller still) and
filesystems other than the one holding the folder. Results: benchmarks/results/index/index-long-*.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.shared.common import load_line, results_markdown
from benchmarks.shared.machine import DiskSampler
from benchmarks.index.stores import DIM, K, bench_point, disk_mib, peak_rss_mib, queries_of


def wal_mib(folder: Path) -> float:
    return disk_mib(folder / "shard" / "wal")


FLUSH_SETTINGS = (
    "FLUSH_FRACTION",
    "FLUSH_MIN_PAGES",
    "FLUSH_MAX_PAGES",
    "FLUSH_SECONDS",
    "FLUSH_MAX_LOG_BYTES",
)


def flush_cadence() -> dict:
    """The Edge store's flush settings as this process has them, recorded beside each long run
    (a run's log size and reopen time depend on them)."""
    from colembed.index import edge

    return {name: getattr(edge, name) for name in FLUSH_SETTINGS}


# ------------------------------------------------------------------------------------ long runs
LONG_BATCH = 64  # pages handed to Store.upsert at a time by the long-run writer
LONG_REPORT_EVERY = 64  # pages between the writer's progress lines (the driver kills on one)
# A pooled page's Ward linkage (~40 ms) is most of its cost: the writer of a pooled store has it
# done by this many helper processes, one nice step below the writer (what `colembed index`
# does instead is pool beside the embedding, which costs ~10 s a page)
POOL_WORKERS = 2


def _pool_helper_start() -> None:
    os.nice(5)  # (pool_tokens holds its products to one BLAS thread)


def worker_long(
    pages: int, folder: Path, data: str, log_bytes: float | None = None, pool_factor: int = 1
) -> dict:
    """Store pages 0..pages-1 of `data` into the Edge folder, resuming where a killed run left
    off (every stored page has its token-table row: a chunk stored but not yet in the table is
    written again; an upsert of the same id replaces it). A progress line after every batch:
    `stored N unflushed U rss_peak_mib R` (what the driver kills on). `log_bytes`: the flush
    cadence's FLUSH_MAX_LOG_BYTES for this writer (inf: the cadence before it existed).
    `pool_factor`: the pages' index-time pooling (bench_point)."""
    from colembed.index import edge
    from colembed.index.backends import open_store

    if log_bytes is not None:
        edge.FLUSH_MAX_LOG_BYTES = log_bytes

    helpers = None
    if pool_factor > 1:  # started before the shard opens (a spawn: nothing of Edge's is shared)
        import multiprocessing

        helpers = multiprocessing.get_context("spawn").Pool(POOL_WORKERS, _pool_helper_start)
    store = open_store(folder, dim=DIM)
    start = min(store.count(), len(store.tokens))
    make = functools.partial(bench_point, data, pool_factor=pool_factor)
    t = time.perf_counter()
    points = (
        helpers.imap(make, range(start, pages), chunksize=8)
        if helpers
        else map(make, range(start, pages))
    )
    for lo in range(start, pages, LONG_BATCH):
        store.upsert([next(points) for _ in range(lo, min(lo + LONG_BATCH, pages))])
        print(
            f"stored {min(lo + LONG_BATCH, pages)} unflushed {store._unflushed} rss_peak_mib "
            f"{peak_rss_mib():.0f}",
            flush=True,
        )
    store.flush()
    wrote = time.perf_counter() - t
    out = {
        "resumed_from": start,
        "stored": store.count(),
        "write_s": wrote,
        "flushes": store.flushes,
        "flush_s": store.flush_seconds,
        "peak_rss_mib": peak_rss_mib(),
    }
    store.close()
    if helpers:
        helpers.close()
    return out


def worker_reopen(pages: int, folder: Path, data: str) -> dict:
    """Open the folder in this fresh process (a killed run's log is replayed here), count, and
    time the first search; then close (which flushes: the next open is a clean one)."""
    from colembed.index.backends import open_store

    t = time.perf_counter()
    store = open_store(folder)
    opened = time.perf_counter() - t
    count = store.count()
    current = store.has_tokens()
    queries, _ = queries_of(data, max(count, 1), 1)
    t = time.perf_counter()
    store.search(queries, K, "two-stage")
    first = time.perf_counter() - t
    store.close()
    return {
        "open_s": opened,
        "pages": count,
        "token_table_current": current,
        "first_query_ms": first * 1000,
        "peak_rss_mib": peak_rss_mib(),
    }


def long_run(
    module: str,
    sub,
    pages: int,
    kill_at: list[int],
    folder: Path,
    data: str,
    queries: bool,
    ab: bool = False,
    pool_factor: int = 1,
) -> dict:
    """One long build of `pages` pages into `folder`, SIGKILLed once at each of `kill_at` (pages
    stored), each kill followed by: the log left (allocated bytes), a fresh process opening the
    folder (the replay), a second fresh open of the same folder (now clean: the like-for-like
    uninterrupted open at the same page count), then the build resumed. Disk of the folder
    sampled throughout (allocated blocks); build time = the writers' wall time, kills included.
    A kill lands past its point at the first progress line whose unflushed pages are at least
    3/4 of the most seen so far under that cadence (near the worst case, not just after a flush).
    `module`/`sub`: the driver (run with `python -m`) and its job runner (bench_index.py's `_sub`).
    `ab`: the legs alternate between the cadence without its byte bound (FLUSH_MAX_LOG_BYTES =
    inf: as before it) and the current one, so the two are compared in one run, interleaved.
    `pool_factor` > 1: the pages stored hierarchically pooled (bench_point)."""
    import signal

    if folder.exists():
        raise SystemExit(f"{folder}: exists; the long run builds a new index (remove it first)")
    sampler = DiskSampler(folder)
    folder.mkdir(parents=True)
    sampler.start()
    legs, kills, build_s, rss = [], [], 0.0, 0.0
    extra = ["--set", data, *(["--pool-factor", str(pool_factor)] if pool_factor > 1 else [])]
    most = {"current": 0, "no byte bound": 0}
    for leg, point in enumerate([*sorted(kill_at), None]):
        cadence = "no byte bound" if ab and point is not None and leg % 2 == 0 else "current"
        cmd = [
            sys.executable,
            "-m",
            module,
            "--worker",
            "long",
            "--pages",
            str(pages),
            "--folder",
            str(folder),
            *extra,
            *(["--log-bytes", "inf"] if cadence != "current" else []),
        ]
        t = time.perf_counter()
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        last, done, killed = None, None, False
        for line in child.stdout:
            if line.startswith("stored "):
                words = line.split()
                last = {"stored": int(words[1]), "unflushed": int(words[3])}
                rss = max(rss, float(words[5]))
                if (
                    point is not None
                    and last["stored"] >= point
                    and last["unflushed"] >= max(1, 0.75 * most[cadence])
                ):
                    os.kill(child.pid, signal.SIGKILL)
                    killed = True
                    break
                most[cadence] = max(most[cadence], last["unflushed"])
            elif line.startswith("{"):
                done = json.loads(line)
        child.wait()
        build_s += time.perf_counter() - t
        print("leg", point, last, done, file=sys.stderr, flush=True)
        if not killed:  # the last leg, or a kill point the run never reached
            if done is None:
                raise SystemExit(f"the writer failed (exit {child.returncode}): {cmd}")
            legs.append(done)
            rss = max(rss, done["peak_rss_mib"])
            break
        wal = wal_mib(folder)
        replay = sub("reopen", pages, folder, tuple(extra))
        clean = sub("reopen", pages, folder, tuple(extra))
        kills.append(
            {
                "cadence": cadence,
                "killed_at": last,
                "wal_mb": wal,
                "after_kill": replay,
                "clean": clean,
                "wal_after_clean_close_mb": wal_mib(folder),
                "open_over_clean_s": replay["open_s"] - clean["open_s"],
            }
        )
        print("kill", kills[-1], file=sys.stderr, flush=True)
    sampler.done.set()
    sampler.join()
    final = disk_mib(folder)
    result = {
        "pages": pages,
        "set": data,
        "pool_factor": pool_factor,
        "folder": str(folder),
        "build_s": build_s,
        "insert_pages_per_s": pages / build_s,
        "build_peak_rss_mib": rss,
        "peak_disk_mib": max(sampler.peak, final),
        "final_disk_mib": final,
        "final_leg": legs[-1],
        "kills": kills,
        "reopen": sub("reopen", pages, folder, tuple(extra)),
        "cadence": flush_cadence(),
    }
    if queries:
        result["queries"] = {
            b: sub(f"query:{b}", pages, folder, tuple(extra))
            for b in ("edge-two-stage", "edge-exact")
        }
    return result


def long_from_log(log: Path, command: str, pages: int, data: str, stopped: str) -> dict:
    """The kills of a --long-run stopped before its end, from the `kill {...}` lines its driver
    wrote to stderr (each written once that kill's reopens were measured)."""
    import ast

    kills = [
        ast.literal_eval(line[5:])
        for line in log.read_text().splitlines()
        if line.startswith("kill {")
    ]
    return {
        "pages": pages,
        "set": data,
        "kills": kills,
        "stopped": stopped,
        "command": command,
        "cadence": flush_cadence(),
    }


def long_markdown(r: dict) -> str:
    how = "killed and resumed" if r["kills"] else "one uninterrupted build"
    title = f"Long index run: {r['pages']:,} pages ({r['set']} set), {how}"
    lines = [
        load_line(r),
        "",
        "One build through `Store.upsert` (64 pages a call, `bench_point` payloads; the "
        "store's own flush cadence), SIGKILLed at each kill point and resumed from what "
        "was stored. After a kill: the write-ahead log left (allocated MB), a fresh process "
        "opening the folder (Edge replays the log; open = `open_store`, then count and a "
        "first two-stage query), then a second fresh open of the same folder, which the "
        "first closed cleanly: the uninterrupted open at the same page count "
        "(like-for-like). Disk = allocated blocks of the folder, sampled every second.",
        "",
        f"Flush cadence: {r['cadence']}.",
        "",
    ]
    if "stopped" in r:
        lines += [
            f"**Stopped before the end** ({r['stopped']}): the kills below are the ones the "
            "run made before it was stopped; no finished-build figures.",
            "",
        ]
    else:
        lines += [
            f"Build: {r['pages']:,} pages in {r['build_s']:.0f} s ({r['insert_pages_per_s']:.1f} "
            f"pages/s, kills and resumes included); writer peak RSS "
            f"{r['build_peak_rss_mib']:.0f} MiB; flushes in the last leg "
            f"{r['final_leg']['flushes']} costing {r['final_leg']['flush_s']:.1f} s of its "
            f"{r['final_leg']['write_s']:.0f} s. Peak disk during the build "
            f"{r['peak_disk_mib']:.0f} MiB, final {r['final_disk_mib']:.0f} MiB "
            f"({r['peak_disk_mib'] / r['final_disk_mib']:.2f}x).",
            "",
        ]
    if r["kills"]:
        lines += [
            "| cadence | killed at pages | unflushed pages then | log left MB | open after "
            "kill s | clean open, same pages s | difference s | pages after reopen | "
            "first query ms |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
    else:
        lines += ["No kill points were asked for (`--kill-at`): the build ran once to the end."]
    for k in r["kills"]:
        unflushed = k["killed_at"]["unflushed"]  # None: a kill made by hand (writer unseen)
        lines.append(
            f"| {k.get('cadence', 'current')} | {k['killed_at']['stored']:,} | "
            f"{'?' if unflushed is None else unflushed} | "
            f"{k['wal_mb']:.0f} | {k['after_kill']['open_s']:.2f} | "
            f"{k['clean']['open_s']:.2f} | {k['open_over_clean_s']:+.2f} | "
            f"{k['after_kill']['pages']:,} | {k['after_kill']['first_query_ms']:.0f} |"
        )
    o = r.get("reopen")
    lines += (
        [""]
        if o is None
        else [
            "",
            f"Reopen of the finished index ({o['pages']:,} pages): {o['open_s']:.2f} s, "
            f"first query {o['first_query_ms']:.0f} ms, peak RSS {o['peak_rss_mib']:.0f} MiB.",
            "",
        ]
    )
    for name, q in (r.get("queries") or {}).items():
        lines.append(
            f"- {name}: reopen {q['reopen_s']:.2f} s, first query "
            f"{q['first_query_ms']:.0f} ms, 1 query p50 / p90 {q['q1_p50_ms']:.0f} / "
            f"{q['q1_p90_ms']:.0f} ms, 16 queries p50 / p90 {q['q16_p50_ms']:.0f} / "
            f"{q['q16_p90_ms']:.0f} ms, peak RSS {q['peak_rss_mib']:.0f} MiB"
        )
    two = (r.get("queries") or {}).get("edge-two-stage", {})
    if "needle_at_10" in two:
        n = two["needle_at_10"]
        lines += [
            "",
            f"Needle in top 10 over {two['needle_queries']} queries: two-stage "
            f"{100 * n['edge-two-stage']:.0f}%, exact {100 * n['edge-exact']:.0f}%; "
            f"recall@10 vs exact {two['recall_at_10']:.3f}.",
        ]
    return results_markdown(title, r["machine"], lines)
