"""Filtered and hybrid search on a local-answer Qdrant Edge store: what a `where=` filter costs,
whether the allowed pages' needles are still found, and hybrid (BM25 + MaxSim by RRF) beside
dense two-stage search.

    python -m benchmarks.index.filters --pages 10000 --store /tmp/filters-10k
    python -m benchmarks.index.filters --pages 100000 --store FOLDER   # the build takes ~1 h a core

The store is built once (kept in --store and reused by a later run with the same --pages): pages
of `local_answer.py` (the answer in 1-3% of a page's tokens), stored as `Index.add` stores a
10-page PDF's, each with the metadata `share` (page number x 37 mod 100: a filter `share < s`
allows s% of the pages, spread over every file) and a text of TEXT_WORDS words drawn from a
VOCABULARY-word Zipf vocabulary plus the page's identifier `INV-<6 digits>` (stored compressed as
`Index.add` stores a PDF page's text layer, with its BM25 terms).

Filters (`where={"share": {"lt": s}}` for s = 1, 10, 50, and none), the default two-stage plan,
k = 10: p50 / p90 of one query in a reopened store (the allowed pages are listed by Qdrant once and
kept until the next write, so the first filtered query pays the listing: reported apart), the hits
returned, and the needle (the page a query was drawn from) in the top 10, for queries drawn from
the allowed pages only.

Hybrid beside dense, two query sets of NEEDLES queries each:
- `local`: a local-answer query with a text of QUERY_WORDS vocabulary words and no identifier (the
  answer is visual; the text, as a visual question's, does not name the page);
- `identifier`: a text naming the page's identifier (`invoice INV-xxxxxx`) and vectors of a
  local-answer query of that page mixed with noise (IDENTIFIER_NOISE), so that MaxSim alone ranks
  the page low, as a visual retriever does with an exact string.
Reported: the needle in the top 10 and first for dense and for hybrid, and each mode's p50.

What it does not model: a trained model's vectors or real page text; the two query sets bound what
fusion can gain (identifier) and lose (local), they do not say how often each kind occurs.
Writes benchmarks/results/index/<--out>.{md,json} (default index-filters-<scale>: 10k, 100k).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.index.stores import bench_point
from benchmarks.shared.common import markdown_table, results_markdown, write_results
from benchmarks.shared.local_answer import local_queries
from benchmarks.shared.synthetic_pages import unit
from benchmarks.shared.machine import load_average, machine_info

K = 10
SHARES = (1, 10, 50)  # % of pages a filter allows
NEEDLES = 40  # needle queries per filter and per hybrid set
ROUNDS = 60  # timed single queries per filter / mode (cycling over the needle queries)
VOCABULARY = 5000
TEXT_WORDS = 120
QUERY_WORDS = 4
IDENTIFIER_NOISE = 6.0  # noise per query token, relative to a unit token, in the identifier set
BATCH = 64


def share_of(i: int) -> int:
    return (i * 37) % 100


def identifier(i: int) -> str:
    return f"INV-{i:06d}"


def words(rng: np.random.Generator, n: int) -> list[str]:
    ranks = np.minimum(rng.zipf(1.3, n), VOCABULARY) - 1
    return [f"w{r}" for r in ranks]


def page_text(i: int) -> str:
    body = words(np.random.default_rng(5_000_000 + i), TEXT_WORDS)
    body.insert(TEXT_WORDS // 2, identifier(i))
    return " ".join(body)


def build(folder: Path, pages: int) -> dict:
    """Write `pages` pages into a new Edge folder (or reuse one this job finished before)."""
    from colembed.index.backends import open_store
    from colembed.index.schema import META_FIELD, TEXT_FIELD, TEXT_TRUNCATED_FIELD, encode_text

    done = folder / "colembed-bench-filters.json"
    if done.is_file() and json.loads(done.read_text()).get("pages") == pages:
        return json.loads(done.read_text())
    if folder.exists() and any(folder.iterdir()):
        raise SystemExit(f"{folder} holds something else; name an empty or new folder")
    store = open_store(folder, dim=128)
    started, batch = time.perf_counter(), []
    for i in range(pages):
        point = bench_point("local", i)
        text, truncated = encode_text(page_text(i))
        point.payload.update(
            {META_FIELD: {"share": share_of(i)}, TEXT_FIELD: text, TEXT_TRUNCATED_FIELD: truncated}
        )
        batch.append(point)
        if len(batch) == BATCH:
            store.upsert(batch)
            batch = []
        if (i + 1) % 2000 == 0:
            print(f"built {i + 1} / {pages} pages", flush=True)
    store.upsert(batch)
    store.flush()
    store.close()
    info = {"pages": pages, "build_s": time.perf_counter() - started}
    done.write_text(json.dumps(info) + "\n")
    return info


def needle_targets(pages: int, allowed, seed: int) -> np.ndarray:
    """NEEDLES pages among the allowed ones (all pages when `allowed` is None)."""
    ids = np.arange(pages) if allowed is None else np.array([i for i in range(pages) if allowed(i)])
    return np.random.default_rng(seed).choice(ids, min(NEEDLES, len(ids)), replace=False)


def default_stem(pages: int) -> str:
    """The results' name by benchmarks/README.md's rule: `index-filters-10k` for 10,000 pages."""
    scale = f"{pages // 1000}k" if pages % 1000 == 0 else str(pages)
    return f"index-filters-{scale}"


def timed(search, queries: list, rounds: int = ROUNDS) -> dict:
    times = []
    for r in range(rounds):
        t = time.perf_counter()
        search(queries[r % len(queries)])
        times.append(time.perf_counter() - t)
    return {
        "p50_ms": float(np.percentile(times, 50)) * 1000,
        "p90_ms": float(np.percentile(times, 90)) * 1000,
    }


def serial(hit) -> int:
    return int(hit.payload["serial"])


def needles(results: list, targets: np.ndarray) -> dict:
    top10 = sum(int(t) in [serial(h) for h in hits] for hits, t in zip(results, targets))
    first = sum(bool(hits) and serial(hits[0]) == int(t) for hits, t in zip(results, targets))
    return {"needle_top10": top10 / len(targets), "needle_first": first / len(targets)}


def filters(store, pages: int) -> list[dict]:
    from colembed.index.where import parse

    rows = []
    for share in (None, *SHARES):
        where = None if share is None else parse({"share": {"lt": share}})
        allowed = None if share is None else (lambda i, s=share: share_of(i) < s)
        targets = needle_targets(pages, allowed, seed=share or 0)
        queries = local_queries(pages, len(targets), seed=101 + (share or 0), targets=targets)
        started = time.perf_counter()
        first = store.search(queries[:1], K, "two-stage", where=where)
        first_ms = (time.perf_counter() - started) * 1000
        results = [store.search([q], K, "two-stage", where=where)[0] for q in queries]
        outside = sum(not allowed(serial(h)) for hits in results for h in hits) if allowed else 0
        rows.append(
            {
                "filter": "none" if share is None else f"share < {share} ({share}%)",
                "allowed_pages": pages
                if share is None
                else sum(share_of(i) < share for i in range(pages)),
                "first_query_ms": first_ms,
                **timed(lambda q: store.search([q], K, "two-stage", where=where), queries),
                "hits_min": min(len(h) for h in [first[0], *results]),
                "outside_filter": outside,
                **needles(results, targets),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def hybrid(store, pages: int) -> list[dict]:
    rows = []
    for name in ("local", "identifier"):
        targets = needle_targets(pages, None, seed=7 if name == "local" else 8)
        queries = local_queries(pages, len(targets), seed=303, targets=targets)
        rng = np.random.default_rng(404)
        if name == "local":
            texts = [" ".join(words(rng, QUERY_WORDS)) for _ in targets]
        else:
            texts = [f"invoice {identifier(int(t))}" for t in targets]
            queries = [
                unit(q + IDENTIFIER_NOISE * rng.standard_normal(q.shape) / np.sqrt(q.shape[1]))
                for q in queries
            ]
        for mode in ("two-stage", "hybrid"):

            def search(i, mode=mode):
                return store.search(
                    [queries[i]], K, mode, texts=[texts[i]] if mode == "hybrid" else None
                )[0]

            results = [search(i) for i in range(len(queries))]
            order = list(range(len(queries)))
            rows.append(
                {
                    "set": name,
                    "mode": mode,
                    **needles(results, targets),
                    **timed(lambda i: search(i), order),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=10000)
    parser.add_argument(
        "--store",
        type=Path,
        required=True,
        help="the Edge folder to build (or reuse, when this job built it)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="results stem under benchmarks/results/index/ (default "
        "index-filters-<scale>, e.g. index-filters-10k)",
    )
    args = parser.parse_args(argv)
    from colembed.index.backends import open_store

    info = machine_info(
        ["-m", "benchmarks.index.filters", *(sys.argv[1:] if argv is None else argv)]
    )
    built = build(args.store, args.pages)
    store = open_store(args.store, create=False)
    rows_f, rows_h = filters(store, args.pages), hybrid(store, args.pages)
    store.close()
    info["load_average_at_end"] = load_average()
    fmt = lambda x: f"{x:.1f}"  # noqa: E731
    body = [
        f"{args.pages:,} local-answer pages (built in {built['build_s']:.0f} s), k = {K}, "
        f"{NEEDLES} needle queries per row, {ROUNDS} timed single queries per row. Load "
        f"average at the end: {info['load_average_at_end']}.",
        "",
        "## Filters (default two-stage plan; needles drawn from the allowed pages)",
        "",
        *markdown_table(
            [
                "filter",
                "allowed pages",
                "first query ms",
                "p50 ms",
                "p90 ms",
                "fewest hits",
                "hits outside",
                "needle in top 10",
                "needle first",
            ],
            [
                [
                    r["filter"],
                    r["allowed_pages"],
                    fmt(r["first_query_ms"]),
                    fmt(r["p50_ms"]),
                    fmt(r["p90_ms"]),
                    r["hits_min"],
                    r["outside_filter"],
                    f"{r['needle_top10']:.3f}",
                    f"{r['needle_first']:.3f}",
                ]
                for r in rows_f
            ],
        ),
        "",
        "## Hybrid beside dense",
        "",
        *markdown_table(
            ["set", "mode", "needle in top 10", "needle first", "p50 ms", "p90 ms"],
            [
                [
                    r["set"],
                    r["mode"],
                    f"{r['needle_top10']:.3f}",
                    f"{r['needle_first']:.3f}",
                    fmt(r["p50_ms"]),
                    fmt(r["p90_ms"]),
                ]
                for r in rows_h
            ],
            align_right_from=2,
        ),
    ]
    text = results_markdown("Filtered and hybrid search", info, body)
    print(text)
    stem = (
        Path(__file__).resolve().parents[1]
        / "results"
        / "index"
        / (args.out or default_stem(args.pages))
    )
    write_results(stem, text, info, {"build": built, "filters": rows_f, "hybrid": rows_h})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
