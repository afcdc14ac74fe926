"""MaxSim scoring throughput: colembed (numpy, onnx graph) against fast-maxsim (and optionally
transformers' `score_retrieval` and a padded numpy einsum), with the machine's memory bandwidth and
fp32 GEMM peak measured in the same run, so each cell reports its fraction of the roofline.

    python -m benchmarks.scoring --quick    # 1/32 queries x 200 pages
    python -m benchmarks.scoring --grid \
        --only 'colembed numpy,colembed onnx,fast-maxsim' --out benchmarks/results/scoring/scoring-grid.md
    # the standard grid: 1/4/32 queries x 1,000/5,000/10,000/20,000 pages (20,000 pages are 7.7 GB)

Data (one process, every contender on the same arrays): L2-normalised random float32 vectors,
dim 128; pages of 700-800 tokens (ColQwen2 pages: up to 768 image tokens plus the prompt), each
its own C-contiguous array as colembed's runtime returns them (`embed_images`: one array per page);
queries of 18-34 tokens ("Query: " + text + 10 augmentation tokens). Random vectors model the
shapes, the memory traffic and the arithmetic, not the score distribution of real pages (MaxSim's
cost does not depend on the values). The pages are made once for the largest cell and the
smaller cells use the first N of them, all in memory (a search over pages already read; reading
them from disk is the index's cost, not the scorer's). The padded contenders (einsum,
score_retrieval) get a zero-padded copy, made only when they are selected.

Contenders:
- colembed numpy: `colembed.score(..., backend="numpy")` (what `colembed.score` runs by default)
- colembed onnx:  `MaxSimScorer.with_built_graph().score(..., backend="onnx")` (maxsim.onnx on
  onnxruntime's CPU provider, padded chunks under the default 32 MiB budget)
- fast-maxsim:    `fast_maxsim.maxsim_scores_variable(query, pages)` (PyPI `fast-maxsim` 0.2.0, a
  Rust CPU MaxSim on libxsmm; a benchmark-only dependency, the `bench` extra), one call per query
  (it takes one 2-D query), exact like colembed (no padding)
- transformers `ColQwen2Processor.score_retrieval` (4.57.1, torch CPU; batches of 128, zero-padded)
- numpy einsum:   `np.einsum("qnd,csd->qcns", optimize=True).max(3).sum(2)` over zero-padded
  batches of 128 pages (what one writes by hand; the reference's zero-row semantics)

Interleaving: in each round every contender runs once, in an order rotated round after round, and
the machine's peaks are re-measured; each contender's best round is reported (medians too). On a
shared machine background load then hits every contender alike, so the ratios hold even when the
absolute times do not.

The roofline of a cell: the slower of reading every page once at the measured read bandwidth and
the useful work (2 * query tokens * page tokens * dim per (query, page); padding not credited) at
the measured sgemm peak. Read bandwidth: the best of a STREAM-style read (numpy sum, one thread
per core, each over its half of 1 GiB) and an sgemv over the first pages (BLAS, every core);
STREAM copy (bytes read + written) is reported beside it. sgemm peak: numpy `matmul` at the shape
of one page against every query row (what colembed's kernel calls) and 2048^3, one BLAS call on
every core, and 1024^3 on a thread per core each calling a single-threaded BLAS, into
preallocated outputs. Every cell's roofline uses the best peak and the best read bandwidth
measured anywhere in the run (`apply_machine_roofline`: a peak measured under load is too low and
flatters every contender); each cell's own measurements are printed beside it.

A/B against older code: `--against REF` (a git ref, repeatable) adds the column
`colembed numpy @REF`, colembed/scoring.py as of REF loaded beside today's in the same process
(`scoring_at`), run in the same rotated rounds on the same arrays; each cell reports the ratio of
the two per round.

Memory: `--bigmem-lock PATH` takes an exclusive flock on PATH before the pages pass 4 GB (the
shared machine's rule; 20,000 pages are 7.7 GB) and holds it to the end of the run.

Writes benchmarks/results/scoring/scoring.{md,json} (--quick: scoring-quick.*; --out elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent

from benchmarks.shared.machine import load_average, machine_info  # noqa: E402

REPO = HERE.parent
RESULTS = REPO / "benchmarks" / "results" / "scoring"
DIM = 128
PAGE_TOKENS = (700, 800)
QUERY_TOKENS = (18, 34)
REFERENCE_BATCH = 128
PEAK_PAGE_TOKENS = 16_384
TARGET_VS_REFERENCE = 2.0
GRID = (
    "1x1000,4x1000,32x1000,1x5000,4x5000,32x5000,1x10000,4x10000,32x10000,1x20000,4x20000,32x20000"
)
BIGMEM_BYTES = 4 << 30
STREAM_BYTES = 1 << 30


# ---------------------------------------------------------------------------------- inputs
def unit_rows(x: np.ndarray) -> np.ndarray:
    x /= np.linalg.norm(x, axis=-1, keepdims=True)
    return x


class Pages:
    """Ragged float32 pages, each its own array (as colembed's runtime returns them), made on
    demand in a fixed order: `first(n)` is always the same n pages. Before the pages pass
    BIGMEM_BYTES an exclusive flock is taken on `lock_path` (if given) and held until exit."""

    def __init__(self, seed: int, lock_path: Path | None = None) -> None:
        self.rng = np.random.default_rng(seed)
        self.pages: list[np.ndarray] = []
        self.bytes = 0
        self.lock_path, self.lock_file = lock_path, None

    def first(self, n: int) -> list[np.ndarray]:
        while len(self.pages) < n:
            length = int(self.rng.integers(PAGE_TOKENS[0], PAGE_TOKENS[1] + 1))
            if (
                self.bytes + 4 * length * DIM > BIGMEM_BYTES
                and self.lock_file is None
                and self.lock_path is not None
            ):
                import fcntl

                print(f"waiting for {self.lock_path} ...", file=sys.stderr)
                self.lock_file = open(self.lock_path, "a")
                fcntl.flock(self.lock_file, fcntl.LOCK_EX)
                print(f"holding {self.lock_path}", file=sys.stderr)
            self.pages.append(unit_rows(self.rng.standard_normal((length, DIM), dtype=np.float32)))
            self.bytes += 4 * length * DIM
        return self.pages[:n]


def padded_pool(pages: list[np.ndarray]) -> np.ndarray:
    """(n, 800, dim) zero-padded copy for the padded contenders."""
    pool = np.zeros((len(pages), PAGE_TOKENS[1], DIM), dtype=np.float32)
    for i, p in enumerate(pages):
        pool[i, : len(p)] = p
    return pool


def make_queries(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        unit_rows(rng.standard_normal((int(k), DIM), dtype=np.float32))
        for k in rng.integers(QUERY_TOKENS[0], QUERY_TOKENS[1] + 1, n)
    ]


def padded(queries: list[np.ndarray]) -> np.ndarray:
    out = np.zeros((len(queries), max(len(q) for q in queries), DIM), dtype=np.float32)
    for i, q in enumerate(queries):
        out[i, : len(q)] = q
    return out


# ------------------------------------------------------------------------------ contenders
def scoring_at(ref: str):
    """colembed/scoring.py as it was at git ref `ref`, loaded beside the current one as the module
    `colembed._scoring_at_REF` (its relative imports resolve in today's package: errors/sessions),
    so both run in one process on the same arrays, interleaved (the A/B of `--against`)."""
    import importlib.util
    import subprocess

    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{ref}:colembed/scoring.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    name = "colembed._scoring_at_" + "".join(c if c.isalnum() else "_" for c in ref)
    path = Path(os.environ.get("COLEMBED_BENCH_DIR", "/tmp")) / f"{name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def contenders(queries, pages, scorer, only, onnx_min_queries=1, against=None):
    from colembed import scoring

    def wanted(key):
        return (only is None or key in only) and (
            key != "colembed onnx" or len(queries) >= onnx_min_queries
        )

    found = {}
    if wanted("fast-maxsim"):
        try:
            import fast_maxsim

            found["fast-maxsim"] = lambda: np.stack(
                [np.asarray(fast_maxsim.maxsim_scores_variable(q, pages)) for q in queries]
            )
        except ImportError:
            print(
                "fast-maxsim is not installed (pip install 'colembed[bench]'): its column is "
                "left out",
                file=sys.stderr,
            )
    found["colembed numpy"] = lambda: scoring.score(queries, pages, backend="numpy")
    for ref, module in (against or {}).items():
        found[f"colembed numpy @{ref}"] = lambda module=module: module.score(
            queries, pages, backend="numpy"
        )
    if wanted("colembed onnx"):
        found["colembed onnx"] = lambda: scorer.score(queries, pages, backend="onnx")
    if wanted("transformers score_retrieval"):
        import torch
        from transformers.models.colqwen2.processing_colqwen2 import ColQwen2Processor

        tq = [torch.from_numpy(q) for q in queries]
        tp = [torch.from_numpy(p) for p in pages]
        # score_retrieval never reads `self`; calling it on the class avoids building a tokenizer.
        found["transformers score_retrieval"] = lambda: ColQwen2Processor.score_retrieval(
            None, tq, tp
        ).numpy()
    if wanted("numpy einsum (padded)"):
        pool, lengths = padded_pool(pages), np.array([len(p) for p in pages])
        qpad = padded(queries)

        def einsum():
            out = []
            for j in range(0, len(pages), REFERENCE_BATCH):
                batch = pool[j : j + REFERENCE_BATCH, : int(lengths[j : j + REFERENCE_BATCH].max())]
                out.append(np.einsum("qnd,csd->qcns", qpad, batch, optimize=True).max(3).sum(2))
            return np.concatenate(out, axis=1)

        found["numpy einsum (padded)"] = einsum
    return found


def gemm_peaks(query_rows: int):
    """sgemm at colembed's per-page shape (one 800-token page against every query row and the two
    sign rows) and at 2048^3, every core."""
    rng = np.random.default_rng(1)
    page = rng.standard_normal((PAGE_TOKENS[1], DIM), dtype=np.float32)
    qt = rng.standard_normal((DIM, query_rows + 2), dtype=np.float32)
    out = np.empty((PAGE_TOKENS[1], query_rows + 2), dtype=np.float32)
    big = rng.standard_normal((2048, 2048), dtype=np.float32)
    big_out = np.empty_like(big)

    def shaped():
        for _ in range(16):
            np.matmul(page, qt, out=out)

    def square():
        np.matmul(big, big, out=big_out)

    return {
        "shaped": (shaped, 16 * 2.0 * (query_rows + 2) * PAGE_TOKENS[1] * DIM),
        "square": (square, 2.0 * 2048**3),
    }


def per_core_gemm_peak(threads: int):
    """sgemm 1024^3 on `threads` threads at once, each calling a single-threaded BLAS (what
    colembed's page workers and fast-maxsim's threads do): the machine's fp32 GEMM rate without
    OpenBLAS's own thread hand-offs, which under load lose a whole core to a descheduled helper
    (a 2-thread 2048^3 measured ~100 GFLOP/s beside other jobs and ~177 without)."""
    from concurrent.futures import ThreadPoolExecutor

    from colembed.blas import local_thread_limit

    limit = local_thread_limit()
    rng = np.random.default_rng(2)
    a = rng.standard_normal((1024, 1024), dtype=np.float32)
    outs = [np.empty_like(a) for _ in range(threads)]
    pool = ThreadPoolExecutor(threads)

    def one(i: int) -> None:
        previous = limit(1) if limit else None
        try:
            np.matmul(a, a, out=outs[i])
        finally:
            if limit:
                limit(previous)

    def run():
        list(pool.map(one, range(threads)))

    return {"per_core": (run, threads * 2.0 * 1024**3)}


def read_bandwidth(pages: list[np.ndarray]):
    """Read bandwidth over (up to 2,000 of) these very pages, far beyond the last-level cache:
    one sgemv (page x one vector, BLAS, every core) per page. A MaxSim over stored pages must read
    each page once, so bytes / bandwidth is its memory floor."""
    ones = np.ones(DIM, dtype=np.float32)
    some = pages[:2000]

    def read():
        for p in some:
            p @ ones

    return read, 4.0 * sum(p.size for p in some)  # "flops" here are bytes


def stream_bandwidth(threads: int):
    """STREAM-style read (numpy sum) and copy over 1 GiB, split between `threads` threads (numpy
    releases the GIL in both), as (function, bytes) pairs: copy counts bytes read + written."""
    from concurrent.futures import ThreadPoolExecutor

    src = np.ones(STREAM_BYTES // 4, dtype=np.float32)
    dst = np.empty_like(src)
    parts = np.array_split(np.arange(len(src)), threads)
    bounds = [(int(p[0]), int(p[-1]) + 1) for p in parts]
    pool = ThreadPoolExecutor(threads)

    def read():
        list(pool.map(lambda ab: np.add.reduce(src[ab[0] : ab[1]]), bounds))

    def copy():
        list(pool.map(lambda ab: np.copyto(dst[ab[0] : ab[1]], src[ab[0] : ab[1]]), bounds))

    return {"stream_read": (read, float(src.nbytes)), "stream_copy": (copy, 2.0 * src.nbytes)}


def best_gflops(fn, flops: float, seconds: float = 0.3) -> float:
    fn()
    best, t_end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return flops / best / 1e9


# ------------------------------------------------------------------------------------ runs
def run_case(name, queries, pages, scorer, rounds, only, stream, onnx_min_queries=1, against=None):
    from colembed import scoring

    lengths = np.array([len(p) for p in pages])
    q_rows = sum(len(q) for q in queries)
    flops = 2.0 * q_rows * float(lengths.sum()) * DIM
    page_bytes = 4.0 * float(lengths.sum()) * DIM
    fns = contenders(queries, pages, scorer, only, onnx_min_queries, against)
    peaks = gemm_peaks(q_rows) | per_core_gemm_peak(os.cpu_count() or 1) | stream
    peaks["sgemv_read"] = read_bandwidth(pages)
    times = {k: [] for k in fns}
    shares = {k: [] for k in fns}
    cores = os.cpu_count() or 1
    peak = {k: [] for k in peaks}
    outputs = {}
    loads = []
    for r in range(rounds):
        order = list(fns)[r % len(fns) :] + list(fns)[: r % len(fns)]
        for key in order:
            t, cpu = time.perf_counter(), time.process_time()
            outputs[key] = fns[key]()
            times[key].append(time.perf_counter() - t)
            # CPU time of this process over what all cores could give in that wall time: well
            # under 1 means other processes took cores (or the contender left them idle)
            shares[key].append((time.process_time() - cpu) / (times[key][-1] * cores))
            print(f"  {name} round {r + 1}: {key}: {times[key][-1]:.3f} s", file=sys.stderr)
        for key, (fn, fl) in peaks.items():
            peak[key].append(best_gflops(fn, fl))
        loads.append(load_average()[0] if load_average() else None)
    peak_shaped, peak_square = max(peak["shaped"]), max(peak["square"])
    gemm_peak = max(peak_shaped, peak_square, max(peak["per_core"]))
    read_gbs = max(max(peak["stream_read"]), max(peak["sgemv_read"]))

    # correctness, untimed: every exact contender agrees with colembed numpy; reference mode
    # equals both zero-padded contenders
    exact_numpy = outputs["colembed numpy"]
    scale = float(np.abs(exact_numpy).max())
    checks: dict = {"auto_backend": scorer.backend_for(queries)}
    for key in ["colembed onnx", "fast-maxsim"] + [k for k in outputs if "@" in k]:
        if key in outputs:
            checks[f"{key} vs colembed numpy, max rel"] = float(
                np.abs(outputs[key] - exact_numpy).max() / scale
            )
    reference = outputs.get("transformers score_retrieval")
    if reference is not None:
        ref_mode = scoring.score(queries, pages, reference_padding=True, backend="numpy")
        checks["reference_mode_vs_score_retrieval_max_abs"] = float(
            np.abs(ref_mode - reference).max()
        )
        if "numpy einsum (padded)" in outputs:
            checks["einsum_vs_score_retrieval_max_abs"] = float(
                np.abs(outputs["numpy einsum (padded)"] - reference).max()
            )
    floor_s = max(page_bytes / 1e9 / read_gbs, flops / 1e9 / gemm_peak)
    bound = "memory" if page_bytes / 1e9 / read_gbs >= flops / 1e9 / gemm_peak else "compute"
    ref_best = min(times.get("transformers score_retrieval", [0.0]))
    peer_best = min(times["fast-maxsim"]) if "fast-maxsim" in times else None
    rows = []
    for key, ts in times.items():
        best = min(ts)
        rows.append(
            {
                "contender": key,
                "best_s": best,
                "median_s": statistics.median(ts),
                "times_s": ts,
                "documents_per_s": len(pages) / best,
                "gflops": flops / best / 1e9,
                "fraction_of_gemm_peak": flops / best / 1e9 / gemm_peak,
                "page_gb_per_s": page_bytes / best / 1e9,
                "fraction_of_read_bandwidth": page_bytes / best / 1e9 / read_gbs,
                "fraction_of_roofline": floor_s / best,
                "speedup_vs_score_retrieval": (ref_best / best if ref_best else None),
                "speedup_vs_fast_maxsim": (peer_best / best if peer_best else None),
                # same round, both ways: the ratio of each round's times (interleaved pairs)
                "per_round_vs_fast_maxsim": (
                    [p / t for p, t in zip(times["fast-maxsim"], ts)] if peer_best else None
                ),
                # the --against A/B: the older code's time / this contender's, per round
                "per_round_vs_against": {
                    k: [o / t for o, t in zip(times[k], ts)] for k in times if "@" in k and k != key
                },
                "cpu_share_best_round": shares[key][ts.index(best)],
            }
        )
    return {
        "case": name,
        "queries": len(queries),
        "documents": len(pages),
        "query_tokens": q_rows,
        "page_tokens": int(lengths.sum()),
        "useful_gflop": flops / 1e9,
        "gemm_peak_gflops": {
            "shaped": peak_shaped,
            "square_2048": peak_square,
            "per_core_1024": max(peak["per_core"]),
            "shaped_shape": [PAGE_TOKENS[1], DIM, q_rows + 2],
        },
        "bandwidth_gb_per_s": {
            k: max(peak[k]) for k in ("stream_read", "stream_copy", "sgemv_read")
        },
        "read_gb_per_s": read_gbs,
        "page_gb": page_bytes / 1e9,
        "roofline_s": floor_s,
        "bound": bound,
        "load_1min_per_round": loads,
        "rounds": rounds,
        "results": rows,
        "checks": checks,
    }


def apply_machine_roofline(cases: list[dict]) -> None:
    """Each cell's roofline and fractions against the machine's peaks: the best GEMM rate and
    read bandwidth measured in any round of any cell of the run. A peak is a property of the
    machine, and one measured under load is too low (flattering every contender: 156% of a
    2-thread sgemm that had lost a core to other jobs); the per-cell figures stay in the JSON."""
    gemm = max(
        max(v for k, v in c["gemm_peak_gflops"].items() if k != "shaped_shape") for c in cases
    )
    read = max(c["read_gb_per_s"] for c in cases)
    for c in cases:
        memory_s, compute_s = c["page_gb"] / read, c["useful_gflop"] / gemm
        c["machine_gemm_peak_gflops"], c["machine_read_gb_per_s"] = gemm, read
        c["roofline_s"] = max(memory_s, compute_s)
        c["bound"] = "memory" if memory_s >= compute_s else "compute"
        for r in c["results"]:
            r["fraction_of_gemm_peak"] = c["useful_gflop"] / r["best_s"] / gemm
            r["fraction_of_read_bandwidth"] = c["page_gb"] / r["best_s"] / read
            r["fraction_of_roofline"] = c["roofline_s"] / r["best_s"]


# ---------------------------------------------------------------------------------- report
def markdown(report: dict) -> str:
    m = report["machine"]
    load = [(m[k] or [float("nan")])[0] for k in ("load_average_at_start", "load_average_at_end")]
    cases = report["cases"]
    lines = [
        "# MaxSim scoring benchmark",
        "",
        f"- command: `{m['command']}`",
        f"- date: {m['date']}",
        f"- machine: {m['cpu']}, {m['physical_cores']} physical cores / {m['logical_cpus']} "
        f"logical, {m['memory_gib']} GiB; instruction sets: {', '.join(m['instruction_sets'])}",
        f"- numpy BLAS: {m['openblas'].get('config', m['openblas'])} (core "
        f"{m['openblas'].get('core', '?')}, {m['openblas'].get('threads', '?')} threads); "
        f"environment: {m['environment'] or 'no BLAS/OMP variables set'}",
        "- versions: " + ", ".join(f"{k} {val}" for k, val in m["versions"].items()),
        f"- load average (1 min) before / after: {load[0]:.2f} / {load[1]:.2f}, per round in "
        "each cell below: **under concurrent load** (a shared machine; every contender runs once "
        "per round in a rotated order, best round reported, the ratio per round too)",
        "",
    ]
    contenders = list(dict.fromkeys(r["contender"] for c in cases for r in c["results"]))
    peer = "fast-maxsim" in contenders
    olds = [c for c in contenders if "@" in c]
    lines += [
        "## Summary",
        "",
        "Best round per contender (s); `x fast-maxsim` = fast-maxsim's best / colembed's best "
        "(> 1: colembed ahead), with the range of the per-round ratios; `of roofline` = the "
        "roofline time (slower of reading the pages at the read bandwidth and the work at the "
        "sgemm peak, both the best measured anywhere in the run) over the best time.",
        "",
        "`CPU s` = this process's CPU time (every thread) in the contender's best round: "
        "the work done, which background load inflates far less than the wall time (a "
        "contender descheduled by other jobs loses wall time, not CPU time).",
        "",
        "| cell | bound | roofline s | "
        + " | ".join(f"{c} s" for c in contenders)
        + " | "
        + " | ".join(f"{c} CPU s" for c in contenders)
        + (" | numpy x fast-maxsim (rounds) | best colembed x fast-maxsim" if peer else "")
        + "".join(f" | numpy x numpy {c[15:]} (rounds)" for c in olds)
        + " | "
        + " | ".join(f"{c} of roofline" for c in contenders)
        + " | load |",
        "|---|---|---:|"
        + "---:|" * (2 * len(contenders))
        + ("---:|---:|" if peer else "")
        + "---:|" * len(olds)
        + "---:|" * len(contenders)
        + "---:|",
    ]
    for case in cases:
        by = {r["contender"]: r for r in case["results"]}
        row = [
            f"{case['queries']} x {case['documents']:,}",
            case["bound"],
            f"{case['roofline_s']:.3f}",
        ] + [f"{by[c]['best_s']:.3f}" if c in by else "-" for c in contenders]
        row += [f"{cpu_seconds(by[c], m):.2f}" if c in by else "-" for c in contenders]
        if peer:
            rr = by["colembed numpy"]["per_round_vs_fast_maxsim"]
            ours = min(
                (r for k, r in by.items() if k.startswith("colembed") and "@" not in k),
                key=lambda r: r["best_s"],
            )
            row += [
                f"{by['colembed numpy']['speedup_vs_fast_maxsim']:.2f}x "
                f"({min(rr):.2f}-{max(rr):.2f})",
                f"{ours['speedup_vs_fast_maxsim']:.2f}x ({ours['contender'][9:]})",
            ]
        for c in olds:
            rr = by["colembed numpy"]["per_round_vs_against"].get(c)
            row.append(
                f"{by[c]['best_s'] / by['colembed numpy']['best_s']:.2f}x "
                f"({min(rr):.2f}-{max(rr):.2f})"
                if rr
                else "-"
            )
        row += [f"{by[c]['fraction_of_roofline']:.0%}" if c in by else "-" for c in contenders]
        loads = [x for x in case["load_1min_per_round"] if x is not None]
        row.append(f"{min(loads):.1f}-{max(loads):.1f}" if loads else "?")
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    for case in cases:
        p, bw = case["gemm_peak_gflops"], case["bandwidth_gb_per_s"]
        lines += [
            f"## {case['queries']} quer{'y' if case['queries'] == 1 else 'ies'} "
            f"({case['query_tokens']} tokens) x {case['documents']:,} pages "
            f"({case['page_tokens']:,} tokens), dim {DIM}",
            "",
            f"Useful work {case['useful_gflop']:.1f} GFLOP over {case['page_gb']:.2f} GB of pages. "
            f"Measured in the same rounds: sgemm {p['shaped']:.1f} GFLOP/s at the per-page shape "
            f"{p['shaped_shape'][0]}x{p['shaped_shape'][1]}x{p['shaped_shape'][2]}, "
            f"{p['square_2048']:.1f} GFLOP/s at 2048^3, {p.get('per_core_1024', float('nan')):.1f} "
            f"GFLOP/s at 1024^3 on a single-threaded BLAS per core; read {bw['stream_read']:.1f} GB/s "
            f"(STREAM-style sum, a thread per core), {bw['sgemv_read']:.1f} GB/s (sgemv over the "
            f"pages), copy {bw['stream_copy']:.1f} GB/s. Roofline {case['roofline_s']:.3f} s "
            f"({case['bound']}-bound) at the run's best peaks "
            f"({case.get('machine_gemm_peak_gflops', float('nan')):.1f} GFLOP/s, "
            f"{case.get('machine_read_gb_per_s', float('nan')):.1f} GB/s). Best of {case['rounds']} rounds; load (1 min) per round: "
            + ", ".join(f"{x:.1f}" for x in case["load_1min_per_round"] if x is not None)
            + ".",
            "",
            "| contender | best s | median s | documents/s | GFLOP/s | of GEMM peak | page GB/s | "
            "of read bandwidth | of roofline | x fast-maxsim (per round) | CPU share |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in case["results"]:
            rr = r["per_round_vs_fast_maxsim"]
            lines.append(
                f"| {r['contender']} | {r['best_s']:.3f} | {r['median_s']:.3f} | "
                f"{r['documents_per_s']:,.0f} | {r['gflops']:.1f} | "
                f"{r['fraction_of_gemm_peak']:.0%} | {r['page_gb_per_s']:.2f} | "
                f"{r['fraction_of_read_bandwidth']:.0%} | {r['fraction_of_roofline']:.0%} | "
                + (
                    f"{r['speedup_vs_fast_maxsim']:.2f}x ("
                    + ", ".join(f"{x:.2f}" for x in rr)
                    + ")"
                    if rr
                    else "-"
                )
                + f" | {r['cpu_share_best_round']:.0%} |"
            )
        ab = next(
            (
                r["per_round_vs_against"]
                for r in case["results"]
                if r["contender"] == "colembed numpy"
            ),
            {},
        )
        for k, rr in ab.items():
            lines += [
                "",
                f"A/B, {k}'s time / colembed numpy's, per round (> 1: today's code "
                "faster): " + ", ".join(f"{x:.2f}" for x in rr),
            ]
        c = case["checks"]
        lines += [
            "",
            "Checks: "
            + ", ".join(
                f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}" for k, v in c.items()
            ),
            "",
        ]
    lines += ["## Targets", ""]
    for t in report["targets"]:
        lines.append(f"- {t['target']}: {t['value']} -> {'met' if t['met'] else 'NOT met'}")
    return "\n".join(lines) + "\n"


def cpu_seconds(row: dict, machine: dict) -> float:
    """CPU seconds of the process in a contender's best round (its CPU share x wall x cores)."""
    return row["cpu_share_best_round"] * row["best_s"] * (machine.get("logical_cpus") or 1)


def targets(cases: list[dict]) -> list[dict]:
    """colembed's best backend ahead of fast-maxsim in every cell, and >= 2x
    score_retrieval where that ran."""
    out = []
    for case in cases:
        by = {r["contender"]: r for r in case["results"]}
        ours = min(
            (r for k, r in by.items() if k.startswith("colembed") and "@" not in k),
            key=lambda r: r["best_s"],
        )
        cell = f"{case['queries']} x {case['documents']:,}"
        if ours["speedup_vs_fast_maxsim"]:
            out.append(
                {
                    "target": f"{cell}: colembed ahead of fast-maxsim",
                    "value": f"{ours['speedup_vs_fast_maxsim']:.2f}x ({ours['contender']}, "
                    "best rounds)",
                    "met": ours["speedup_vs_fast_maxsim"] > 1.0,
                }
            )
        if ours["speedup_vs_score_retrieval"]:
            out.append(
                {
                    "target": f"{cell}: colembed >= {TARGET_VS_REFERENCE:g}x score_retrieval",
                    "value": f"{ours['speedup_vs_score_retrieval']:.2f}x ({ours['contender']})",
                    "met": ours["speedup_vs_score_retrieval"] >= TARGET_VS_REFERENCE,
                }
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="cells 1x200 and 32x200")
    parser.add_argument("--grid", action="store_true", help=f"the standard cells: {GRID}")
    parser.add_argument("--cases", default="32x2000,1x10000", help="QUERIESxPAGES, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--big-rounds",
        type=int,
        default=None,
        help="rounds for cells of more than --big-gflop useful GFLOP (default: --rounds)",
    )
    parser.add_argument("--big-gflop", type=float, default=1000.0)
    parser.add_argument("--out", type=Path, default=None, help="markdown path (JSON beside it)")
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated contenders besides colembed numpy (default: all)",
    )
    parser.add_argument(
        "--onnx-min-queries",
        type=int,
        default=1,
        help="run colembed onnx only in cells of at least this many queries "
        "(colembed.score's default scorer has no graph; auto picks the "
        f"graph from {640} query tokens)",
    )
    parser.add_argument(
        "--against",
        action="append",
        default=[],
        metavar="REF",
        help="also run colembed/scoring.py as of this git ref (an A/B in the same "
        "rounds: the column 'colembed numpy @REF'); repeatable",
    )
    parser.add_argument(
        "--bigmem-lock",
        type=Path,
        default=None,
        help="flock this file before the pages pass 4 GB (a lock file shared by the heavy jobs of one machine)",
    )
    args = parser.parse_args(argv)
    out = args.out or RESULTS / ("scoring-quick.md" if args.quick else "scoring.md")

    info = machine_info()  # before the run (load average at start) and before torch loads
    import importlib.metadata

    try:
        info["versions"]["fast-maxsim"] = importlib.metadata.version("fast-maxsim")
    except importlib.metadata.PackageNotFoundError:
        pass
    from colembed.scoring import MaxSimScorer

    cells = "1x200,32x200" if args.quick else GRID if args.grid else args.cases
    # in the order given (the pages are made as the cells need them: put the big ones last,
    # the lock is held from the first cell past 4 GB to the end)
    grid = [tuple(int(x) for x in case.split("x")) for case in cells.split(",")]
    pages = Pages(seed=0, lock_path=args.bigmem_lock)
    scorer = MaxSimScorer.with_built_graph()
    against = {ref: scoring_at(ref) for ref in args.against}
    only = set(args.only.split(",")) if args.only else None
    stream = stream_bandwidth(os.cpu_count() or 1)
    cases = []
    for q, n in grid:
        queries = make_queries(q, 1 + q)
        flop = 2.0 * sum(len(x) for x in queries) * 750 * n * DIM / 1e9
        rounds = args.big_rounds if args.big_rounds and flop > args.big_gflop else args.rounds
        print(f"cell {q} x {n}: {rounds} rounds", file=sys.stderr)
        cases.append(
            run_case(
                f"{q} x {n:,}",
                queries,
                pages.first(n),
                scorer,
                rounds,
                only,
                stream,
                args.onnx_min_queries,
                against,
            )
        )
        apply_machine_roofline(cases)
        # each cell's figures as soon as they exist (a long grid keeps what it finished)
        report = {
            "machine": info | {"load_average_at_end": load_average()},
            "cases": cases,
            "targets": targets(cases),
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(markdown(report))
        out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
