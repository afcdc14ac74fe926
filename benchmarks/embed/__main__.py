"""Embedding benchmark: torch reference vs every colembed variant, side by side, same threads.

    python -m benchmarks.embed --quick                 # 2+2 layers, few repeats (< 10 min)
    python -m benchmarks.embed                         # 4+4 layers (default)
    python -m benchmarks.embed --vision-depth 32 --text-layers 28   # the real depth
    python -m benchmarks.embed --family colqwen2.5 --quick      # ColQwen2.5, 2+2 layers
    python -m benchmarks.embed --family colqwen3 --quick        # ColQwen3 (Qwen3-VL-4B widths)

What it does, in one run:
1. builds a random-weight checkpoint of the `--family` with its published model's widths, heads and
   vocabulary at the requested depth (colqwen2: Qwen2-VL-2B, export/testing/tiny_qwen2.py preset "qwen2-vl-2b";
   colqwen2.5: Qwen2.5-VL-3B, export/testing/tiny_qwen2_5.py preset "qwen2.5-vl-3b", both attention kinds
   kept; colqwen3: Qwen3-VL-4B, export/testing/tiny_qwen3.py preset "qwen3-vl-4b", the DeepStack blocks
   that fit the depth; benchmarks/shared/specs.py) and exports it with `--variants` (cached in `--workdir`,
   keyed by family and depth, and re-exported when the exporter's source differs from the one
   that wrote it: embed_models.EXPORTER_STAMP);
2. measures the machine's fp32 GEMM peak (numpy sgemm) and int8 matmul peak (onnxruntime
   MatMulInteger, u8 x s8) with the same threads;
3. runs each runtime in its own subprocess (so peak RSS is its own): the torch reference
   (transformers 4.57.1 `ColQwen2ForRetrieval`, eager, fp32; for ColQwen2.5 over the
   Qwen2.5-VL config with the `get_dtype` shim; for ColQwen3 colpali-engine 0.3.18 on
   transformers 5.24 in the pinned reference's own environment, benchmarks/embed/torch_reference.py)
   and colembed fp32 + each variant:
   load (time, peak RSS), a letter page at 150 dpi (744 image tokens) and at a 256-token budget
   (pages/s), query latency at batch 1 (median, p90), queries/s at batch 16, peak RSS of
   embedding; then the variant's embeddings of a synthetic retrieval set (100 pages, 20 queries)
   for the accuracy figures against colembed fp32;
4. inspects onnxruntime's transformer optimiser on the fp32 graphs (which fusions fire, op counts
   before/after, graph time before/after); with `--profile`, where one letter page's time goes per
   colembed runtime (onnxruntime's profiler) and the int8 bound: the page's x torch if every
   quantised GEMM ran at the int8 peak;
5. writes `benchmarks/results/embed/embed.json` and `embed.md` (`embed-colqwen2_5.*` for ColQwen2.5;
   machine, versions, command, date), with the targets fp32 >= torch per page, int8 >= 2.5x.

FLOP/s are counted from the architecture and shapes (benchmarks/shared/flops.py): useful work only (real
tokens, no padding). Everything is end to end (preprocessing included) except the optimiser's
graph timings. Random weights lack the outliers of trained weights: the accuracy figures are
necessary, not sufficient.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]  # the benchmarks folder

from benchmarks.shared.common import budget_page, letter_page, machine_info  # noqa: E402,F401  (re-exported)
from benchmarks.shared.common import write_note  # noqa: E402
from benchmarks.shared.embed_models import (  # noqa: E402
    GATE_MISSES,
    INT8_BASELINE,
    add_int8_baseline,  # noqa: F401
    gate_figures,
    prepare_model,
)
from benchmarks.embed.optimiser import optimiser_report  # noqa: E402
from benchmarks.embed.report import accuracy, derive, markdown  # noqa: E402
from benchmarks.embed.worker import gemm_peaks, spawn  # noqa: E402
from benchmarks.shared.flops import Shapes  # noqa: E402

from colembed.layout import BASE_VARIANT, MANIFEST_NAME  # noqa: E402
from colembed.sessions import physical_cores  # noqa: E402

WIDTHS = {"colqwen2": "Qwen2-VL-2B", "colqwen2.5": "Qwen2.5-VL-3B", "colqwen3": "Qwen3-VL-4B"}
RESULT_STEMS = {"colqwen2": "embed", "colqwen2.5": "embed-colqwen2_5", "colqwen3": "embed-colqwen3"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--family",
        choices=tuple(WIDTHS),
        default="colqwen2",
        help="model family (widths of Qwen2-VL-2B, Qwen2.5-VL-3B or Qwen3-VL-4B)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small setting: 2+2 layers, few repeats, 40 retrieval pages",
    )
    parser.add_argument("--vision-depth", type=int, help="vision layers (real: 32; default 4)")
    parser.add_argument("--text-layers", type=int, help="language layers (real: 28; default 4)")
    parser.add_argument(
        "--variants",
        help="the colembed variants timed (default fp32,int8,int4,fp16; with --full fp32,int8); "
        "the OpenVINO variants (openvino, openvino-bf16, openvino-int8) run on OpenVINO",
    )
    parser.add_argument(
        "--int8-weight-passes",
        type=int,
        choices=(1, 2),
        help="force the exporter's int8 recipe (one or two codes per weight) instead of its "
        "fallback (one code, two when the gate refuses one)",
    )
    parser.add_argument(
        "--page-repeats", type=int, help="timed pages per runtime (after a warm-up)"
    )
    parser.add_argument("--query-repeats", type=int, help="timed single queries per runtime")
    parser.add_argument(
        "--no-budget-page",
        action="store_true",
        help="time the letter page only, not the same page at the 256-token budget",
    )
    parser.add_argument("--no-torch", action="store_true", help="skip the torch reference")
    parser.add_argument(
        "--no-bf16",
        action="store_true",
        help="skip the torch bf16 SDPA row (dtype=torch.bfloat16, "
        'attn_implementation="sdpa") beside the eager fp32 reference',
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="the full-depth table: 32 vision blocks + 28 language layers, torch "
        "eager fp32, torch bf16 SDPA, colembed fp32 and int8, each in its own "
        "process, best of 2 pages / 3 queries; no accuracy set, no optimiser "
        "(~15 min on 2 quiet cores, ~10 GB: run it under a memory lock on a "
        "shared machine); --variants adds others; writes results/embed/embed-full.*",
    )
    parser.add_argument("--no-optimiser", action="store_true", help="skip the optimiser report")
    parser.add_argument(
        "--arena-off", action="store_true", help="also run fp32 with the CPU memory arena off"
    )
    parser.add_argument(
        "--stress",
        action="store_true",
        help="also export the stress checkpoint (trained-model activation traits) "
        "at the same widths and depth and report its gate figures",
    )
    parser.add_argument(
        "--int8-baseline",
        action="store_true",
        help="also time the plain int8 recipe (no outlier smoothing) in this run",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile one letter page per colembed runtime: time by op type, "
        "and the int8 bound (quantised GEMMs at the int8 peak)",
    )
    parser.add_argument("--threads", type=int, help="intra-op threads (default: physical cores)")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path(
            os.environ.get("COLEMBED_BENCH_DIR", Path.home() / ".cache" / "colembed-bench")
        ),
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=HERE / "results" / "embed",
        help="folder for embed.json / embed.md",
    )
    parser.add_argument(
        "--against",
        metavar="REF",
        help="the release guard: time this checkout against REF (a git ref, or a "
        "folder to put on PYTHONPATH) interleaved, fp32 and int8, 2+2 layers; "
        "exit 1 when a column is slower than --margin "
        "(writes results/embed/embed-against.*)",
    )
    parser.add_argument(
        "--graphs",
        choices=("auto", "same", "own"),
        default="auto",
        help="--against: both on this checkout's export (same) or each version "
        "on its own exporter's graphs (own); auto: same when REF loads it",
    )
    parser.add_argument("--rounds", type=int, default=7, help="--against: interleaved rounds")
    parser.add_argument(
        "--against-variants",
        default="fp32,int8",
        help="--against: the variants timed (one at a time: each version's process "
        "holds one variant, ~2.2 GB for fp32 at 2+2, ~1.6 GB for int8)",
    )
    parser.add_argument(
        "--margin",
        type=float,
        default=0.05,
        help="--against: allowed slowdown of a column's median ratio",
    )
    args = parser.parse_args(argv)

    started = time.perf_counter()
    info = machine_info()
    threads = args.threads or physical_cores()
    if args.full:
        args.vision_depth, args.text_layers = args.vision_depth or 32, args.text_layers or 28
        args.variants, args.no_optimiser = args.variants or "fp32,int8", True
    shallow = args.quick or args.against
    args.vision_depth = args.vision_depth or (2 if shallow else 4)
    args.text_layers = args.text_layers or (2 if shallow else 4)
    args.threads = threads
    args.variants = [BASE_VARIANT] + [
        v for v in (args.variants or "fp32,int8,int4,fp16").split(",") if v and v != BASE_VARIANT
    ]
    repeats = (
        {"page_repeats": 2, "query_repeats": 3, "batch_repeats": 1, "retrieval_pages": 0}
        if args.full
        else {"page_repeats": 2, "query_repeats": 12, "batch_repeats": 2, "retrieval_pages": 100}
        if args.quick
        else {"page_repeats": 5, "query_repeats": 40, "batch_repeats": 5, "retrieval_pages": 100}
    )
    if args.page_repeats:
        repeats["page_repeats"] = args.page_repeats
    if args.query_repeats:
        repeats["query_repeats"] = args.query_repeats
    work = args.workdir.expanduser()
    work.mkdir(parents=True, exist_ok=True)

    def progress(message: str) -> None:
        print(
            f"[bench {time.perf_counter() - started:6.0f}s] {message}", file=sys.stderr, flush=True
        )

    if args.against:
        from benchmarks.embed.against import run_against

        args.variants = [BASE_VARIANT, "int8"]
        ckpt, folder, _ = prepare_model(args, work, progress)
        return run_against(args, ckpt, folder, work, progress)
    ckpt, folder, spec = prepare_model(args, work, progress)
    gate_folders = {"random weights": folder}
    if args.stress:
        gate_folders["stress"] = prepare_model(args, work, progress, stress=True)[1]
    if args.int8_baseline and "int8" in args.variants:
        add_int8_baseline(folder, progress)
    shapes = Shapes.from_manifest(json.loads((folder / MANIFEST_NAME).read_text()))
    shapes = dataclasses.replace(
        shapes, full_blocks=len(getattr(spec, "fullatt_block_indexes", ()))
    )
    progress("measuring GEMM peaks")
    peaks = gemm_peaks(threads)
    progress(
        f"fp32 peak {peaks['fp32_gflops']:.0f} GFLOP/s, int8 peak {peaks['int8_gops']:.0f} GOP/s"
    )

    jobs: dict[str, dict[str, Any]] = {}
    if not args.no_torch:
        jobs["torch"] = {
            "runtime": "torch",
            "variant": "torch",
            "checkpoint": str(ckpt),
            "family": args.family,
        }
        if not args.no_bf16:
            jobs["torch-bf16"] = {
                "runtime": "torch",
                "torch_runtime": "torch-bf16",
                "variant": "torch-bf16",
                "checkpoint": str(ckpt),
                "family": args.family,
            }
    for variant in args.variants:
        # the embeddings for the accuracy figures: the timed letter page and 16 queries, and the
        # retrieval set (none at full depth: 100 pages would take hours)
        jobs[variant] = {
            "runtime": "colembed",
            "variant": variant,
            "folder": str(folder),
            "embeddings_out": str(work / f"emb-{variant}.npz"),
        }
        if variant == "int8" and args.int8_baseline:
            jobs[INT8_BASELINE] = {
                "runtime": "colembed",
                "variant": INT8_BASELINE,
                "folder": str(folder),
            }
    if args.arena_off:
        jobs["fp32 (arena off)"] = {
            "runtime": "colembed",
            "variant": BASE_VARIANT,
            "folder": str(folder),
            "cpu_mem_arena": False,
        }
    rows: dict[str, dict[str, Any]] = {}
    # torch bf16 runs last: on a CPU without bf16 arithmetic it takes the longest by far (minutes a
    # page at full depth), and the other rows are then in even if it is stopped; the table keeps
    # the jobs' order
    last = ["torch-bf16"] if "torch-bf16" in jobs else []
    for name in [n for n in jobs if n not in last] + last:
        job = jobs[name]
        progress(f"running {name}")
        job.update(
            repeats, threads=threads, profile=args.profile, budget_page=not args.no_budget_page
        )
        stale = job.get("embeddings_out")
        if stale and Path(stale).exists():
            Path(stale).unlink()
        # a full-depth torch bf16 page takes minutes where the CPU has no bf16 arithmetic
        rows[name] = spawn(job, timeout=4 * 3600 if args.full else 3600) | {
            "runtime": job["runtime"],
            "variant": job["variant"],
        }
        if "error" in rows[name]:
            progress(f"{name} failed: {rows[name]['error'][-300:]}")
        else:
            r = rows[name]
            progress(
                f"{name}: page {r['page_s']['median']:.2f} s, query "
                f"{r['query_latency_s']['median'] * 1e3:.0f} ms, 16 queries "
                f"{r['batch16_s']['median']:.2f} s"
            )
    rows = {name: rows[name] for name in jobs}
    # Peaks again at the end: a busy machine understates a single measurement; keep the best.
    again = gemm_peaks(threads)
    peaks["fp32_gflops_runs"] = [peaks["fp32_gflops"], again["fp32_gflops"]]
    peaks["int8_gops_runs"] = [peaks["int8_gops"], again["int8_gops"]]
    peaks["fp32_gflops"] = max(peaks["fp32_gflops_runs"])
    peaks["int8_gops"] = max(peaks["int8_gops_runs"])
    derive(rows, shapes, peaks, folder, ckpt)
    results: dict[str, Any] = {
        "machine": info,
        "setting": {
            "vision_depth": args.vision_depth,
            "text_layers": args.text_layers,
            "threads": threads,
            "quick": args.quick,
            "stress": args.stress,
            "budget_page": not args.no_budget_page,
            "int8_weight_passes": args.int8_weight_passes,
            **repeats,
            "family": args.family,
            "workdir": str(work),
            "model": f"{WIDTHS[args.family]} widths, random weights",
        },
        "peaks": peaks,
        "runtimes": rows,
        "accuracy": accuracy(work, [v for v in args.variants if v != BASE_VARIANT]),
        "gate_misses": GATE_MISSES,
        "gates": gate_figures(gate_folders),
    }
    if not args.no_optimiser:
        progress("transformer optimiser report")
        try:
            results["optimiser"] = optimiser_report(folder, threads, page_tokens=744)
        except Exception as e:  # noqa: BLE001  (informative section; never fails the run)
            results["optimiser"] = {"error": f"{type(e).__name__}: {e}"}
    results["elapsed_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    stem = RESULT_STEMS[args.family] + ("-full" if args.full else "")
    write_note(args.out / stem, results, markdown(results))
    progress(f"wrote {args.out / stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
