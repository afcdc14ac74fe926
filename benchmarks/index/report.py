"""bench_index.py's tables: the stores side by side, each plan's quality against exact as same-run
ratios, and the ingest stages; `write_results` puts them (and the JSON) under results/."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.shared.common import load_line, results_markdown, write_note
from benchmarks.index.ingest import INGEST_ROUNDS
from benchmarks.index.stores import EDGE_BACKENDS, K

RESULTS = Path(__file__).resolve().parents[1] / "results" / "index"


def markdown(results: dict) -> str:
    stores = (
        [
            "Synthetic grid-structured pages (see the script's docstring); vectors stored as "
            "float16 in Qdrant; k = 10. Reopen = a fresh process opening the folder; first "
            "query = that process's first search (Qdrant Edge maps the page vectors from disk "
            "and drops its files from the page cache on close, so it reads what it needs "
            "then). Peak RSS of the querying process.",
            "",
        ]
        if results["stores"]
        else []
    )
    title = "Index store benchmark" if results["stores"] else "Indexing throughput benchmark"
    lines = [
        *stores,
        load_line(results),
        "",
    ]
    for key, by_store in (results.get("pooling") or {}).items():
        data, _, pages = key.rpartition(":")
        lines += [
            f"## Index-time pooling, {int(pages):,} pages, {data} set",
            "",
            *pooling_markdown(by_store),
            "",
        ]
    for key, by_backend in results["stores"].items():
        data, _, pages = key.rpartition(":")
        lines += [
            f"## {int(pages):,} pages, {data or 'page-wide'} set",
            "",
            "| store | insert pages/s | disk MiB | reopen s | first query ms | 1 query p50 / "
            "p90 ms | 16 queries p50 / p90 ms | peak RSS MiB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, r in by_backend.items():
            if "skipped" in r:
                lines.append(f"| {name} | skipped: {r['skipped']} | | | | | | |")
                continue
            insert = (
                f"{r['insert_pages_per_s']:.0f}"
                if "insert_pages_per_s" in r
                else "(reused)"
                if "reused" in r
                else "-"
            )
            disk = f"{r['disk_mib']:.0f}" if "disk_mib" in r else f"({r['memory_mib']:.0f} in RAM)"
            reopen = f"{r['reopen_s']:.2f}" if "reopen_s" in r else "-"
            first = f"{r['first_query_ms']:.0f}" if "first_query_ms" in r else "-"
            lines.append(
                f"| {name} | {insert} | {disk} | {reopen} | {first} | {r['q1_p50_ms']:.0f} / "
                f"{r['q1_p90_ms']:.0f} | {r['q16_p50_ms']:.0f} / {r['q16_p90_ms']:.0f} "
                f"| {r['peak_rss_mib']:.0f} |"
            )
        lines += ["", *quality_markdown(by_backend), ""]
    for name, i in (results.get("ingest") or {}).items():
        lines += ingest_markdown(name, i)
    return results_markdown(title, results["machine"], lines)


def pooling_markdown(by_store: dict) -> list[str]:
    """Per pool factor: needle in the top 10 and recall@10 against the unpooled exact scan, for
    the pooled store's exact scan and its default plan; size, insert rate, query time."""
    truth = by_store["edge-two-stage-pool1"]
    exact_top, targets = truth["exact_top"], truth["needle_targets"]
    recall = lambda rows: float(  # noqa: E731
        np.mean([len(set(a) & set(b)) / K for a, b in zip(exact_top, rows)])
    )
    needle = lambda rows: float(np.mean([t in r for r, t in zip(rows, targets)]))  # noqa: E731
    lines = [
        "| pool factor | disk MiB | insert pages/s | exact: needle@10 | exact: recall@10 | "
        "default: needle@10 | default: recall@10 | default 1 query p50 / p90 ms | default "
        "16 queries p50 / p90 ms | exact 1 query p50 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    factors = sorted({int(k.rpartition("pool")[2]) for k in by_store})
    for f in factors:
        two, exact = by_store[f"edge-two-stage-pool{f}"], by_store[f"edge-exact-pool{f}"]
        lines.append(
            f"| {f} | {two['disk_mib']:.0f} | {two['insert_pages_per_s']:.1f} | "
            f"{100 * needle(two['exact_top']):.0f}% | {recall(two['exact_top']):.3f} | "
            f"{100 * needle(two['two_stage_top']):.0f}% | {recall(two['two_stage_top']):.3f} | "
            f"{two['q1_p50_ms']:.0f} / {two['q1_p90_ms']:.0f} | {two['q16_p50_ms']:.0f} / "
            f"{two['q16_p90_ms']:.0f} | {exact['q1_p50_ms']:.0f} |"
        )
    lines += [
        "",
        f"Against the unpooled store's exact top 10 (pool factor 1, exact), over "
        f"{len(targets)} needle queries; needle = the page a query was drawn from. "
        "Default = two-stage (token stage + mean, exact MaxSim rerank over the stored, "
        "pooled, vectors).",
    ]
    return lines


def quality_markdown(by_backend: dict) -> list[str]:
    """Recall and speed of the two-stage plans against exact, as same-run ratios."""
    two, exact = by_backend["edge-two-stage"], by_backend["edge-exact"]
    needle = [
        "| plan | needle in top 10 | of exact's | recall@10 vs exact | 1 query p50 ms |",
        "|---|---:|---:|---:|---:|",
    ]
    base = two.get("needle_at_10", {}).get("edge-exact")
    for name in EDGE_BACKENDS if base is not None else ():
        if name not in two["needle_at_10"]:  # a plan the store cannot run (index_stores.runs_on)
            needle.append(f"| {name} | - | - | - | - |")
            continue
        n = two["needle_at_10"][name]
        rec = two["recall_vs_exact"].get(name, 1.0)
        needle.append(
            f"| {name} | {100 * n:.0f}% | {100 * n / max(base, 1e-9):.0f}% | "
            f"{rec:.3f} | {by_backend[name]['q1_p50_ms']:.0f} |"
        )
    if base is not None:
        needle += [
            "",
            f"Needle = the page a query was drawn from, over {two['needle_queries']} queries.",
            "",
        ]
    previous, first = by_backend.get("edge-previous"), two["target_at_1"]
    lines = [
        *needle,
        f"Two-stage recall@10 against exact: {two['recall_at_10']:.3f} (schema-1 plan, "
        f"edge-previous: {two.get('previous_recall_at_10') or float('nan'):.3f}; synthetic "
        "vectors: a floor, not a trained model's figure). Edge exact scores vs numpy MaxSim "
        f"over the stored vectors: max abs diff {two['score_max_abs_diff_vs_numpy']:.1e}. "
        f"The page a query was drawn from ranks first: exact {first['exact']:.2f}, two-stage "
        f"{first['two-stage']:.2f}, previous plan {first.get('previous') or float('nan'):.2f}.",
        "",
        f"1 query p50: two-stage {exact['q1_p50_ms'] / two['q1_p50_ms']:.1f}x faster than exact",
    ]
    if previous and "q1_p50_ms" in previous:
        ratio = previous["q1_p50_ms"] / two["q1_p50_ms"]
        lines[-1] += (
            f", {ratio:.1f}x faster than" if ratio >= 1 else f", {1 / ratio:.1f}x slower than"
        )
        lines[-1] += " the schema-1 plan on the same store in the same run"
    lines[-1] += "."
    return lines


def ingest_markdown(name: str, i: dict) -> list[str]:
    ms = i["ms_per_page"]
    rows = [
        ("hash (sha256 of the file)", "hash"),
        ("render (pypdfium2, render thread)", "render"),
        ("pool + upsert (writer thread)", "store"),
        ("embed (`model.embed_pages` alone)", "embed"),
        ("`Index.add` (all of it, pipelined)", "index"),
    ]
    return [
        f"## Indexing throughput vs embedding alone: {name}",
        "",
        f"{i['pages']} PDF pages (letter, text as images) at {i['max_pixels']:,} pixels, "
        f"{i['model']}. Each stage alone, per page (CPU = all threads of the process):",
        "",
        "| stage | CPU ms/page | wall ms/page |",
        "|---|---:|---:|",
        *[
            f"| {label} | {ms[key]['cpu_ms']:.1f} | {ms[key]['wall_ms']:.1f} |"
            for label, key in rows
        ],
        "",
        f"Bound (embedding CPU / all CPU, reached when embedding fills the cores): "
        f"**{100 * i['bound']:.1f}%**. Measured: `Index.add` {i['index_pages_per_s']:.3f} "
        f"pages/s vs `embed_pages` {i['embed_only_pages_per_s']:.3f} pages/s: "
        f"**{100 * i['ratio']:.1f}%** (best of {INGEST_ROUNDS} alternating rounds; the store "
        "is opened and closed outside the timed part). CPU seconds of `embed_pages` / of "
        f"`Index.add` (the ratio once the cores are full, as under load): "
        f"{100 * i['cpu_ratio']:.1f}%. Peak RSS {i['peak_rss_mib']:.0f} MiB.",
        "",
    ]


def write_results(results: dict, name: str) -> None:
    """results/NAME.json and results/NAME.md (the table printed too)."""
    write_note(RESULTS / name, results, markdown(results))
