"""Page stores side by side: Qdrant Edge (exact, two-stage, and the schema-1 two-stage plan on the
same store), colembed's numpy scorer, qdrant-client local mode; and indexing throughput against
embedding alone.

    .venv/bin/python benchmarks/bench_index.py                 # 1,000 and 10,000 pages (~8 GB peak)
    .venv/bin/python benchmarks/bench_index.py --pages 1000    # one size
    .venv/bin/python benchmarks/bench_index.py --quick         # 200 pages, smoke (not committed)
    .venv/bin/python benchmarks/bench_index.py --ingest-only   # indexing throughput (< 5 min)
    .venv/bin/python benchmarks/bench_index.py --long-run /tmp/x --pages 10000 --set local \
        --kill-at 2500 --kill-at 5000 --kill-at 7500 [--ab-cadence]   # issue #26: kill, reopen

Long run (`--long-run`, issue #26): one build of the local-answer pages through `Store.upsert`
with the store's flush cadence, SIGKILLed at each `--kill-at` (near the most unflushed pages
seen so far, not just after a flush) and resumed; per kill the write-ahead log left, a fresh
process's open (which replays it) and a second fresh open of the same, now cleanly closed folder:
the uninterrupted open at the same page count. Peak disk sampled every second beside the final
disk; build time, flush cost, writer peak RSS. Writes benchmarks/results/index-long-N.{md,json}.

Data: synthetic pages of real shape, grid-structured: a 26-30 x 25-29 image-token grid (~750
tokens) of dim 128 plus 15 prompt rows shared by every page; each page has a topic vector and 6
regions whose directions blend smoothly over the grid, plus noise, L2-normalised (real pages have
this spatial coherence; i.i.d. random tokens would make row/column pooling meaningless). Queries:
12 tokens drawn (with noise) from one target page's grid plus 10 shared augmentation rows. Random
structure, not a trained model: two-stage recall@10 here is a floor, not the trained figure.

Each store runs in its own subprocess (peak RSS is per process): insert pages/s through colembed's
Store adapter (points with all three vectors, as `Index.add` writes them), disk size, reopen time
(a fresh process opening the folder), query p50/p90 for 1 query and for a batch of 16 queries.
edge-previous: the same store searched with the schema-1 two-stage plan (rows + cols MaxSim over
every page, `Store.plan_schema = 1`: what colembed 0.1.0 ran), so the new plan's gain is a ratio
within one run; recall@10 against exact is reported for both plans.
colembed numpy: `colembed.top_k` over the same vectors held in memory (float32).
Indexing throughput (`--no-ingest` skips it, `--ingest-only` runs it alone, `--ingest-model
tiny|bench` picks the models; default both): `Index.add` over PDFs vs `model.embed_pages` over the same pages
already rendered (same batch size), best of alternating rounds, the store opened outside the timed
part; and each stage alone in CPU seconds per page (hash, render, pool + upsert, embed). On a
machine whose cores the embedding fills, the other stages' CPU cannot hide behind it, so
embed CPU / (embed + render + hash + store CPU) bounds the ratio. Two models: the tiny one
(embedding unrealistically cheap, so the bound is low) and the Qwen2-VL-2B widths at 2 + 2 layers
that bench_embed.py --quick builds (cached in its --workdir; what users run has these widths and
16x the depth, so their bound is higher still).

Writes benchmarks/results/index.{md,json} (--quick: index-quick.*, --ingest-only: index-ingest.*).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine import load_average, machine_info, markdown_header, rss_mib  # noqa: E402

DIM = 128
PROMPT_ROWS = 15
QUERY_TOKENS = 12
AUGMENTATION_ROWS = 10
REGIONS = 6
QUERY_ROUNDS = {1000: (10, 3)}  # pages up to -> (single-query rounds, 16-query rounds)
# 10,000 pages: 15 single queries (p50 of 3 moved from ~105 to 232 ms with the first queries of
# a freshly opened store), 2 batches; the slow qdrant-client local mode: 3 and 1
LARGE_ROUNDS = (15, 2)
SLOW_ROUNDS = (3, 1)
RECALL_QUERIES = 16
NUMPY_MAX_PAGES = 1000  # 10,000 pages = 3.9 GB of float32 and ~10x the 1,000-page query time
K = 10
BACKENDS = ("edge-two-stage", "edge-mean-gated", "edge-previous", "edge-exact", "numpy",
            "client-local")
# one store, four plans: the default (token stage), the schema-2 plan without it (what 0.2 ran,
# and what a Qdrant server runs), the schema-1 plan, exact
EDGE_BACKENDS = ("edge-two-stage", "edge-mean-gated", "edge-previous", "edge-exact")
SETS = ("local", "page-wide")  # local_answer.py's pages, and synthetic_page's (a page-wide topic)
NEEDLE_QUERIES = int(os.environ.get("COLEMBED_NEEDLE_QUERIES", 40))  # exact runs each: 3 s+ at 10k
CLIENT_LOCAL_MAX_PAGES = 1000


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def shared_rows(seed: int = 12345) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return _unit(rng.standard_normal((PROMPT_ROWS, DIM))), _unit(rng.standard_normal((AUGMENTATION_ROWS, DIM)))


def synthetic_page(i: int):
    """(vectors (rows, 128) float32, layout) of page i: deterministic in i."""
    from colembed.model import PageLayout

    rng = np.random.default_rng(1_000_003 + i)
    rows, cols = int(rng.integers(26, 31)), int(rng.integers(25, 30))
    topic = rng.standard_normal(DIM)
    anchors = rng.standard_normal((REGIONS, DIM)) * 1.5
    centres = rng.uniform(0, 1, (REGIONS, 2)) * (rows, cols)
    rr, cc = np.mgrid[0:rows, 0:cols]
    dist = (rr[..., None] - centres[:, 0]) ** 2 + (cc[..., None] - centres[:, 1]) ** 2
    weights = np.exp(-dist / (2 * (0.15 * max(rows, cols)) ** 2))
    grid = 0.5 * topic + weights @ anchors + 0.5 * rng.standard_normal((rows, cols, DIM))
    prompt, _ = shared_rows()
    head = prompt[:4] + 0.05 * rng.standard_normal((4, DIM))
    tail = prompt[4:] + 0.05 * rng.standard_normal((PROMPT_ROWS - 4, DIM))
    vectors = np.concatenate([_unit(head), _unit(grid.reshape(-1, DIM)), _unit(tail)])
    layout = PageLayout(grid_rows=rows, grid_cols=cols, image_start=4, num_tokens=len(vectors),
                        token_px=28)
    return vectors, layout


def query_targets(n_pages: int, count: int, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_pages, count)


def synthetic_queries(n_pages: int, count: int, seed: int = 7) -> list[np.ndarray]:
    rng = np.random.default_rng(seed + 1)
    _, augmentation = shared_rows()
    out = []
    for target in query_targets(n_pages, count, seed):
        vectors, layout = synthetic_page(int(target))
        image = vectors[layout.image_rows]
        picked = image[rng.choice(len(image), QUERY_TOKENS, replace=False)]
        noise = 0.3 * rng.standard_normal(picked.shape) / np.sqrt(DIM)  # 0.3 of a unit token
        out.append(np.concatenate([_unit(picked + noise), augmentation]))
    return out


def _timed_queries(search, queries: list[np.ndarray], pages: int, slow: bool = False) -> dict:
    """p50/p90 of one query at a time and of batches of 16 (fewer rounds for large stores)."""
    singles, batches = (SLOW_ROUNDS if slow else QUERY_ROUNDS[1000] if pages <= 1000
                        else LARGE_ROUNDS)
    one, sixteen = [], []
    t = time.perf_counter()
    search(queries[-1:])  # the first query after opening (what a reopened index makes wait); warm-up
    first = time.perf_counter() - t
    for r in range(singles):
        q = queries[r % len(queries)]
        t = time.perf_counter()
        search([q])
        one.append(time.perf_counter() - t)
    for r in range(batches):
        batch = queries[(r * 16) % len(queries):][:16]
        batch = batch + queries[:16 - len(batch)]
        t = time.perf_counter()
        search(batch)
        sixteen.append(time.perf_counter() - t)
    q = lambda xs, p: float(np.percentile(xs, p)) * 1000  # noqa: E731
    return {"first_query_ms": first * 1000, "q1_p50_ms": q(one, 50), "q1_p90_ms": q(one, 90),
            "q16_p50_ms": q(sixteen, 50), "q16_p90_ms": q(sixteen, 90)}


def _disk_mib(folder: Path) -> float:
    """Blocks really used (Edge preallocates sparse files: their apparent size is far larger)."""
    return sum(f.stat().st_blocks * 512 for f in folder.rglob("*") if f.is_file()) / 2**20


def _peak_rss_mib() -> float:
    """VmHWM (ru_maxrss would carry the parent's peak across exec)."""
    return rss_mib()["peak"]


def page_of(data: str, i: int):
    """(vectors, layout) of page i of a data set."""
    if data == "local":
        from local_answer import local_page

        return local_page(i)[:2]
    return synthetic_page(i)


def queries_of(data: str, pages: int, count: int) -> tuple[list[np.ndarray], np.ndarray]:
    """(queries, the page each was drawn from) of a data set."""
    if data == "local":
        import local_answer

        return (local_answer.local_queries(pages, count),
                local_answer.query_targets(pages, count))
    return synthetic_queries(pages, count), query_targets(pages, count)


def bench_point(data: str, i: int):
    """Page i of a data set as the point `Index.add` would store (payload of a 10-page PDF)."""
    from colembed.index.schema import make_point

    vectors, layout = page_of(data, i)
    return make_point(vectors, layout, {
        "path": f"/docs/{i // 10}.pdf", "page": i % 10 + 1, "pages": 10, "sha256": f"{i // 10:064x}",
        "width": 683, "height": 883, "model": "synthetic", "variant": "fp32",
        "manifest_sha256": "0" * 64, "schema": 1, "model_source": "synthetic", "serial": i})


def worker_build(backend: str, pages: int, folder: Path, data: str = "page-wide") -> dict:
    """Insert `pages` pages into a new store in `folder` (one subprocess)."""
    from colembed.index.backends import open_store

    store = open_store(folder, dim=DIM, local=backend == "client-local")
    t = time.perf_counter()
    batch = []
    for i in range(pages):
        batch.append(bench_point(data, i))
        if len(batch) == 64:
            store.upsert(batch)
            batch = []
    store.upsert(batch)
    store.flush()
    insert_s = time.perf_counter() - t
    store.close()
    return {"insert_pages_per_s": pages / insert_s, "insert_s": insert_s,
            "disk_mib": _disk_mib(folder), "build_peak_rss_mib": _peak_rss_mib()}


def _use_plan(store, backend: str) -> None:
    """Point the store at the plan a backend names."""
    store.plan_schema = 1 if backend == "edge-previous" else None
    store.use_tokens = False if backend in ("edge-mean-gated", "edge-previous") else None


def worker_query(backend: str, pages: int, folder: Path, data: str = "page-wide") -> dict:
    """Reopen the store in `folder` and time queries (one subprocess)."""
    from colembed.index.backends import open_store

    t = time.perf_counter()
    store = open_store(folder, local=backend == "client-local")
    reopen = time.perf_counter() - t
    mode = "exact" if backend in ("edge-exact", "client-local") else "two-stage"
    _use_plan(store, backend)
    queries, _ = queries_of(data, pages, 64)
    timings = _timed_queries(lambda qs: store.search(qs, K, mode), queries, pages,
                             slow=backend == "client-local" or (mode == "exact" and pages >= 10000))
    result = {"reopen_s": reopen, **timings, "peak_rss_mib": _peak_rss_mib()}
    if backend == "edge-two-stage":
        result.update(_quality(store, pages, data))
    store.close()
    return result


def _quality(store, pages: int, data: str) -> dict:
    """Per plan: the needle (the page a query was drawn from) in the top 10 and first, recall@10
    against exact; Edge's exact scores against numpy MaxSim over the vectors it stores
    (float16)."""
    queries, targets = queries_of(data, pages, NEEDLE_QUERIES)
    exact = store.search(queries, K, "exact")
    by_plan = {}
    for backend in EDGE_BACKENDS[:-1]:
        _use_plan(store, backend)
        by_plan[backend] = store.search(queries, K, "two-stage")
    _use_plan(store, "edge-two-stage")
    fast, previous = by_plan["edge-two-stage"], by_plan["edge-previous"]
    first = lambda rows: float(np.mean([int(r[0].payload["serial"]) == int(t)  # noqa: E731
                                         for r, t in zip(rows, targets)]))
    needle = lambda rows: float(np.mean([any(int(h.payload["serial"]) == int(t)  # noqa: E731
                                             for h in r) for r, t in zip(rows, targets)]))
    worst = 0.0
    for q, hits in zip(queries[:4], exact[:4]):
        stored = store.page_vectors([h.id for h in hits[:3]])
        for h in hits[:3]:
            worst = max(worst, abs(float((q @ stored[h.id].T).max(axis=1).sum()) - h.score))
    recall = lambda rows: float(np.mean([len({h.id for h in a} & {h.id for h in b}) / K  # noqa: E731
                                         for a, b in zip(exact, rows)]))
    return {"recall_at_10": recall(fast), "previous_recall_at_10": recall(previous),
            "target_at_1": {"exact": first(exact), "two-stage": first(fast),
                            "previous": first(previous)},
            "needle_at_10": {"edge-exact": needle(exact),
                             **{b: needle(rows) for b, rows in by_plan.items()}},
            "recall_vs_exact": {b: recall(rows) for b, rows in by_plan.items()},
            "needle_queries": len(queries), "score_max_abs_diff_vs_numpy": worst}


def worker_numpy(pages: int) -> dict:
    import colembed

    if pages > NUMPY_MAX_PAGES:
        return {"skipped": f"over {NUMPY_MAX_PAGES:,} pages (see NUMPY_MAX_PAGES)"}
    t = time.perf_counter()
    docs = [synthetic_page(i)[0] for i in range(pages)]
    build = time.perf_counter() - t
    queries = synthetic_queries(pages, 64)
    timings = _timed_queries(lambda qs: colembed.top_k(qs, docs, K, backend="numpy"), queries,
                             pages)
    return {"build_s": build, **timings, "peak_rss_mib": _peak_rss_mib(),
            "memory_mib": sum(d.nbytes for d in docs) / 2**20}


# ------------------------------------------------------------------ long runs (issue #26)
LONG_BATCH = 64  # pages handed to Store.upsert at a time by the long-run writer
LONG_REPORT_EVERY = 64  # pages between the writer's progress lines (the driver kills on one)


def worker_long(pages: int, folder: Path, data: str, log_bytes: float | None = None) -> dict:
    """Store pages 0..pages-1 of `data` into the Edge folder, resuming where a killed run left
    off (every stored page has its token-table row: a chunk stored but not yet in the table is
    written again; an upsert of the same id replaces it). A progress line after every batch:
    `stored N unflushed U rss_peak_mib R` (what the driver kills on). `log_bytes`: the flush
    cadence's FLUSH_MAX_LOG_BYTES for this writer (inf: the cadence before it existed)."""
    from colembed.index import edge
    from colembed.index.backends import open_store

    if log_bytes is not None:
        edge.FLUSH_MAX_LOG_BYTES = log_bytes

    store = open_store(folder, dim=DIM)
    start = min(store.count(), len(store.tokens))
    t = time.perf_counter()
    for lo in range(start, pages, LONG_BATCH):
        store.upsert([bench_point(data, i) for i in range(lo, min(lo + LONG_BATCH, pages))])
        print(f"stored {min(lo + LONG_BATCH, pages)} unflushed {store._unflushed} rss_peak_mib "
              f"{_peak_rss_mib():.0f}", flush=True)
    store.flush()
    wrote = time.perf_counter() - t
    out = {"resumed_from": start, "stored": store.count(), "write_s": wrote,
           "flushes": store.flushes, "flush_s": store.flush_seconds,
           "peak_rss_mib": _peak_rss_mib()}
    store.close()
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
    return {"open_s": opened, "pages": count, "token_table_current": current,
            "first_query_ms": first * 1000, "peak_rss_mib": _peak_rss_mib()}


def long_run(pages: int, kill_at: list[int], folder: Path, data: str, queries: bool,
             ab: bool = False) -> dict:
    """One long build of `pages` pages into `folder`, SIGKILLed once at each of `kill_at` (pages
    stored), each kill followed by: the log left (allocated bytes), a fresh process opening the
    folder (the replay), a second fresh open of the same folder (now clean: the like-for-like
    uninterrupted open at the same page count), then the build resumed. Disk of the folder
    sampled throughout (allocated blocks); build time = the writers' wall time, kills included.
    A kill lands past its point at the first progress line whose unflushed pages are at least
    3/4 of the most seen so far under that cadence (near the worst case, not just after a flush).
    `ab`: the legs alternate between the cadence without its byte bound (FLUSH_MAX_LOG_BYTES =
    inf: as before it) and the current one, so the two are compared in one run, interleaved."""
    import signal

    from index_disk import Sampler, allocated, wal_bytes

    from colembed.index import edge

    if folder.exists():
        raise SystemExit(f"{folder}: exists; the long run builds a new index (remove it first)")
    sampler = Sampler(folder, every=1.0)
    folder.mkdir(parents=True)
    sampler.start()
    legs, kills, build_s, rss = [], [], 0.0, 0.0
    extra = ["--set", data]
    most = {"current": 0, "no byte bound": 0}
    for leg, point in enumerate([*sorted(kill_at), None]):
        cadence = "no byte bound" if ab and point is not None and leg % 2 == 0 else "current"
        cmd = [sys.executable, __file__, "--worker", "long", "--pages", str(pages),
               "--folder", str(folder), *extra,
               *(["--log-bytes", "inf"] if cadence != "current" else [])]
        t = time.perf_counter()
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        last, done, killed = None, None, False
        for line in child.stdout:
            if line.startswith("stored "):
                words = line.split()
                last = {"stored": int(words[1]), "unflushed": int(words[3])}
                rss = max(rss, float(words[5]))
                if (point is not None and last["stored"] >= point
                        and last["unflushed"] >= max(1, 0.75 * most[cadence])):
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
        wal = wal_bytes(folder)
        replay = _sub("reopen", pages, folder, tuple(extra))
        clean = _sub("reopen", pages, folder, tuple(extra))
        kills.append({"cadence": cadence, "killed_at": last, "wal_mb": wal / 2**20, "after_kill": replay,
                      "clean": clean, "wal_after_clean_close_mb": wal_bytes(folder) / 2**20,
                      "open_over_clean_s": replay["open_s"] - clean["open_s"]})
        print("kill", kills[-1], file=sys.stderr, flush=True)
    sampler.done.set()
    sampler.join()
    final = allocated(folder)
    result = {"pages": pages, "set": data, "folder": str(folder), "build_s": build_s,
              "insert_pages_per_s": pages / build_s, "build_peak_rss_mib": rss,
              "peak_disk_mib": max(sampler.peak, final) / 2**20, "final_disk_mib": final / 2**20,
              "final_leg": legs[-1], "kills": kills,
              "reopen": _sub("reopen", pages, folder, tuple(extra)),
              "cadence": {k: getattr(edge, k) for k in (
                  "FLUSH_FRACTION", "FLUSH_MIN_PAGES", "FLUSH_MAX_PAGES", "FLUSH_SECONDS",
                  "FLUSH_MAX_LOG_BYTES")}}
    if queries:
        result["queries"] = {b: _sub(f"query:{b}", pages, folder, tuple(extra))
                             for b in ("edge-two-stage", "edge-exact")}
    return result


def long_from_log(log: Path, command: str, pages: int, data: str, stopped: str) -> dict:
    """The kills of a --long-run stopped before its end, from the `kill {...}` lines its driver
    wrote to stderr (each written once that kill's reopens were measured)."""
    import ast

    from colembed.index import edge

    kills = [ast.literal_eval(line[5:]) for line in log.read_text().splitlines()
             if line.startswith("kill {")]
    return {"pages": pages, "set": data, "kills": kills, "stopped": stopped, "command": command,
            "cadence": {k: getattr(edge, k) for k in (
                "FLUSH_FRACTION", "FLUSH_MIN_PAGES", "FLUSH_MAX_PAGES", "FLUSH_SECONDS",
                "FLUSH_MAX_LOG_BYTES")}}


def long_markdown(r: dict) -> str:
    lines = [f"# Long index run: {r['pages']:,} pages ({r['set']} set), killed and resumed", "",
             markdown_header(r["machine"]), "",
             f"Load average before / after: {r['load_before']} / {r['load_after']} on "
             f"{os.cpu_count()} cores" + load_caveat(r), "",
             "One build through `Store.upsert` (64 pages a call, `bench_point` payloads; the "
             "store's own flush cadence), SIGKILLed at each kill point and resumed from what "
             "was stored. After a kill: the write-ahead log left (allocated MB), a fresh process "
             "opening the folder (Edge replays the log; open = `open_store`, then count and a "
             "first two-stage query), then a second fresh open of the same folder, which the "
             "first closed cleanly: the uninterrupted open at the same page count "
             "(like-for-like). Disk = allocated blocks of the folder, sampled every second.", "",
             f"Flush cadence: {r['cadence']}.", ""]
    if "stopped" in r:
        lines += [f"**Stopped before the end** ({r['stopped']}): the kills below are the ones the "
                  "run made before it was stopped; no finished-build figures.", ""]
    else:
        lines += [
             f"Build: {r['pages']:,} pages in {r['build_s']:.0f} s ({r['insert_pages_per_s']:.1f} "
             f"pages/s, kills and resumes included); writer peak RSS "
             f"{r['build_peak_rss_mib']:.0f} MiB; flushes in the last leg "
             f"{r['final_leg']['flushes']} costing {r['final_leg']['flush_s']:.1f} s of its "
             f"{r['final_leg']['write_s']:.0f} s. Peak disk during the build "
             f"{r['peak_disk_mib']:.0f} MiB, final {r['final_disk_mib']:.0f} MiB "
             f"({r['peak_disk_mib'] / r['final_disk_mib']:.2f}x).", ""]
    lines += ["| cadence | killed at pages | unflushed pages then | log left MB | open after "
              "kill s | clean open, same pages s | difference s | pages after reopen | first query ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k in r["kills"]:
        lines.append(f"| {k.get('cadence', 'current')} | {k['killed_at']['stored']:,} | "
                     f"{k['killed_at']['unflushed']} | "
                     f"{k['wal_mb']:.0f} | {k['after_kill']['open_s']:.2f} | "
                     f"{k['clean']['open_s']:.2f} | {k['open_over_clean_s']:+.2f} | "
                     f"{k['after_kill']['pages']:,} | {k['after_kill']['first_query_ms']:.0f} |")
    o = r.get("reopen")
    lines += [""] if o is None else [
              "", f"Reopen of the finished index ({o['pages']:,} pages): {o['open_s']:.2f} s, "
              f"first query {o['first_query_ms']:.0f} ms, peak RSS {o['peak_rss_mib']:.0f} MiB.",
              ""]
    for name, q in (r.get("queries") or {}).items():
        lines.append(f"- {name}: reopen {q['reopen_s']:.2f} s, first query "
                     f"{q['first_query_ms']:.0f} ms, 1 query p50 / p90 {q['q1_p50_ms']:.0f} / "
                     f"{q['q1_p90_ms']:.0f} ms, 16 queries p50 / p90 {q['q16_p50_ms']:.0f} / "
                     f"{q['q16_p90_ms']:.0f} ms, peak RSS {q['peak_rss_mib']:.0f} MiB")
    two = (r.get("queries") or {}).get("edge-two-stage", {})
    if "needle_at_10" in two:
        n = two["needle_at_10"]
        lines += ["", f"Needle in top 10 over {two['needle_queries']} queries: two-stage "
                  f"{100 * n['edge-two-stage']:.0f}%, exact {100 * n['edge-exact']:.0f}%; "
                  f"recall@10 vs exact {two['recall_at_10']:.3f}."]
    return "\n".join(lines) + "\n"


def run_worker(args) -> None:
    folder = Path(args.folder) if args.folder else None
    if args.worker == "numpy":
        out = worker_numpy(args.pages)
    elif args.worker.startswith("build:"):
        out = worker_build(args.worker[6:], args.pages, folder, args.set[0])
    elif args.worker == "long":
        out = worker_long(args.pages, folder, args.set[0], args.log_bytes)
    elif args.worker == "reopen":
        out = worker_reopen(args.pages, folder, args.set[0])
    elif args.worker.startswith("ingest:"):
        out = bench_ingest(args.worker[7:], args.model, folder)
    else:
        out = worker_query(args.worker[6:], args.pages, folder, args.set[0])
    print(json.dumps(out))


def _sub(worker: str, pages: int, folder: Path | None = None, extra: tuple = ()) -> dict:
    cmd = [sys.executable, __file__, "--worker", worker, "--pages", str(pages), *extra]
    if folder:
        cmd += ["--folder", str(folder)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_stores(pages: int, scratch: Path, data: str = "page-wide",
                 store: Path | None = None) -> dict:
    """Every backend on one data set; `store`: an Edge folder this script built before with the
    same set and size (its build figures are then not measured: "reused")."""
    results = {}
    edge = store or scratch / f"edge-{data}-{pages}"
    extra = ("--set", data)
    if store is None:
        build = _sub("build:edge", pages, edge, extra)
    else:
        from colembed.index.store import upgrade_index

        t = time.perf_counter()
        upgrade_index(store)  # a folder of an older build: its token table made from its vectors
        build = {"reused": str(store), "table_rebuild_s": time.perf_counter() - t,
                 "disk_mib": _disk_mib(store)}
    for backend in EDGE_BACKENDS:
        results[backend] = {**build, **_sub(f"query:{backend}", pages, edge, extra)}
        print(data, backend, pages, results[backend], file=sys.stderr, flush=True)
    if store is None:
        shutil.rmtree(edge)
    if data == "local":
        return results
    if pages <= NUMPY_MAX_PAGES:
        results["numpy"] = _sub("numpy", pages, None, extra)
        print("numpy", pages, results["numpy"], file=sys.stderr, flush=True)
    if pages <= CLIENT_LOCAL_MAX_PAGES:
        local = scratch / f"local-{pages}"
        build = _sub("build:client-local", pages, local, extra)
        results["client-local"] = {**build, **_sub("query:client-local", pages, local, extra)}
        print("client-local", pages, results["client-local"], file=sys.stderr, flush=True)
        shutil.rmtree(local)
    return results


def make_pdfs(folder: Path, files: int, pages: int) -> None:
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        images = []
        for p in range(pages):
            im = Image.new("RGB", (1275, 1650), "white")  # letter at 150 dpi
            draw = ImageDraw.Draw(im)
            for line in range(40):
                draw.text((100, 100 + 36 * line), f"file {f} page {p} line {line} " * 4, fill="black")
            images.append(im)
        images[0].save(folder / f"doc{f}.pdf", save_all=True, append_images=images[1:], resolution=150)


INGEST_MODELS = {  # name -> (label, files, pages per file)
    "tiny": ("tiny random-weight model (export/tiny.py \"tiny\"): unrealistically cheap embedding", 6, 4),
    "bench": ("Qwen2-VL-2B widths at 2 vision + 2 language layers (export/tiny.py \"qwen2-vl-2b\", "
              "as bench_embed.py --quick builds it): real per-layer cost, 1/16 of the depth", 2, 4),
}
INGEST_ROUNDS = 2
BENCH_WORKDIR = Path(os.environ.get("COLEMBED_BENCH_DIR",  # bench_embed.py's --workdir default
                                    Path.home() / ".cache" / "colembed-bench"))


def ingest_model(name: str, given: Path | None, scratch: Path) -> Path:
    """The model folder for the ingest check: given, the tiny one (built here), or the 2+2-layer
    benchmark model (built once into bench_embed.py's --workdir cache, shared with it)."""
    if given is not None:
        return given
    if name == "bench":
        import types

        from bench_embed import prepare_model

        args = types.SimpleNamespace(family="colqwen2", vision_depth=2, text_layers=2, variants=["fp32"])
        BENCH_WORKDIR.mkdir(parents=True, exist_ok=True)
        return prepare_model(args, BENCH_WORKDIR, lambda m: print(m, file=sys.stderr))[1]
    from colembed_export.exporter import export_model
    from colembed_export.tiny import build_checkpoint

    checkpoint = build_checkpoint(scratch / "ckpt", "tiny", seed=0)
    return export_model(checkpoint, scratch / "model", name="colqwen2-tiny-random").folder


def _clock() -> tuple[float, float]:
    return time.process_time(), time.perf_counter()


def _since(start: tuple[float, float]) -> dict:
    """CPU seconds of every thread of this process, and wall seconds, since `start`."""
    return {"cpu_s": time.process_time() - start[0], "wall_s": time.perf_counter() - start[1]}


def source_costs(model, docs: Path) -> tuple[dict, list]:
    """Hashing and rendering alone (as the render thread does them), and the rendered pages."""
    from colembed.index.sources import Document, file_sha256

    paths = sorted(docs.glob("*.pdf"))
    start = _clock()
    for path in paths:
        file_sha256(path)
    costs = {"hash": _since(start)}
    start = _clock()
    images = []
    for path in paths:
        with Document(path, max_pixels=model.config.max_pixels) as doc:
            images += [image for _, image in doc.iter_pages(range(1, doc.pages + 1))]
    costs["render"] = _since(start)
    return costs, images


def store_cost(embedded: list, folder: Path, dim: int) -> dict:
    """Pooling and upserting these pages into a fresh store alone, as the writer thread does:
    one upsert per batch of 4, then a flush."""
    from colembed.index.schema import make_point
    from colembed.index.backends import open_store

    store = open_store(folder, dim=dim)
    payload = {"path": "/docs/a.pdf", "pages": len(embedded), "sha256": "0" * 64, "width": 1,
               "height": 1, "model": "m", "variant": "fp32", "manifest_sha256": "0", "schema": 1}
    start = _clock()
    for lo in range(0, len(embedded), 4):
        store.upsert([make_point(*embedded[i], dict(payload, page=i + 1))
                      for i in range(lo, min(lo + 4, len(embedded)))])
    store.flush()
    cost = _since(start)
    store.close()
    return cost


def bench_ingest(name: str, given: Path | None, scratch: Path) -> dict:
    """`Index.add` over PDFs against `model.embed_pages` over the same pages already rendered,
    in alternating rounds (best of each), with each stage's CPU cost and the bound they set."""
    import colembed

    label, files, pages = INGEST_MODELS[name]
    model = colembed.load(ingest_model(name, given, scratch / name))
    docs = scratch / f"pdfs-{name}"
    make_pdfs(docs, files, pages)
    costs, images = source_costs(model, docs)
    rounds: dict[str, list] = {"embed": [], "index": []}
    for r in range(INGEST_ROUNDS):
        start = _clock()
        embedded = model.embed_pages(images, batch_size=4)
        rounds["embed"].append(_since(start))
        with colembed.Index(scratch / name / f"db-{r}", model=model) as index:  # opened untimed
            start = _clock()
            result = index.add(docs, progress=False)
            rounds["index"].append(_since(start))
        assert result.pages_added == len(images) and result.ok, result
    costs["store"] = store_cost(embedded, scratch / name / "store-alone", model.embedding_size)
    n = len(images)
    embed = min(rounds["embed"], key=lambda x: x["wall_s"])
    index = min(rounds["index"], key=lambda x: x["wall_s"])
    per_page = {stage: {"cpu_ms": c["cpu_s"] / n * 1000, "wall_ms": c["wall_s"] / n * 1000}
                for stage, c in {**costs, "embed": embed, "index": index}.items()}
    other = sum(costs[s]["cpu_s"] for s in ("hash", "render", "store"))
    return {"model": label, "model_folder": str(given or name), "pages": n,
            "max_pixels": model.config.max_pixels, "ms_per_page": per_page, "rounds": rounds,
            "bound": embed["cpu_s"] / (embed["cpu_s"] + other),
            "embed_only_pages_per_s": n / embed["wall_s"], "index_pages_per_s": n / index["wall_s"],
            "ratio": embed["wall_s"] / index["wall_s"], "cpu_ratio": embed["cpu_s"] / index["cpu_s"],
            "peak_rss_mib": _peak_rss_mib()}


def load_caveat(results: dict) -> str:
    """Say that absolute times are inflated only when the load average shows other work ran."""
    loads = [max(results.get(key) or [0.0]) for key in ("load_before", "load_after")]
    if max(loads) <= 0.75 * (os.cpu_count() or 1):
        return " (a quiet machine)."
    return (" (other processes held the cores during the run: absolute times are inflated and "
            "matter less than the ratios between rows of one table).")


def markdown(results: dict) -> str:
    stores = ["Synthetic grid-structured pages (see the script's docstring); vectors stored as "
              "float16 in Qdrant; k = 10. Reopen = a fresh process opening the folder; first "
              "query = that process's first search (Qdrant Edge maps the page vectors from disk "
              "and drops its files from the page cache on close, so it reads what it needs "
              "then). Peak RSS of the querying process.", ""] if results["stores"] else []
    title = "Index store benchmark" if results["stores"] else "Indexing throughput benchmark"
    lines = [f"# {title}", "", markdown_header(results["machine"]), "", *stores,
             f"Load average before / after: {results.get('load_before')} / "
             f"{results.get('load_after')} on {os.cpu_count()} cores" + load_caveat(results),
             ""]
    for key, by_backend in results["stores"].items():
        data, _, pages = key.rpartition(":")
        lines += [f"## {int(pages):,} pages, {data or 'page-wide'} set", "",
                  "| store | insert pages/s | disk MiB | reopen s | first query ms | 1 query p50 / "
                  "p90 ms | 16 queries p50 / p90 ms | peak RSS MiB |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for name, r in by_backend.items():
            if "skipped" in r:
                lines.append(f"| {name} | skipped: {r['skipped']} | | | | | | |")
                continue
            insert = (f"{r['insert_pages_per_s']:.0f}" if "insert_pages_per_s" in r else
                      "(reused)" if "reused" in r else "-")
            disk = f"{r['disk_mib']:.0f}" if "disk_mib" in r else f"({r['memory_mib']:.0f} in RAM)"
            reopen = f"{r['reopen_s']:.2f}" if "reopen_s" in r else "-"
            first = f"{r['first_query_ms']:.0f}" if "first_query_ms" in r else "-"
            lines.append(f"| {name} | {insert} | {disk} | {reopen} | {first} | {r['q1_p50_ms']:.0f} / "
                         f"{r['q1_p90_ms']:.0f} | {r['q16_p50_ms']:.0f} / {r['q16_p90_ms']:.0f} "
                         f"| {r['peak_rss_mib']:.0f} |")
        lines += ["", *quality_markdown(by_backend), ""]
    for name, i in (results.get("ingest") or {}).items():
        lines += ingest_markdown(name, i)
    return "\n".join(lines)


def quality_markdown(by_backend: dict) -> list[str]:
    """Recall and speed of the two-stage plans against exact, as same-run ratios."""
    two, exact = by_backend["edge-two-stage"], by_backend["edge-exact"]
    needle = ["| plan | needle in top 10 | of exact's | recall@10 vs exact | 1 query p50 ms |",
              "|---|---:|---:|---:|---:|"]
    base = two.get("needle_at_10", {}).get("edge-exact")
    for name in EDGE_BACKENDS if base is not None else ():
        n = two["needle_at_10"][name]
        rec = two["recall_vs_exact"].get(name, 1.0)
        needle.append(f"| {name} | {100 * n:.0f}% | {100 * n / max(base, 1e-9):.0f}% | "
                      f"{rec:.3f} | {by_backend[name]['q1_p50_ms']:.0f} |")
    if base is not None:
        needle += ["", f"Needle = the page a query was drawn from, over "
                   f"{two['needle_queries']} queries.", ""]
    previous, first = by_backend.get("edge-previous"), two["target_at_1"]
    lines = [*needle, f"Two-stage recall@10 against exact: {two['recall_at_10']:.3f} (schema-1 plan, "
             f"edge-previous: {two.get('previous_recall_at_10', float('nan')):.3f}; synthetic "
             "vectors: a floor, not a trained model's figure). Edge exact scores vs numpy MaxSim "
             f"over the stored vectors: max abs diff {two['score_max_abs_diff_vs_numpy']:.1e}. "
             f"The page a query was drawn from ranks first: exact {first['exact']:.2f}, two-stage "
             f"{first['two-stage']:.2f}, previous plan {first.get('previous', float('nan')):.2f}.",
             "", f"1 query p50: two-stage {exact['q1_p50_ms'] / two['q1_p50_ms']:.1f}x faster "
             "than exact"]
    if previous:
        ratio = previous["q1_p50_ms"] / two["q1_p50_ms"]
        lines[-1] += (f", {ratio:.1f}x faster than" if ratio >= 1 else f", {1 / ratio:.1f}x slower than")
        lines[-1] += " the schema-1 plan on the same store in the same run"
    lines[-1] += "."
    return lines


def ingest_markdown(name: str, i: dict) -> list[str]:
    ms = i["ms_per_page"]
    rows = [("hash (sha256 of the file)", "hash"), ("render (pypdfium2, render thread)", "render"),
            ("pool + upsert (writer thread)", "store"), ("embed (`model.embed_pages` alone)", "embed"),
            ("`Index.add` (all of it, pipelined)", "index")]
    return [f"## Indexing throughput vs embedding alone: {name}", "",
            f"{i['pages']} PDF pages (letter, text as images) at {i['max_pixels']:,} pixels, "
            f"{i['model']}. Each stage alone, per page (CPU = all threads of the process):", "",
            "| stage | CPU ms/page | wall ms/page |", "|---|---:|---:|",
            *[f"| {label} | {ms[key]['cpu_ms']:.1f} | {ms[key]['wall_ms']:.1f} |"
              for label, key in rows],
            "", f"Bound (embedding CPU / all CPU, reached when embedding fills the cores): "
            f"**{100 * i['bound']:.1f}%**. Measured: `Index.add` {i['index_pages_per_s']:.3f} "
            f"pages/s vs `embed_pages` {i['embed_only_pages_per_s']:.3f} pages/s: "
            f"**{100 * i['ratio']:.1f}%** (best of {INGEST_ROUNDS} alternating rounds; the store "
            "is opened and closed outside the timed part). CPU seconds of `embed_pages` / of "
            f"`Index.add` (the ratio once the cores are full, as under load): "
            f"{100 * i['cpu_ratio']:.1f}%. Peak RSS {i['peak_rss_mib']:.0f} MiB.", ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, action="append", help="store sizes (default 1000, 10000)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", type=Path,
                        help="a model folder for the ingest check instead of --ingest-model's")
    parser.add_argument("--no-ingest", action="store_true", help="stores only")
    parser.add_argument("--ingest-only", action="store_true",
                        help="indexing throughput only (writes index-ingest.{md,json})")
    parser.add_argument("--ingest-model", choices=sorted(INGEST_MODELS), action="append",
                        help="models for the ingest check (default: tiny and bench)")
    parser.add_argument("--set", choices=SETS, action="append",
                        help="data sets (default both; local_answer.py's and the page-wide one)")
    parser.add_argument("--store", type=Path,
                        help="query this Edge folder (built before by this script with one --set "
                             "and one --pages) instead of building one")
    parser.add_argument("--long-run", type=Path, metavar="FOLDER",
                        help="one long build of --pages pages into FOLDER (new), killed at each "
                             "--kill-at and resumed (issue #26); writes index-long-N.{md,json}")
    parser.add_argument("--kill-at", type=int, action="append", default=[],
                        help="with --long-run: SIGKILL the writer once this many pages are stored")
    parser.add_argument("--ab-cadence", action="store_true",
                        help="with --long-run: alternate the legs between the cadence without its "
                             "byte bound and the current one (an interleaved A/B of the kills)")
    parser.add_argument("--log-bytes", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--long-from-log", nargs=3, metavar=("LOG", "WHY", "COMMAND"),
                        help="write the results of a --long-run stopped early from its stderr LOG "
                             "(its kill lines), saying WHY it stopped and its COMMAND")
    parser.add_argument("--long-queries", action="store_true",
                        help="with --long-run: then time two-stage and exact queries on it")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.set = args.set or list(SETS)
    if args.worker:
        args.pages = args.pages[0]
        return run_worker(args)
    if args.long_from_log:
        log, stopped, command = args.long_from_log
        pages = (args.pages or [10000])[0]
        result = {"machine": dict(machine_info(), command=command), "load_before": None,
                  **long_from_log(Path(log), command, pages, args.set[0], stopped),
                  "load_after": load_average()}
        name = f"index-long-{pages // 1000}k" if pages % 1000 == 0 else f"index-long-{pages}"
        (HERE / "results" / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        (HERE / "results" / f"{name}.md").write_text(long_markdown(result))
        print(long_markdown(result))
        return
    if args.long_run:
        pages = (args.pages or [10000])[0]
        result = {"machine": machine_info(), "load_before": load_average()}
        result.update(long_run(pages, args.kill_at, args.long_run, args.set[0],
                               args.long_queries, args.ab_cadence))
        result["load_after"] = load_average()
        result["command"] = "python benchmarks/bench_index.py " + " ".join(sys.argv[1:])
        name = f"index-long-{pages // 1000}k" if pages % 1000 == 0 else f"index-long-{pages}"
        (HERE / "results" / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        (HERE / "results" / f"{name}.md").write_text(long_markdown(result))
        print(long_markdown(result))
        return
    sizes = [] if args.ingest_only else [200] if args.quick else (args.pages or [1000, 10000])
    results = {"machine": machine_info(), "load_before": load_average(), "stores": {}, "ingest": {}}
    with tempfile.TemporaryDirectory(prefix="colembed-bench-index-") as tmp:
        scratch = Path(tmp)
        if not args.no_ingest:
            for name in args.ingest_model or ["tiny", "bench"]:  # one process each (peak RSS)
                extra = ("--model", str(args.model)) if args.model else ()
                results["ingest"][name] = _sub(f"ingest:{name}", 0, scratch, extra)
                print("ingest", name, results["ingest"][name], file=sys.stderr, flush=True)
        for pages in sizes:
            for data in args.set or SETS:
                results["stores"][f"{data}:{pages}"] = bench_stores(pages, scratch, data,
                                                                    args.store)
    results["load_after"] = load_average()
    write_results(results, "index-ingest" if args.ingest_only else
                  "index-quick" if args.quick else "index")


def write_results(results: dict, name: str) -> None:
    out = HERE / "results"
    (out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown(results) + "\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
