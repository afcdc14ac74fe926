"""Soak: embed and score continuously for a set time; report throughput over time and RSS growth.

Each round embeds a batch of pages of varied sizes (so grids, rotary tables and arena chunks vary)
and a batch of queries of varied lengths (now and then one at the length bound), scores the queries
against a rolling store of the latest pages (`top_k` through the folder's scorer) and every few
rounds makes one bad page and one bad query fail mid-batch (the error path must not leak either).
Every `--interval` seconds it records pages/s, queries/s, scored pairs/s and RSS. At the end: RSS
growth after warm-up (first window to last) and its least-squares slope in MiB per minute.

    python -m benchmarks.soak --minutes 3                # tiny random-weight model, exported once
    python -m benchmarks.soak --folder colqwen2-onnx --minutes 60

Writes benchmarks/results/soak/soak.{md,json} (the latest run only).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from collections import deque
from pathlib import Path

import numpy as np

from benchmarks.shared.common import (
    QUERY_WORDS,
    machine_info,
    markdown_header,
    rss_mib,
    tiny_folder,
)  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "soak"
PAGE_SIZES = [(420, 560), (560, 420), (300, 800), (640, 640), (210, 297)]
STORE = 64  # pages kept for scoring (filled before the clock starts)
BAD_EVERY = 5  # rounds between deliberate bad items
WARMUP_WINDOWS = 1


def make_page(rng: np.random.Generator):
    from PIL import Image, ImageDraw

    w, h = PAGE_SIZES[rng.integers(len(PAGE_SIZES))]
    page = Image.new("RGB", (w, h), "white")
    draw = ImageDraw.Draw(page)
    for y in range(10, h - 10, 14):
        draw.rectangle([10, y, 10 + int(rng.integers(20, w - 20)), y + 8], fill=(30, 30, 30))
    return page


def make_query(rng: np.random.Generator, limit: int) -> str:
    words = int(rng.integers(3, 30)) if rng.random() > 0.05 else 2 * limit  # sometimes at the bound
    return " ".join(rng.choice(QUERY_WORDS, size=words))


def one_round(model, rng, store: deque, round_no: int, batch: int) -> dict[str, int]:
    """Embed pages and queries, score; every BAD_EVERY rounds a bad item fails mid-batch."""
    import colembed

    pages = [make_page(rng) for _ in range(batch)]
    queries = [make_query(rng, model.text_encoder.max_query_tokens) for _ in range(2 * batch)]
    failed = 0
    if round_no % BAD_EVERY == BAD_EVERY - 1:
        try:
            model.embed_images(pages[:1] + [b"not an image"])
        except colembed.ImageError as e:
            failed += len(e.completed) == 1
        try:
            model.embed_queries(queries[:1] + ["bad \ud800"])
        except colembed.InputError as e:
            failed += len(e.completed) == 1
    store.extend(model.embed_images(pages, batch_size=batch))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vectors = model.embed_queries(queries)
    model.top_k(vectors, list(store), k=5)
    return {
        "pages": len(pages),
        "queries": len(queries),
        "pairs": len(vectors) * len(store),
        "errors_kept_work": failed,
    }


def soak(model, minutes: float, interval: float, batch: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    store: deque = deque(
        model.embed_images([make_page(rng) for _ in range(STORE)]), maxlen=STORE
    )  # full from the start: its growth is not a leak
    windows: list[dict] = []
    start = window_start = time.perf_counter()
    counts = dict.fromkeys(("pages", "queries", "pairs", "errors_kept_work"), 0)
    round_no = 0
    while time.perf_counter() - start < minutes * 60:
        for key, value in one_round(model, rng, store, round_no, batch).items():
            counts[key] += value
        round_no += 1
        now = time.perf_counter()
        if now - window_start >= interval:
            span = now - window_start
            windows.append(
                {
                    "t_s": round(now - start, 1),
                    "pages_per_s": counts["pages"] / span,
                    "queries_per_s": counts["queries"] / span,
                    "pairs_per_s": counts["pairs"] / span,
                    "errors_kept_work": counts["errors_kept_work"],
                    "rss_mib": rss_mib()["rss"],
                }
            )
            counts = dict.fromkeys(counts, 0)
            window_start = now
    return windows


def summary(windows: list[dict]) -> dict:
    steady = windows[WARMUP_WINDOWS:] or windows
    minutes = np.array([w["t_s"] for w in steady]) / 60
    rss = np.array([w["rss_mib"] for w in steady])
    slope = float(np.polyfit(minutes, rss, 1)[0]) if len(steady) > 1 else 0.0
    pages = [w["pages_per_s"] for w in steady]
    return {
        "rss_first_mib": float(rss[0]),
        "rss_last_mib": float(rss[-1]),
        "rss_growth_mib": float(rss[-1] - rss[0]),
        "rss_slope_mib_per_min": slope,
        "pages_per_s_first": pages[0],
        "pages_per_s_last": pages[-1],
        "peak_rss_mib": rss_mib()["peak"],
    }


def write(info: dict, setup: dict, windows: list[dict], result: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "soak.json").write_text(
        json.dumps(
            {"machine": info, "setup": setup, "windows": windows, "summary": result}, indent=2
        )
    )
    lines = [
        "# Soak: embedding and scoring continuously",
        "",
        markdown_header(info),
        f"- model: {setup['model']}; {setup['minutes']} min; page batch {setup['batch']}, "
        f"{2 * setup['batch']} queries per round, top-5 over the latest {STORE} pages; a bad "
        f"page and a bad query every {BAD_EVERY} rounds",
        "",
        f"RSS after warm-up: {result['rss_first_mib']:.0f} -> {result['rss_last_mib']:.0f} "
        f"MiB ({result['rss_growth_mib']:+.0f} MiB, slope "
        f"{result['rss_slope_mib_per_min']:+.1f} MiB/min); peak {result['peak_rss_mib']:.0f} "
        f"MiB. Pages/s first window after warm-up {result['pages_per_s_first']:.2f}, last "
        f"{result['pages_per_s_last']:.2f}.",
        "",
        "| t (s) | pages/s | queries/s | scored pairs/s | bad items (work kept) | RSS MiB |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {w['t_s']:.0f} | {w['pages_per_s']:.2f} | {w['queries_per_s']:.1f} | "
        f"{w['pairs_per_s']:.0f} | {w['errors_kept_work']} | {w['rss_mib']:.0f} |"
        for w in windows
    ]
    (RESULTS / "soak.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, help="model folder (default: the tiny model)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "colembed-soak")
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--interval", type=float, default=15.0, help="seconds per window")
    parser.add_argument("--batch", type=int, default=4, help="pages per round")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    info = machine_info()
    import colembed
    from colembed.safe_fs import make_work_folder

    folder = args.folder or tiny_folder(make_work_folder(args.work, "soak benchmark"))
    model = colembed.load(folder, threads=args.threads)
    windows = soak(model, args.minutes, args.interval, args.batch, args.seed)
    random = " (random weights)" if model.manifest.model.random_weights else ""
    setup = {
        "model": model.name + random,
        "minutes": args.minutes,
        "batch": args.batch,
        "interval_s": args.interval,
    }
    write(info, setup, windows, summary(windows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
