"""Question: Does batching same-grid pages through the image graph pay?
Answer: no: no CPU time saved, ~0.85 GB more peak memory per extra letter page
Note: none kept (answer recorded in benchmarks/README.md, "What the design rests on")

Does batching same-grid pages through the image graph pay? (It decides `model._vision_features`.)

    python -m benchmarks.experiments.vision_batching             # letter, 256- and 64-token pages
    python -m benchmarks.experiments.vision_batching --tokens 0  # letter pages only

A random-weight checkpoint with Qwen2-VL-2B widths (1280 wide, 16 heads; 2 vision layers, 1
language layer: only the image graph is timed) is built and exported once into `--workdir`. Each
(page size, batch size) runs in its own process so that peak RSS is its own: 4 same-grid pages go
through the image graph in batches of 1, 2 or 4, twice; CPU seconds per page (this process, all
threads) is reported beside wall time because a shared machine distorts wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # the benchmarks folder

from benchmarks.shared.common import budget_page, letter_page, rss_mib  # noqa: E402

from colembed.layout import MANIFEST_NAME  # noqa: E402

PAGES = 4


def build(work: Path) -> Path:
    from colembed_export.pipeline.exporter import export_model
    from colembed_export.testing.tiny_qwen2 import PRESETS, build_checkpoint

    spec = dataclasses.replace(PRESETS["qwen2-vl-2b"], vision_depth=2, text_layers=1)
    checkpoint, folder = work / "ckpt", work / "model"
    if not (checkpoint / "colembed_tiny.json").is_file():
        build_checkpoint(checkpoint, spec, seed=0)
    if not (folder / MANIFEST_NAME).is_file():
        export_model(checkpoint, folder, check=False)
    return folder


def run(folder: Path, batch: int, tokens: int, threads: int) -> dict:
    """One measurement, in this process: PAGES same-grid pages in image-graph runs of `batch`."""
    import numpy as np

    import colembed
    from colembed.preprocess.images import prepare_image

    model = colembed.load(folder, threads=threads)
    page = letter_page() if not tokens else budget_page(letter_page(), tokens, model.config)
    pages = [prepare_image(page, model.config, index=i) for i in range(PAGES)]
    grid_inputs = model._grid_inputs(pages[0].grid_thw)  # rotary tables (+ window layout)
    vision, contract = model._sessions["vision"], model._contracts["vision"]

    def once() -> None:
        for lo in range(0, PAGES, batch):
            pixels = np.stack([p.patches for p in pages[lo : lo + batch]])
            vision.run(contract.feeds(pixels, *grid_inputs))

    once()
    wall, cpu = [], []
    for _ in range(2):
        start, start_cpu = time.perf_counter(), time.process_time()
        once()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {
        "batch": batch,
        "patches": int(pages[0].patches.shape[0]),
        "wall_s_per_page": min(wall) / PAGES,
        "cpu_s_per_page": min(cpu) / PAGES,
        "peak_rss_mib": rss_mib()["peak"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "colembed-bench")
    parser.add_argument(
        "--tokens",
        type=int,
        nargs="*",
        default=[0, 256, 64],
        help="page sizes: 0 = a letter page at 150 dpi, else a token budget",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        job = json.loads(args.worker)
        print(
            "RESULT "
            + json.dumps(run(Path(job["folder"]), job["batch"], job["tokens"], job["threads"]))
        )
        return 0
    folder = build(args.workdir / "vision-batching")
    print(
        "| page | patches | batch | wall s/page | CPU s/page | peak RSS MiB |\n|---|---|---|---|---|---|"
    )
    for tokens in args.tokens:
        for batch in (1, 2, 4):
            job = {"folder": str(folder), "batch": batch, "tokens": tokens, "threads": args.threads}
            out = subprocess.run(
                [sys.executable, "-m", __spec__.name, "--worker", json.dumps(job)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            r = json.loads(out.split("RESULT ", 1)[1])
            label = "letter, 150 dpi" if not tokens else f"{tokens}-token budget"
            print(
                f"| {label} | {r['patches']} | {batch} | {r['wall_s_per_page']:.3f} | "
                f"{r['cpu_s_per_page']:.3f} | {r['peak_rss_mib']:.0f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
