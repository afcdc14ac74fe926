"""Search on large built Qdrant Edge stores (the search targets at 100,000 pages), without an
Edge exact scan.

    # the stores: bench_index.py --long-run FOLDER --pages N --set local [--pool-factor F]
    python -m benchmarks.index.search_large --store FOLDER [--store FOLDER2] \
        --build benchmarks/results/index/history/index-long-100k.json [--build ...] --exact-only   # not timed
    python -m benchmarks.index.search_large --store ... --build ... \
        [--cold]   # drop each store's files from the page cache first: new queries read the disk

Per store (each step in a fresh process: peak RSS and reopen are per process): the reopen, the
first query after it, the default two-stage plan's p50 / p90 for 1 query and for batches of 16
(index_stores._timed_queries), the needle (the page a local-answer query was drawn from) in the
top 10 for exact, the default plan and the mean-gated plan, recall@10 of the plans against the
store's own exact top 10 and against the unpooled exact top 10; from the build's JSON
(index_long.py) its time, pages/s, disk and writer peak RSS.

Why not Edge's exact: at 100,000 pages it took 62 s a query and 20 GB RSS on this machine
(results/index/index-long-100k-killed.md, the first build). Exact's top 10 is computed in numpy instead, in a
few hundred MB:
- `generated_exact`: the unpooled exact MaxSim of every page, from the generator's vectors
  (local_answer.py, deterministic) rounded to float16 as Edge stores them, in worker processes
  over chunks of pages: the stored vectors of an unpooled store bit for bit, without reading
  them back (reading 100,000 pages through Edge's retrieve costs ~10 ms of CPU a page, mostly
  turning its lists into arrays);
- `stored_exact`: the MaxSim of the `page` vectors a store holds, read back through Edge in chunks
  (a pooled store: generating its pages again would mean a Ward linkage a page).
Both are checked against Edge's own exact scan on stores of up to `index_stores.EDGE_EXACT_MAX_PAGES`
(`--check`, reported in the results: the same top 10 for every query at 1,000 and 2,000 pages,
results/index/history/search-large-smoke.md). Edge's scores differ from these float32 ones by up to ~4e-4 (its
own arithmetic on the float16 values): rank ties at that level could swap.

What it does not model: a trained model's queries (local_answer.py says what the set models), the
embedding (no model runs). Writes benchmarks/results/<--out>.{md,json}; the exact top lists are
cached in --scratch (so the locked, timed run does not recompute them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import tempfile
import uuid
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parents[1]  # the benchmarks folder
from benchmarks.shared.common import load_line, results_markdown, write_note  # noqa: E402
from benchmarks.shared.machine import load_average, machine_info  # noqa: E402

K = 10
DATA = "local"
NEEDLE_QUERIES = int(os.environ.get("COLEMBED_NEEDLE_QUERIES", 40))
EXACT_CHUNK = 1000  # pages a generated-exact task scores
STORED_CHUNK = 256  # pages read back from Edge at a time


def _maxsim_many(flat: np.ndarray, starts: np.ndarray, doc: np.ndarray) -> np.ndarray:
    """Per query (its tokens are `flat[starts[j]:starts[j+1]]`), the MaxSim against `doc`."""
    return np.add.reduceat((flat @ doc.T).max(axis=1), starts)


def _generated_chunk(task: tuple[int, int, int, int]) -> tuple[int, np.ndarray]:
    from colembed.blas import one_thread
    from benchmarks.index.stores import page_of, queries_of

    lo, hi, pages, count = task
    queries, _ = queries_of(DATA, pages, count)
    flat = np.concatenate(queries)
    starts = np.cumsum([0] + [len(q) for q in queries])[:-1]
    out = np.empty((hi - lo, count), np.float32)
    with one_thread():
        for i in range(lo, hi):
            vectors, _ = page_of(DATA, i)
            out[i - lo] = _maxsim_many(flat, starts, vectors.astype(np.float16).astype(np.float32))
    return lo, out


def _top(scores: np.ndarray, k: int) -> list[list[list[float]]]:
    """Per query (a column), its k best rows as [serial, score], best first."""
    out = []
    for col in scores.T:
        best = np.argpartition(-col, k - 1)[:k]
        best = best[np.argsort(-col[best], kind="stable")]
        out.append([[int(i), float(col[i])] for i in best])
    return out


def generated_exact(pages: int, count: int, workers: int) -> list[list[list[float]]]:
    """The unpooled exact top K of `count` local-answer queries over pages 0..pages-1, from the
    generator's vectors rounded to float16 (as stored), `workers` processes."""
    import multiprocessing

    scores = np.empty((pages, count), np.float32)
    tasks = [
        (lo, min(lo + EXACT_CHUNK, pages), pages, count) for lo in range(0, pages, EXACT_CHUNK)
    ]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        for lo, part in pool.imap_unordered(_generated_chunk, tasks):
            scores[lo : lo + len(part)] = part
    return _top(scores, K)


def stored_exact(store, queries: list[np.ndarray]) -> list[list[list[float]]]:
    """The exact top K of `queries` over the `page` vectors a store holds, read through Edge
    STORED_CHUNK pages at a time (bounded memory); [serial, score] as `generated_exact`."""
    from colembed.index.schema import PAGE_VECTOR

    flat = np.concatenate(queries).astype(np.float32)
    starts = np.cumsum([0] + [len(q) for q in queries])[:-1]
    ids = store.ids()
    scores = np.empty((len(ids), len(queries)), np.float32)
    for lo in range(0, len(ids), STORED_CHUNK):
        part = [uuid.UUID(i) for i in ids[lo : lo + STORED_CHUNK]]
        records = store.shard.retrieve(part, with_payload=False, with_vector=[PAGE_VECTOR])
        got = {str(r.id): r for r in records}
        for j, pid in enumerate(ids[lo : lo + STORED_CHUNK]):
            doc = np.array(got[pid].vector[PAGE_VECTOR], dtype=np.float32)
            scores[lo + j] = _maxsim_many(flat, starts, doc)
    top = _top(scores, K)
    winners = sorted({ids[row] for q in top for row, _ in q})
    serial = {
        str(r.id): int(r.payload["serial"])
        for r in store.shard.retrieve(
            [uuid.UUID(i) for i in winners], with_payload=True, with_vector=False
        )
    }
    return [[[serial[ids[row]], s] for row, s in q] for q in top]


def _serials(rows) -> list[list[int]]:
    return [[int(h.payload["serial"]) for h in r] for r in rows]


# ----------------------------------------------------------------------------- worker jobs
def job_stored_exact(folder: Path, pages: int) -> dict:
    from colembed.index.backends import open_store
    from benchmarks.index.stores import queries_of

    store = open_store(folder)
    queries, _ = queries_of(DATA, pages, NEEDLE_QUERIES)
    t = time.perf_counter()
    top = stored_exact(store, queries)
    store.close()
    return {"top": top, "seconds": time.perf_counter() - t}


def job_edge_exact(folder: Path, pages: int) -> dict:
    """Edge's own exact scan (small stores only: the check of the numpy exacts)."""
    from colembed.index.backends import open_store
    from benchmarks.index.stores import queries_of

    store = open_store(folder)
    queries, _ = queries_of(DATA, pages, NEEDLE_QUERIES)
    rows = store.search(queries, K, "exact")
    store.close()
    return {"top": [[[int(h.payload["serial"]), h.score] for h in r] for r in rows]}


PROFILE_QUERIES = 8


def _query_parts(store, queries: list[np.ndarray]) -> dict:
    """Where one query's time goes (medians over `queries`, one at a time): the centroid scan
    (`TokenTable.top_many`, as search runs it) and the rest (Edge's `mean` stage and the exact
    rerank of the union, Python around them) = the whole search minus the scan."""
    from colembed.index.plan import TOKEN_CANDIDATES

    scan, whole = [], []
    for q in queries:
        t = time.perf_counter()
        store.tokens.top_many([q], TOKEN_CANDIDATES)
        scan.append(time.perf_counter() - t)
        t = time.perf_counter()
        store.search([q], K, "two-stage")
        whole.append(time.perf_counter() - t)
    med = lambda xs: float(np.median(xs)) * 1000  # noqa: E731
    return {
        "scan": med(scan),
        "whole": med(whole),
        "rest": med(whole) - med(scan),
        "queries": len(queries),
    }


# The default plan's candidates (token stage, mean stage) beside fewer: Edge's exact rerank costs
# about linearly per candidate page, so fewer candidates are the lever on its part of a query
BUDGETS = ((100, 100), (100, 50), (50, 50), (50, 25))
BUDGET_TIMED = 10  # single queries timed per budget (after one untimed)


def _budgets(store, queries, targets, exact) -> list[dict]:
    """Per (token, mean) candidate budget: needle@10, recall@10 against `exact`, 1 query p50."""
    from colembed.index import plan

    saved = plan.TOKEN_CANDIDATES, plan.TOKEN_MEAN_CANDIDATES
    own = [[s for s, _ in q] for q in exact]
    out = []
    try:
        for tokens, mean in BUDGETS:
            plan.TOKEN_CANDIDATES, plan.TOKEN_MEAN_CANDIDATES = tokens, mean
            tops = _serials(store.search(queries, K, "two-stage"))
            times = []
            for q in queries[: BUDGET_TIMED + 1]:
                t = time.perf_counter()
                store.search([q], K, "two-stage")
                times.append(time.perf_counter() - t)
            out.append(
                {
                    "token_candidates": tokens,
                    "mean_candidates": mean,
                    "needle_at_10": float(
                        np.mean([int(t) in top for top, t in zip(tops, targets)])
                    ),
                    "recall_at_10": float(
                        np.mean([len(set(a) & set(b)) / K for a, b in zip(tops, own)])
                    ),
                    "q1_p50_ms": float(np.median(times[1:])) * 1000,
                }
            )
    finally:
        plan.TOKEN_CANDIDATES, plan.TOKEN_MEAN_CANDIDATES = saved
    return out


def job_query(folder: Path, pages: int, exact: list, reference: list) -> dict:
    """Reopen, first query, the default plan's timings, then the plans' needle / recall against
    `exact` (the store's own exact top K) and `reference` (the unpooled exact top K)."""
    from colembed.index.backends import open_store
    from benchmarks.index.stores import _timed_queries, _use_plan, peak_rss_mib, queries_of, runs_on

    t = time.perf_counter()
    store = open_store(folder)
    reopen = time.perf_counter() - t
    payload = store.any_payload() or {}
    queries, _ = queries_of(DATA, pages, 64)
    timings = _timed_queries(lambda qs: store.search(qs, K, "two-stage"), queries, pages)
    parts = _query_parts(store, queries[:PROFILE_QUERIES])
    queries, targets = queries_of(DATA, pages, NEEDLE_QUERIES)
    plans = {}
    for plan in [p for p in ("edge-two-stage", "edge-mean-gated") if runs_on(store, p)]:
        _use_plan(store, plan)
        plans[plan] = _serials(store.search(queries, K, "two-stage"))
    _use_plan(store, "edge-two-stage")
    budgets = _budgets(store, queries, targets, exact)
    count = store.count()
    store.close()
    own = [[s for s, _ in q] for q in exact]
    ref = [[s for s, _ in q] for q in reference]
    needle = lambda tops: float(np.mean([int(t) in top for top, t in zip(tops, targets)]))  # noqa: E731
    recall = lambda tops, against: float(  # noqa: E731
        np.mean([len(set(a) & set(b)) / K for a, b in zip(tops, against)])
    )
    return {
        "pages": count,
        "pool_factor": int(payload.get("pool_factor", 1)),
        "schema": store.schema,
        "reopen_s": reopen,
        **timings,
        "parts_ms": parts,
        "peak_rss_mib": peak_rss_mib(),
        "needle_queries": len(targets),
        "needle_at_10": {
            "exact": needle(own),
            "unpooled exact": needle(ref),
            **{p: needle(top) for p, top in plans.items()},
        },
        "recall_at_10": {p: recall(top, own) for p, top in plans.items()},
        "recall_at_10_vs_unpooled_exact": {
            "exact": recall(own, ref),
            **{p: recall(top, ref) for p, top in plans.items()},
        },
        "budgets": budgets,
        "tops": plans,
    }


# ---------------------------------------------------------------------------- the page cache
def page_cache(folder: Path, evict: bool = False) -> dict:
    """Bytes of `folder`'s files and how many of them sit in the page cache (mincore over a
    read-only map of each file); with `evict`, first drop those pages (posix_fadvise DONTNEED:
    no root needed, unlike /proc/sys/vm/drop_caches, and only this folder's files). A page still
    mapped by a running process stays: call it with no process holding the store open.

    Why: a store built or searched a minute ago is in RAM on a 24 GiB machine (the schema-3 pooled
    store is 7.4 GiB), so a "fresh process" alone measures warm queries; a user's first search
    after a reboot, or after other work filled the cache, reads the candidates' vectors from disk."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    total = resident = 0
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        size = path.stat().st_size
        if size == 0:
            continue
        with open(path, "rb") as f:
            if evict:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
            if address in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"cannot map {path}")
            try:
                vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
                if libc.mincore(address, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore failed on {path}")
            finally:
                libc.munmap(address, size)
        total += size
        resident += min(size, sum(v & 1 for v in bytes(vec)) * mmap.PAGESIZE)
    return {"bytes": total, "resident_bytes": resident}


# ----------------------------------------------------------------------------------- driver
def _run(job: str, folder: Path, pages: int, extra: dict | None = None) -> dict:
    """One job in a fresh interpreter; `extra` is handed over through a file (the exact lists)."""
    cmd = [
        sys.executable,
        "-m",
        __spec__.name,
        "--job",
        job,
        "--folder",
        str(folder),
        "--pages",
        str(pages),
    ]
    if extra is not None:
        path = Path(f"{folder}.job-input.json")
        path.write_text(json.dumps(extra))
        cmd += ["--input", str(path)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cached(path: Path, make) -> list:
    if path.is_file():
        return json.loads(path.read_text())
    value = make()
    path.write_text(json.dumps(value))
    return value


def _pages_of(folder: Path) -> int:
    from colembed.index.backends import open_store

    store = open_store(folder)
    try:
        return store.count()
    finally:
        store.close()


def _pool_factor_of(folder: Path) -> int:
    from colembed.index.backends import open_store

    store = open_store(folder)
    try:
        return int((store.any_payload() or {}).get("pool_factor", 1))
    finally:
        store.close()


def measure(
    folders: list[Path],
    builds: list[Path],
    scratch: Path,
    workers: int,
    exact_only: bool,
    check: bool,
    cold: bool = False,
) -> dict:
    from benchmarks.index.stores import EDGE_EXACT_MAX_PAGES

    scratch.mkdir(parents=True, exist_ok=True)
    pages = {f: _pages_of(f) for f in folders}
    factors = {f: _pool_factor_of(f) for f in folders}
    out: dict = {"stores": {}, "needle_queries": NEEDLE_QUERIES}
    references = {}
    for n in sorted(set(pages.values())):
        t = time.perf_counter()
        references[n] = _cached(
            scratch / f"exact-generated-{n}-{NEEDLE_QUERIES}.json",
            lambda: generated_exact(n, NEEDLE_QUERIES, workers),
        )
        out.setdefault("generated_exact_s", {})[n] = time.perf_counter() - t
    for folder, build in zip(folders, builds + [None] * (len(folders) - len(builds))):
        n, factor = pages[folder], factors[folder]
        name = f"{folder.name}"
        if factor == 1:
            own, how = references[n], "generated (unpooled, float16-rounded)"
        else:
            t = time.perf_counter()
            cache = scratch / f"exact-stored-{folder.name}-{NEEDLE_QUERIES}.json"
            cached = cache.is_file()
            own = _cached(cache, lambda: _run("stored-exact", folder, n)["top"])
            how = (
                "stored vectors read back (cached by an earlier --exact-only run)"
                if cached
                else f"stored vectors read back ({time.perf_counter() - t:.0f} s)"
            )
        entry = {"folder": str(folder), "pages": n, "pool_factor": factor, "exact_from": how}
        if check and n <= EDGE_EXACT_MAX_PAGES:
            edge = _run("edge-exact", folder, n)["top"]
            stored = own if factor > 1 else _run("stored-exact", folder, n)["top"]
            same = lambda a, b: float(  # noqa: E731
                np.mean([[s for s, _ in x] == [s for s, _ in y] for x, y in zip(a, b)])
            )
            diff = lambda a, b: max(  # noqa: E731
                abs(x[1] - y[1]) for qa, qb in zip(a, b) for x, y in zip(qa, qb)
            )
            entry["check"] = {
                "stored_vs_edge_same_top10": same(stored, edge),
                "stored_vs_edge_max_score_diff": diff(stored, edge),
            }
            if factor == 1:
                entry["check"].update(
                    {
                        "generated_vs_edge_same_top10": same(own, edge),
                        "generated_vs_edge_max_score_diff": diff(own, edge),
                    }
                )
        if build is not None:
            b = json.loads(Path(build).read_text())
            entry["build"] = {
                k: b.get(k)
                for k in (
                    "build_s",
                    "insert_pages_per_s",
                    "build_peak_rss_mib",
                    "final_disk_mib",
                    "peak_disk_mib",
                    "pool_factor",
                    "command",
                )
            }
            entry["build"]["command"] = b.get("command")
            entry["build"]["date"] = b["machine"]["date"]
            entry["build"]["load"] = [b.get("load_before"), b.get("load_after")]
        from benchmarks.index.stores import disk_mib

        entry["disk_mib"] = disk_mib(folder)
        if not exact_only:
            if cold:  # no process holds the store now: its pages can all be dropped
                entry["page_cache"] = {
                    "before": page_cache(folder),
                    "after_evict": page_cache(folder, evict=True),
                }
            entry.update(_run("query", folder, n, {"exact": own, "reference": references[n]}))
            Path(f"{folder}.job-input.json").unlink(missing_ok=True)
        out["stores"][name] = entry
        print(name, {k: v for k, v in entry.items() if k != "tops"}, file=sys.stderr, flush=True)
    return out


def _how_to_read(r: dict) -> list[str]:
    caches = {name: s["page_cache"] for name, s in r["stores"].items() if s.get("page_cache")}
    if caches:
        held = "; ".join(
            f"{name}: {c['before']['resident_bytes'] / 2**30:.2f} of "
            f"{c['before']['bytes'] / 2**30:.2f} GiB in the page cache, "
            f"{c['after_evict']['resident_bytes'] / 2**30:.2f} GiB after the drop"
            for name, c in caches.items()
        )
        start = (
            "How to read the times (--cold): before the fresh process opened a store, its "
            "files were dropped from the page cache (posix_fadvise DONTNEED, checked with "
            f"mincore: {held}), as after a reboot; "
        )
    else:
        start = (
            "How to read the times: the store is opened in a fresh process after the other "
            "store's run, so its vectors are mostly not in the page cache (not checked: a "
            "store built or searched just before is mostly cached); "
        )
    return [
        start + "each timed query (`index_stores._timed_queries`: 15 single queries, then 2 "
        "batches of 16) is one it has not run before, so the pages it reranks are read from "
        "disk (cold); the parts line and the budget table re-run queries already run (warm: "
        "their pages cached)."
    ]


def markdown(r: dict) -> str:
    lines = [
        load_line(r) + (f" {r['note']}" if r.get("note") else ""),
        "",
        f"Local-answer pages (benchmarks/shared/local_answer.py), {r['needle_queries']} needle "
        "queries (the page a query was drawn from is its needle). Exact's top 10 is computed "
        "in numpy (search_large.py says how), not by Edge's exact scan; the default plan "
        "(two-stage: the token stage + the mean vector, union reranked by exact MaxSim in "
        "Edge) and the mean-gated plan (what a Qdrant server runs) are Edge's.",
        "",
        *_how_to_read(r),
        "",
    ]
    stores = r["stores"]
    lines += [
        "| store | pages | pool factor | build s (pages/s) | disk GiB | build peak RSS MiB "
        "| reopen s | first query ms | 1 query p50 / p90 ms | 16 queries p50 / p90 ms | "
        "query peak RSS MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in stores.items():
        b = s.get("build") or {}
        built = f"{b['build_s']:.0f} ({b['insert_pages_per_s']:.1f})" if b.get("build_s") else "-"
        peak = f"{b['build_peak_rss_mib']:.0f}" if b.get("build_peak_rss_mib") else "-"
        if "reopen_s" in s:
            lines.append(
                f"| {name} | {s['pages']:,} | {s['pool_factor']} | {built} | "
                f"{s['disk_mib'] / 1024:.1f} | {peak} | {s['reopen_s']:.2f} | "
                f"{s['first_query_ms']:.0f} | {s['q1_p50_ms']:.0f} / {s['q1_p90_ms']:.0f} "
                f"| {s['q16_p50_ms']:.0f} / {s['q16_p90_ms']:.0f} | "
                f"{s['peak_rss_mib']:.0f} |"
            )
    lines += [
        "",
        "| store | exact: needle@10 | default: needle@10 (of exact's) | default: "
        "recall@10 vs exact | mean-gated: needle@10 | mean-gated: recall@10 | vs the "
        "unpooled exact: exact's needle@10, recall@10 (exact / default) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, s in stores.items():
        if "needle_at_10" not in s:
            continue
        n, rc, ru = s["needle_at_10"], s["recall_at_10"], s["recall_at_10_vs_unpooled_exact"]
        of = n["edge-two-stage"] / n["exact"] if n["exact"] else float("nan")
        gated = (
            f"{100 * n['edge-mean-gated']:.0f}% | {rc['edge-mean-gated']:.3f}"
            if "edge-mean-gated" in n
            else "- (no rows / cols) | -"
        )
        lines.append(
            f"| {name} | {100 * n['exact']:.0f}% | {100 * n['edge-two-stage']:.0f}% "
            f"({100 * of:.0f}%) | {rc['edge-two-stage']:.3f} | {gated} | "
            f"{100 * n['unpooled exact']:.0f}%, {ru['exact']:.3f} / "
            f"{ru['edge-two-stage']:.3f} |"
        )
    lines.append("")
    for name, s in stores.items():
        if s.get("parts_ms"):
            p = s["parts_ms"]
            lines.append(
                f"- {name}: one query's parts (medians of {p['queries']}, after the "
                f"timings): the whole search {p['whole']:.0f} ms, the centroid scan "
                f"{p['scan']:.0f} ms, the rest (Edge: mean stage + exact rerank) "
                f"{p['rest']:.0f} ms"
            )
        lines.append(
            f"- {name}: exact from {s['exact_from']}"
            + (f"; check against Edge's exact scan: {s['check']}" if s.get("check") else "")
            + (
                f"; built by `{s['build']['command']}` from {s['build']['date']} (load "
                f"before / after {s['build']['load']})"
                if s.get("build")
                else ""
            )
        )
    for name, s in stores.items():
        if s.get("budgets"):
            lines += [
                "",
                f"{name}, the default plan's candidate budget (token stage + mean stage; "
                f"the default is {s['budgets'][0]['token_candidates']} + "
                f"{s['budgets'][0]['mean_candidates']}), same queries, one process:",
                "",
                "| token + mean candidates | needle@10 | recall@10 vs exact | 1 query p50 ms |",
                "|---|---:|---:|---:|",
            ]
            lines += [
                f"| {b['token_candidates']} + {b['mean_candidates']} | "
                f"{100 * b['needle_at_10']:.0f}% | {b['recall_at_10']:.3f} | "
                f"{b['q1_p50_ms']:.0f} |"
                for b in s["budgets"]
            ]
            lines.append("")
    gen = r.get("generated_exact_s") or {}
    if gen:
        lines.append(
            f"- generated exact: {', '.join(f'{int(k):,} pages {v:.0f} s' for k, v in gen.items())}"
            " (0: cached from an earlier run)"
        )
    return results_markdown(f"Search at scale: {r['title']}", r["machine"], lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", type=Path, action="append", default=[])
    parser.add_argument(
        "--build",
        type=Path,
        action="append",
        default=[],
        help="the --long-run JSON of each --store, in order",
    )
    parser.add_argument(
        "--scratch", type=Path, default=Path(tempfile.gettempdir()) / "colembed-search-exact"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--exact-only",
        action="store_true",
        help="compute and cache the exact top lists only (no timing)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="also compare the numpy exacts with Edge's exact scan (small stores)",
    )
    parser.add_argument(
        "--reference",
        type=int,
        metavar="PAGES",
        help="only compute and cache the generated (unpooled) exact of PAGES pages "
        "(no store needed: can run while the stores are being built)",
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="drop each store's files from the page cache before its query job "
        "(posix_fadvise; reported with mincore), so new queries read disk",
    )
    parser.add_argument("--out", default="search-large")
    parser.add_argument("--note", default="")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--pages", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--input", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        extra = json.loads(args.input.read_text()) if args.input else {}
        job = {
            "stored-exact": lambda: job_stored_exact(args.folder, args.pages),
            "edge-exact": lambda: job_edge_exact(args.folder, args.pages),
            "query": lambda: job_query(args.folder, args.pages, extra["exact"], extra["reference"]),
        }[args.job]
        print(json.dumps(job()))
        return
    if args.reference:
        args.scratch.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        _cached(
            args.scratch / f"exact-generated-{args.reference}-{NEEDLE_QUERIES}.json",
            lambda: generated_exact(args.reference, NEEDLE_QUERIES, args.workers),
        )
        print(f"generated exact of {args.reference} pages: {time.perf_counter() - t:.0f} s")
        return
    results = {
        "machine": machine_info(),
        "load_before": load_average(),
        "title": args.out,
        "note": args.note,
    }
    results.update(
        measure(
            args.store,
            args.build,
            args.scratch,
            args.workers,
            args.exact_only,
            args.check,
            args.cold,
        )
    )
    results["load_after"] = load_average()
    if args.exact_only:
        print(json.dumps({k: v for k, v in results.items() if k != "machine"}, indent=1)[:3000])
        return
    write_note(HERE / "results" / "index" / args.out, results, markdown(results))


if __name__ == "__main__":
    main()
