"""Page stores side by side: Qdrant Edge (exact, two-stage), colembed's numpy scorer, qdrant-client
local mode; and indexing throughput against embedding alone.

    .venv/bin/python benchmarks/bench_index.py                 # 1,000 and 10,000 pages (~8 GB peak)
    .venv/bin/python benchmarks/bench_index.py --pages 1000    # one size
    .venv/bin/python benchmarks/bench_index.py --quick         # 200 pages, smoke run (not committed)

Data: synthetic pages of real shape, grid-structured: a 26-30 x 25-29 image-token grid (~750
tokens) of dim 128 plus 15 prompt rows shared by every page; each page has a topic vector and 6
regions whose directions blend smoothly over the grid, plus noise, L2-normalised (real pages have
this spatial coherence; i.i.d. random tokens would make row/column pooling meaningless). Queries:
12 tokens drawn (with noise) from one target page's grid plus 10 shared augmentation rows. Random
structure, not a trained model: two-stage recall@10 here is a floor, not the trained figure.

Each store runs in its own subprocess (peak RSS is per process): insert pages/s through colembed's
Store adapter (points with all three vectors, as `Index.add` writes them), disk size, reopen time
(a fresh process opening the folder), query p50/p90 for 1 query and for a batch of 16 queries.
colembed numpy: `colembed.top_k` over the same vectors held in memory (float32).
Indexing throughput (`--no-ingest` skips): the tiny random-weight model, `Index.add` over PDFs vs
`model.embed_pages` over the same pages already rendered (same batch size).

Writes benchmarks/results/index.{md,json} (--quick: index-quick.*).
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
LARGE_ROUNDS = (3, 1)  # large stores and the slow qdrant-client local mode
RECALL_QUERIES = 16
NUMPY_MAX_PAGES = 1000  # 10,000 pages = 3.9 GB of float32 and ~10x the 1,000-page query time
K = 10
BACKENDS = ("edge-two-stage", "edge-exact", "numpy", "client-local")
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
    singles, batches = QUERY_ROUNDS[1000] if pages <= 1000 and not slow else LARGE_ROUNDS
    one, sixteen = [], []
    search(queries[-1:])  # warm-up
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
    return {"q1_p50_ms": q(one, 50), "q1_p90_ms": q(one, 90),
            "q16_p50_ms": q(sixteen, 50), "q16_p90_ms": q(sixteen, 90)}


def _disk_mib(folder: Path) -> float:
    """Blocks really used (Edge preallocates sparse files: their apparent size is far larger)."""
    return sum(f.stat().st_blocks * 512 for f in folder.rglob("*") if f.is_file()) / 2**20


def _peak_rss_mib() -> float:
    """VmHWM (ru_maxrss would carry the parent's peak across exec)."""
    return rss_mib()["peak"]


def worker_build(backend: str, pages: int, folder: Path) -> dict:
    """Insert `pages` pages into a new store in `folder` (one subprocess)."""
    from colembed.index.schema import make_point
    from colembed.index.store import open_store

    store = open_store(folder, dim=DIM, local=backend == "client-local")
    t = time.perf_counter()
    batch = []
    for i in range(pages):
        vectors, layout = synthetic_page(i)
        batch.append(make_point(vectors, layout, {
            "path": f"/docs/{i // 10}.pdf", "page": i % 10 + 1, "pages": 10, "sha256": f"{i // 10:064x}",
            "width": 683, "height": 883, "model": "synthetic", "variant": "fp32",
            "manifest_sha256": "0" * 64, "schema": 1, "model_source": "synthetic", "serial": i}))
        if len(batch) == 64:
            store.upsert(batch)
            batch = []
    store.upsert(batch)
    store.flush()
    insert_s = time.perf_counter() - t
    store.close()
    return {"insert_pages_per_s": pages / insert_s, "insert_s": insert_s,
            "disk_mib": _disk_mib(folder), "build_peak_rss_mib": _peak_rss_mib()}


def worker_query(backend: str, pages: int, folder: Path) -> dict:
    """Reopen the store in `folder` and time queries (one subprocess)."""
    from colembed.index.store import open_store

    t = time.perf_counter()
    store = open_store(folder, local=backend == "client-local")
    reopen = time.perf_counter() - t
    mode = "exact" if backend in ("edge-exact", "client-local") else "two-stage"
    queries = synthetic_queries(pages, 64)
    timings = _timed_queries(lambda qs: store.search(qs, K, mode), queries, pages,
                             slow=backend == "client-local")
    result = {"reopen_s": reopen, **timings, "peak_rss_mib": _peak_rss_mib()}
    if backend == "edge-two-stage":
        result.update(_quality(store, queries[:RECALL_QUERIES], pages))
    store.close()
    return result


def _quality(store, queries, pages: int) -> dict:
    """Two-stage recall@10 against exact; how often the page a query was drawn from ranks first;
    Edge's exact scores against numpy MaxSim over the vectors it stores (float16)."""
    exact = store.search(queries, K, "exact")
    fast = store.search(queries, K, "two-stage")
    targets = query_targets(pages, len(queries))
    first = lambda rows: float(np.mean([int(r[0].payload["serial"]) == int(t)  # noqa: E731
                                         for r, t in zip(rows, targets)]))
    worst = 0.0
    for q, hits in zip(queries[:4], exact[:4]):
        stored = store.page_vectors([h.id for h in hits[:3]])
        for h in hits[:3]:
            worst = max(worst, abs(float((q @ stored[h.id].T).max(axis=1).sum()) - h.score))
    recall = np.mean([len({h.id for h in a} & {h.id for h in b}) / K for a, b in zip(exact, fast)])
    return {"recall_at_10": float(recall), "target_at_1": {"exact": first(exact), "two-stage": first(fast)},
            "score_max_abs_diff_vs_numpy": worst}


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


def run_worker(args) -> None:
    folder = Path(args.folder) if args.folder else None
    if args.worker == "numpy":
        out = worker_numpy(args.pages)
    elif args.worker.startswith("build:"):
        out = worker_build(args.worker[6:], args.pages, folder)
    else:
        out = worker_query(args.worker[6:], args.pages, folder)
    print(json.dumps(out))


def _sub(worker: str, pages: int, folder: Path | None = None) -> dict:
    cmd = [sys.executable, __file__, "--worker", worker, "--pages", str(pages)]
    if folder:
        cmd += ["--folder", str(folder)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_stores(pages: int, scratch: Path) -> dict:
    results = {}
    edge = scratch / f"edge-{pages}"
    build = _sub("build:edge", pages, edge)
    for backend in ("edge-two-stage", "edge-exact"):
        results[backend] = {**build, **_sub(f"query:{backend}", pages, edge)}
        print(backend, pages, results[backend], file=sys.stderr, flush=True)
    shutil.rmtree(edge)
    if pages <= NUMPY_MAX_PAGES:
        results["numpy"] = _sub("numpy", pages)
        print("numpy", pages, results["numpy"], file=sys.stderr, flush=True)
    if pages <= CLIENT_LOCAL_MAX_PAGES:
        local = scratch / f"local-{pages}"
        build = _sub("build:client-local", pages, local)
        results["client-local"] = {**build, **_sub("query:client-local", pages, local)}
        print("client-local", pages, results["client-local"], file=sys.stderr, flush=True)
        shutil.rmtree(local)
    return results


def _make_pdfs(folder: Path, files: int, pages: int) -> None:
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


def bench_ingest(model_dir: Path | None, scratch: Path, files: int, pages: int) -> dict:
    import colembed
    from colembed.index.sources import Document

    if model_dir is None:
        from colembed_export.exporter import export_model
        from colembed_export.tiny import build_checkpoint

        checkpoint = build_checkpoint(scratch / "ckpt", "tiny", seed=0)
        model_dir = export_model(checkpoint, scratch / "model", name="colqwen2-tiny-random").folder
    model = colembed.load(model_dir)
    docs = scratch / "pdfs"
    _make_pdfs(docs, files, pages)
    rounds = {"embed_only_s": [], "index_s": []}
    for r in range(2):
        t = time.perf_counter()
        images = []
        for path in sorted(docs.glob("*.pdf")):
            with Document(path, max_pixels=model.config.max_pixels) as doc:
                images += [image for _, image in doc.iter_pages(range(1, doc.pages + 1))]
        render = time.perf_counter() - t
        t = time.perf_counter()
        model.embed_pages(images, batch_size=4)
        rounds["embed_only_s"].append(time.perf_counter() - t)
        t = time.perf_counter()
        with colembed.Index(scratch / f"ingest-db-{r}", model=model) as index:
            result = index.add(docs, progress=False)
        rounds["index_s"].append(time.perf_counter() - t)
        assert result.pages_added == files * pages, result
    embed, index = min(rounds["embed_only_s"]), min(rounds["index_s"])
    n = files * pages
    return {"pages": n, "model": "tiny random-weight (colqwen2-tiny-random)",
            "render_only_s": render, "embed_only_pages_per_s": n / embed,
            "index_pages_per_s": n / index, "ratio": embed / index, "rounds": rounds}


def _load_caveat(results: dict) -> str:
    """Say that absolute times are inflated only when the load average shows other work ran."""
    loads = [max(results.get(key) or [0.0]) for key in ("load_before", "load_after")]
    if max(loads) <= 0.75 * (os.cpu_count() or 1):
        return " (a quiet machine)."
    return (" (other processes held the cores during the run: absolute times are inflated and "
            "matter less than the ratios between rows of one table).")


def markdown(results: dict) -> str:
    lines = ["# Index store benchmark", "", markdown_header(results["machine"]), "",
             "Synthetic grid-structured pages (see the script's docstring); vectors stored as "
             "float16 in Qdrant; k = 10. Reopen = a fresh process opening the folder. "
             "Peak RSS of the querying process.", "",
             f"Load average before / after: {results.get('load_before')} / "
             f"{results.get('load_after')} on {os.cpu_count()} cores" + _load_caveat(results),
             ""]
    for pages, by_backend in results["stores"].items():
        lines += [f"## {int(pages):,} pages", "",
                  "| store | insert pages/s | disk MiB | reopen s | 1 query p50 / p90 ms "
                  "| 16 queries p50 / p90 ms | peak RSS MiB |", "|---|---:|---:|---:|---:|---:|---:|"]
        for name, r in by_backend.items():
            if "skipped" in r:
                lines.append(f"| {name} | skipped: {r['skipped']} | | | | | |")
                continue
            insert = f"{r['insert_pages_per_s']:.0f}" if "insert_pages_per_s" in r else "-"
            disk = f"{r['disk_mib']:.0f}" if "disk_mib" in r else f"({r['memory_mib']:.0f} in RAM)"
            reopen = f"{r['reopen_s']:.2f}" if "reopen_s" in r else "-"
            lines.append(f"| {name} | {insert} | {disk} | {reopen} | {r['q1_p50_ms']:.0f} / "
                         f"{r['q1_p90_ms']:.0f} | {r['q16_p50_ms']:.0f} / {r['q16_p90_ms']:.0f} "
                         f"| {r['peak_rss_mib']:.0f} |")
        two = by_backend["edge-two-stage"]
        lines += ["", f"Two-stage recall@10 against exact: {two['recall_at_10']:.3f} (synthetic "
                  "vectors: a floor, not a trained model's figure). Edge exact scores vs numpy "
                  f"MaxSim over the stored vectors: max abs diff {two['score_max_abs_diff_vs_numpy']:.1e}. "
                  f"The page a query was drawn from ranks first: exact {two['target_at_1']['exact']:.2f}, "
                  f"two-stage {two['target_at_1']['two-stage']:.2f}. Two-stage vs exact, 1 query p50: {by_backend['edge-exact']['q1_p50_ms'] / two['q1_p50_ms']:.1f}x faster.", ""]
    if results.get("ingest"):
        i = results["ingest"]
        lines += ["## Indexing throughput vs embedding alone", "",
                  f"{i['pages']} PDF pages, {i['model']}: `Index.add` (hash, render, embed, "
                  f"store) {i['index_pages_per_s']:.2f} pages/s; `model.embed_pages` on the same "
                  f"pages already rendered {i['embed_only_pages_per_s']:.2f} pages/s: "
                  f"**{100 * i['ratio']:.0f}%** (rendering alone took {i['render_only_s']:.1f} s, "
                  "overlapped with embedding by the render thread). Best of 2 rounds.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, action="append", help="store sizes (default 1000, 10000)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", help="a model folder for the ingest check (default: build the tiny one)")
    parser.add_argument("--no-ingest", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.pages = args.pages[0]
        return run_worker(args)
    sizes = [200] if args.quick else (args.pages or [1000, 10000])
    results = {"machine": machine_info(), "load_before": load_average(), "stores": {}}
    with tempfile.TemporaryDirectory(prefix="colembed-bench-index-") as tmp:
        scratch = Path(tmp)
        if not args.no_ingest:
            results["ingest"] = bench_ingest(Path(args.model) if args.model else None, scratch,
                                             files=3 if args.quick else 6, pages=4)
            print("ingest", results["ingest"], file=sys.stderr, flush=True)
        for pages in sizes:
            results["stores"][str(pages)] = bench_stores(pages, scratch)
    results["load_after"] = load_average()
    write_results(results, "index-quick" if args.quick else "index")


def write_results(results: dict, name: str) -> None:
    out = HERE / "results"
    (out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown(results) + "\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
