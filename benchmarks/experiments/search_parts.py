"""Question: What do the centroid scan and a store's reopen cost at scale?
Answer: scan 0.2 s a query at 100k pages; mapped rows / cols open in 0.3 s reading 3 MiB
Note: benchmarks/results/experiments/search-scan-100k.md

The two parts of a search that grow with the index, each timed apart from the rest.

    python -m benchmarks.experiments.search_parts --scan 100000 --rounds 5
    python -m benchmarks.experiments.search_parts --reopen OLD_FOLDER NEW_FOLDER --rounds 3

Why apart: on this shared 2-core machine a 100,000-page Edge store takes over an hour to fill
(results/index/index-long-100k-killed.md), so the parts are measured where they can be:

- `--scan N`: the token stage's centroid scan (colembed.index.tokens) over an N-page table of
  random unit centroids (16 x 128 float32 a page, the table's real shape and size; the values do
  not matter to the time), for 1 and for 16 queries of `--query-tokens` tokens (local-answer
  queries have 16-26), before (the scan as it was: one product per 8,192 pages, numpy's BLAS
  threads, one pass per query) and now (`centroid_scores_many`), interleaved in the same rounds.
- `--reopen FOLDER ...`: each folder opened in a fresh process (`open_store`), interleaved over
  the rounds: the open's time, what it read from storage (/proc/self/io read_bytes) and how much
  its RSS grew (what Edge loaded into RAM), then the first and second two-stage query
  (local-answer queries, benchmarks/shared/local_answer.py).

What it does not model: queries of a trained model (timing only), other page sizes. Writes
benchmarks/results/<--out>.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parents[1]  # the benchmarks folder
from benchmarks.shared.common import load_line, results_markdown, spread, write_note  # noqa: E402
from benchmarks.shared.machine import load_average, machine_info  # noqa: E402

K, DIM = 16, 128


def scan_before(table: np.ndarray, query: np.ndarray, chunk: int = 8192) -> np.ndarray:
    """The centroid scan as colembed ran it before `centroid_scores_many` (one query a pass)."""
    q = np.asarray(query, dtype=np.float32).T
    out = np.empty(len(table), dtype=np.float32)
    for lo in range(0, len(table), chunk):
        block = table[lo : lo + chunk]
        sims = block.reshape(-1, block.shape[-1]) @ q
        out[lo : lo + len(block)] = (
            sims.reshape(len(block), block.shape[1], -1).max(axis=1).sum(axis=1)
        )
    return out


def bench_scan(pages: int, rounds: int, query_tokens: int, folder: Path) -> dict:
    from colembed.index.tokens import centroid_scores_many

    path = folder / f"table-{pages}.f32"
    rng = np.random.default_rng(0)
    if not path.is_file() or path.stat().st_size != pages * K * DIM * 4:
        with open(path, "wb") as f:
            for lo in range(0, pages, 10000):
                x = rng.standard_normal((min(10000, pages - lo), K, DIM)).astype(np.float32)
                f.write((x / np.linalg.norm(x, axis=-1, keepdims=True)).tobytes())
    table = np.memmap(path, dtype=np.float32, mode="r", shape=(pages, K, DIM))
    half = path.with_suffix(".f16")
    if not half.is_file() or half.stat().st_size != pages * K * DIM * 2:
        for lo in range(0, pages, 10000):
            with open(half, "wb" if lo == 0 else "ab") as f:
                f.write(np.asarray(table[lo : lo + 10000]).astype(np.float16).tobytes())
    table16 = np.memmap(half, dtype=np.float16, mode="r", shape=(pages, K, DIM))
    queries = [rng.standard_normal((query_tokens, DIM)).astype(np.float32) for _ in range(16)]
    contenders = {
        "before": lambda qs: [scan_before(table, q) for q in qs],
        "now": lambda qs: centroid_scores_many(table, qs),
        "now, float16 table": lambda qs: centroid_scores_many(table16, qs),
    }
    before = np.stack(contenders["before"](queries[:2]))
    out = {
        "pages": pages,
        "table_mib": table.nbytes / 2**20,
        "query_tokens": query_tokens,
        "max_abs_score_difference": float(np.abs(before - contenders["now"](queries[:2])).max()),
        "float16_max_abs_score_difference": float(
            np.abs(before - contenders["now, float16 table"](queries[:2])).max()
        ),
    }
    for n in (1, 16):
        for fn in contenders.values():
            fn(queries[:n])  # the table in the page cache, as between queries
        times = {name: [] for name in contenders}
        for _ in range(rounds):
            for name, fn in contenders.items():
                t = time.perf_counter()
                fn(queries[:n])
                times[name].append(1000 * (time.perf_counter() - t))
        out[f"{n}_queries_ms"] = {name: spread(ts) for name, ts in times.items()}
    return out


REOPEN_WORKER = r"""
import json, os, sys, time
from colembed.index.backends import open_store
import benchmarks.shared.local_answer as local_answer

def io():
    fields = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return int(fields["read_bytes"]), rss

read0, rss0 = io()
t = time.perf_counter()
store = open_store(sys.argv[1])
opened = time.perf_counter() - t
read1, rss1 = io()
pages = store.count()
queries = local_answer.local_queries(pages, 2)
ms = []
for q in queries:
    t = time.perf_counter()
    store.search([q], 10, "two-stage")
    ms.append(1000 * (time.perf_counter() - t))
store.close()
print(json.dumps({"pages": pages, "open_s": opened, "open_read_mib": (read1 - read0) / 2**20,
                  "open_rss_growth_mib": (rss1 - rss0) / 2**20, "first_query_ms": ms[0],
                  "second_query_ms": ms[1]}))
"""


def storage_of(folder: Path) -> dict[str, str]:
    """The storage Edge holds each vector in (read from the shard's segment files)."""
    for seg in sorted((folder / "shard" / "segments").glob("*/segment.json")):
        data = json.loads(seg.read_text())["config"]["vector_data"]
        return {name: v["storage_type"] for name, v in sorted(data.items())}
    return {}


def bench_reopen(folders: list[Path], rounds: int) -> dict:
    runs = {str(f): [] for f in folders}
    for _ in range(rounds):
        for f in folders:
            line = subprocess.run(
                [sys.executable, "-c", REOPEN_WORKER, str(f)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            runs[str(f)].append(json.loads(line.strip().splitlines()[-1]))
    out = {}
    for f in folders:
        rows = runs[str(f)]
        out[str(f)] = {
            "pages": rows[0]["pages"],
            "storage": storage_of(f),
            **{
                key: spread([r[key] for r in rows])
                for key in (
                    "open_s",
                    "open_read_mib",
                    "open_rss_growth_mib",
                    "first_query_ms",
                    "second_query_ms",
                )
            },
        }
    return out


def markdown(r: dict) -> str:
    lines = [
        load_line(r) + (f" {r['note']}" if r.get("note") else ""),
        "",
        "Medians over the rounds (min-max in brackets); contenders interleaved in every round.",
        "",
    ]
    if "scan" in r:
        s = r["scan"]
        lines += [
            f"## Centroid scan, {s['pages']:,} pages ({s['table_mib']:.0f} MiB float32 table, "
            f"page cache warm), queries of {s['query_tokens']} tokens",
            "",
            "| queries | before ms | now ms | now / before | now, float16 table ms | "
            "float16 / now |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for n in (1, 16):
            t = s[f"{n}_queries_ms"]
            b, a, h = t["before"], t["now"], t["now, float16 table"]
            span = lambda x: f"{x['median']:.0f} ({x['min']:.0f}-{x['max']:.0f})"  # noqa: E731
            lines.append(
                f"| {n} | {span(b)} | {span(a)} | {a['median'] / b['median']:.2f} | "
                f"{span(h)} | {h['median'] / a['median']:.2f} |"
            )
        lines += [
            "",
            f"Largest score difference, now vs before: {s['max_abs_score_difference']:.2g}"
            f" (summation order); float16 table vs float32: "
            f"{s['float16_max_abs_score_difference']:.2g}.",
            "",
        ]
    if "reopen" in r:
        lines += [
            "## Reopen (fresh process each)",
            "",
            "| folder | pages | storage of rows / cols | open s | read at open MiB | RSS "
            "growth at open MiB | first query ms | second query ms |",
            "|---|---:|---|---:|---:|---:|---:|---:|",
        ]
        for f, v in r["reopen"].items():
            cell = lambda key: (  # noqa: E731
                f"{v[key]['median']:.2f} ({v[key]['min']:.2f}-{v[key]['max']:.2f})"
                if key == "open_s"
                else f"{v[key]['median']:.0f} ({v[key]['min']:.0f}-{v[key]['max']:.0f})"
            )
            lines.append(
                f"| {Path(f).name} | {v['pages']:,} | {v['storage'].get('rows')} / "
                f"{v['storage'].get('cols')} | {cell('open_s')} | "
                f"{cell('open_read_mib')} | {cell('open_rss_growth_mib')} | "
                f"{cell('first_query_ms')} | {cell('second_query_ms')} |"
            )
        lines.append("")
    return results_markdown(f"Search parts: {r['title']}", r["machine"], lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scan", type=int, metavar="PAGES")
    parser.add_argument("--query-tokens", type=int, default=25)
    parser.add_argument("--reopen", type=Path, nargs="+", metavar="FOLDER")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scratch", type=Path, help="where the scan's table file is kept")
    parser.add_argument("--out", default="search-parts")
    parser.add_argument(
        "--note", default="", help="how the run was scheduled (nice, lock), for the report"
    )
    args = parser.parse_args()
    results = {
        "machine": machine_info(),
        "load_before": load_average(),
        "title": args.out,
        "note": args.note,
    }
    with tempfile.TemporaryDirectory(prefix="colembed-search-parts-") as tmp:
        if args.scan:
            folder = args.scratch or Path(tmp)
            folder.mkdir(parents=True, exist_ok=True)
            results["scan"] = bench_scan(args.scan, args.rounds, args.query_tokens, folder)
    if args.reopen:
        results["reopen"] = bench_reopen(args.reopen, args.rounds)
    results["load_after"] = load_average()
    write_note(HERE / "results" / "experiments" / args.out, results, markdown(results))


if __name__ == "__main__":
    main()
