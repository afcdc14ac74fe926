"""Which int4 text-graph recipe holds: each arm's text graph against fp32's, on the gate's inputs.

    COLEMBED_BENCH_DIR=DIR \
        python -m benchmarks.variants.int4_recipes --config 4b-2+2-random \
        --arm today:block=16,level=4 --arm level0:block=16,level=0 \
        --arm down8:block=16,level=4,bits=mlp.down_proj:8 --results benchmarks/results/NAME

An arm is recipes.quantize_int4 with other knobs: `block` (MatMulNBits block size along K;
`block8` that of the 8-bit roles),
`level` (accuracy level: 0/1 fp32 activations, 4 int8 activations per token and block), `sym`
(1: symmetric blocks, no zero points), `bits` (`fragment:bits+fragment:bits`, the first
module-path fragment found in a MatMul's path wins; 4 / 8 MatMulNBits bits, 32 left fp32;
`*:32` changes the default, e.g. `bits=down_proj:4+*:32` quantises only the down projections).

The fp32 export folder of `--config` (variants_fidelity.py's CONFIGS, built there under
$COLEMBED_BENCH_DIR/fidelity) is loaded once through the colembed runtime and the text graph's
feeds are recorded for the gate's queries (evaluation.gate_queries: one word to the bound) and its
pages (evaluation.gate_pages, each alone; their image features come from the fp32 vision graph).
Each arm's text graph is written to $COLEMBED_BENCH_DIR/int4-arms, run on the same feeds by
onnxruntime, and compared to the fp32 text graph's output per token (cosine: mean / min per
length bucket, as the gate buckets them). What it isolates: the text graph's recipe (the int4
variant's vision graph is the int8 one, the same in every arm; the full gate is
variants_fidelity.py's). Also per arm: the text graph's file size and the run time of the gate's
queries (the same pass, first run of a fresh session, under whatever load: a rough figure beside
the fidelity, not a speed benchmark).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.variants.fidelity import parse_arm

HERE = Path(__file__).resolve().parents[1]  # the benchmarks folder


def record(folder: Path) -> tuple[list[tuple[str, str, int, dict]], Any]:
    """(name, kind, bucket tokens, text feed) of each gate item, and the runtime."""
    import colembed
    from colembed.errors import QueryTruncatedWarning
    from colembed_export.variants.gates import gate_pages, gate_queries, recording_feeds

    runtime = colembed.load(folder, verify=False)
    recorded = recording_feeds(runtime)
    items = []
    for name, page in gate_pages(runtime):
        start = len(recorded["text"])
        out = runtime.embed_images([page], batch_size=1)
        feeds = recorded["text"][start:]
        items += [(f"page: {name}", "page", int(out[0].shape[0]), f) for f in feeds]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QueryTruncatedWarning)
        for name, text in gate_queries(runtime):
            start = len(recorded["text"])
            out = runtime.embed_queries([text])
            feeds = recorded["text"][start:]
            items += [(f"query: {name}", "query", int(out[0].shape[0]), f) for f in feeds]
    return items, runtime


def run_graph(path: Path, feeds: list[dict]) -> tuple[list[np.ndarray], list[float]]:
    """The graph's first output on each feed, and each run's seconds."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    first = session.get_outputs()[0].name
    outs, seconds = [], []
    for feed in feeds:
        start = time.perf_counter()
        value = session.run([first], feed)[0]
        seconds.append(time.perf_counter() - start)
        outs.append(value.reshape(-1, value.shape[-1]))
    del session
    return outs, seconds


def figures(items, got, want) -> dict[str, Any]:
    from colembed_export.variants.gates import bucket_name, token_cosines

    buckets: dict[str, list[np.ndarray]] = {}
    worst = (2.0, "")
    for (name, kind, tokens, _), a, b in zip(items, got, want):
        cos = token_cosines([a], [b])
        buckets.setdefault(bucket_name(kind, tokens), []).append(cos)
        if cos.min() < worst[0]:
            worst = (float(cos.min()), name)
    rows = {
        k: {"mean": float(np.concatenate(v).mean()), "min": float(np.concatenate(v).min())}
        for k, v in buckets.items()
    }
    every = np.concatenate([np.concatenate(v) for v in buckets.values()])
    return {
        "buckets": rows,
        "mean": float(every.mean()),
        "min": float(every.min()),
        "worst_item": worst[1],
        "bucket_means_min": min(r["mean"] for r in rows.values()),
    }


def report(args, info, arms, fp32_bytes, fp32_query_seconds) -> str:
    """The results page of the arms measured so far (written to --results after every arm)."""
    from colembed_export.variants.recipes import GATES
    from benchmarks.shared.common import results_markdown, write_results

    gate = GATES["int4"]
    buckets = sorted(
        {b for r in arms.values() for b in r["buckets"]},
        key=lambda b: (b.split()[0], int(b.split()[1].split("-")[0].rstrip("+"))),
    )
    lines = [
        f"Configuration `{args.config}`; fp32 text graph {fp32_bytes / 1e9:.3f} GB, the gate's "
        f"queries in {fp32_query_seconds:.1f} s (one pass, fp32). Text graph only: per-token "
        "cosine of each arm's text-graph output to fp32's on the gate's items (pages' image "
        "features from the fp32 vision graph), mean / min per bucket. The int4 gate: every "
        f"bucket's mean >= {gate.mean_cosine}.",
        "",
        "| arm | knobs | " + " | ".join(buckets) + " | all | text graph GB | queries s |",
        "|---|---|" + "---:|" * (len(buckets) + 3),
    ]
    for name, row in arms.items():
        cells = [
            f"{row['buckets'][b]['mean']:.5f} / {row['buckets'][b]['min']:.4f}"
            if b in row["buckets"]
            else ""
            for b in buckets
        ]
        holds = row["bucket_means_min"] >= gate.mean_cosine
        lines.append(
            f"| {'**' + name + '**' if holds else name} | `{row['spec'].partition(':')[2]}` | "
            + " | ".join(cells)
            + f" | {row['mean']:.5f} / {row['min']:.4f} | "
            f"{row['text_bytes'] / 1e9:.3f} | {row['query_seconds']:.1f} |"
        )
    lines += ["", "Bold: every bucket's mean at or above the int4 gate's mean (text graph alone)."]
    text = results_markdown(f"int4 text-graph recipes against fp32 ({args.config})", info, lines)
    if args.results:
        write_results(
            args.results,
            text,
            info,
            {
                "config": args.config,
                "arms": arms,
                "fp32_text_bytes": fp32_bytes,
                "fp32_query_seconds": fp32_query_seconds,
            },
        )
    return text


def weight_error(depth: int = 2560, width: int = 4096, tokens: int = 64) -> list[dict[str, Any]]:
    """One MatMul's error under each block format: a random (depth, width) weight (std 0.02, the
    random checkpoints' init) through onnxruntime's own block quantisers, dequantised in numpy, on
    `tokens` random rows: the product's relative error (Frobenius) and mean per-row cosine."""
    from colembed_export.variants.quantise import quantised_weight_4bit, quantised_weight_8bit

    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.02, (depth, width)).astype(np.float32)
    x = rng.normal(0, 1, (tokens, depth))
    want = x @ w.astype(np.float64)
    rows = []
    for bits in (4, 8):
        for block in (16, 32, 64, 128):
            for symmetric in (False, True):
                if bits == 4:
                    packed, scales, zeros = quantised_weight_4bit(w, block, symmetric)
                    codes = np.stack([packed & 15, packed >> 4], -1).reshape(width, -1, block)
                    zero = (
                        8.0
                        if symmetric
                        else np.stack([zeros & 15, zeros >> 4], -1).reshape(width, -1)[
                            :, : codes.shape[1], None
                        ]
                    )
                else:
                    codes, scales, zeros = quantised_weight_8bit(w, block, symmetric)
                    zero = 128.0 if symmetric else zeros[..., None]
                values = (codes.astype(np.float64) - zero) * scales[..., None]
                got = x @ values.reshape(width, -1)[:, :depth].T
                cos = (
                    np.sum(got * want, 1)
                    / np.linalg.norm(got, axis=1)
                    / np.linalg.norm(want, axis=1)
                )
                rows.append(
                    {
                        "bits": bits,
                        "block": block,
                        "symmetric": symmetric,
                        "relative_error": float(np.linalg.norm(got - want) / np.linalg.norm(want)),
                        "cosine": float(cos.mean()),
                        "bits_per_weight": bits + 32 / block + (0 if symmetric else bits / block),
                    }
                )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="4b-2+2-random")
    parser.add_argument("--arm", action="append", help="name:knobs (see above)")
    parser.add_argument(
        "--weight-error",
        action="store_true",
        help="instead: one MatMul's error "
        "per block format (4/8 bits, blocks 16-128, asymmetric/symmetric) on a "
        "random 2560x4096 weight, in numpy",
    )
    parser.add_argument("--results", help="path without extension")
    args = parser.parse_args()
    if args.weight_error:
        from benchmarks.shared.common import machine_info, report_results

        info = machine_info()
        rows = weight_error()
        lines = [
            "One MatMul, a random 2560x4096 weight (normal, std 0.02) quantised by onnxruntime's "
            "own block quantisers (quantise.quantised_weight_4bit / _8bit), dequantised in "
            "numpy, times 64 random rows (fp32 activations: the weights' error alone).",
            "",
            "| bits | block | zero points | bits per weight (with fp32 scales) | relative error "
            "of the product | mean per-row cosine |",
            "|---:|---:|---|---:|---:|---:|",
        ]
        lines += [
            f"| {r['bits']} | {r['block']} | {'none (symmetric)' if r['symmetric'] else 'yes'} | "
            f"{r['bits_per_weight']:.2f} | {r['relative_error']:.4f} | {r['cosine']:.6f} |"
            for r in rows
        ]
        title = "MatMulNBits block formats: one MatMul's weight error"
        report_results(title, info, lines, args.results, {"rows": rows})
        return 0
    if not args.arm:
        parser.error("--arm is required (or --weight-error)")

    from colembed_export.graphs.edits import finish
    from colembed_export.variants.recipes import quantize_int4, quiet_quantisers
    from colembed_export.variants.write import save_graph
    from benchmarks.shared.common import machine_info
    from benchmarks.variants.fidelity import build

    info = machine_info()
    base = Path(os.environ.get("COLEMBED_BENCH_DIR", "/tmp/colembed-bench-variants"))
    folder = build(args.config, base / "fidelity")
    work = base / "int4-arms"
    work.mkdir(parents=True, exist_ok=True)
    quiet_quantisers()
    items, runtime = record(folder)
    del runtime
    feeds = [f for *_, f in items]
    is_query = [kind == "query" for _, kind, _, _ in items]
    fp32_text = folder / "text.onnx"
    want, seconds = run_graph(fp32_text, feeds)
    fp32_query_seconds = sum(t for t, q in zip(seconds, is_query) if q)
    fp32_bytes = sum(p.stat().st_size for p in folder.glob("text.onnx*"))
    arms: dict[str, Any] = {}
    for text in args.arm:
        name, knobs = parse_arm(text)
        start = time.perf_counter()
        model = quantize_int4(fp32_text, **knobs)
        finish(model)
        for old in work.glob("text.arm.onnx*"):
            old.unlink()
        save_graph(model, work, "text.arm.onnx", external=True)
        del model
        made = time.perf_counter() - start
        got, seconds = run_graph(work / "text.arm.onnx", feeds)
        query_seconds = sum(t for t, q in zip(seconds, is_query) if q)
        size = sum(p.stat().st_size for p in work.glob("text.arm.onnx*"))
        arms[name] = {
            "spec": text,
            "knobs": {k: list(v) if isinstance(v, tuple) else v for k, v in knobs.items()},
            **figures(items, got, want),
            "text_bytes": size,
            "query_seconds": round(query_seconds, 2),
            "made_seconds": round(made, 1),
        }
        row = arms[name]
        print(
            f"{name}: mean {row['mean']:.5f} min {row['min']:.5f} worst bucket mean "
            f"{row['bucket_means_min']:.5f} size {size / 1e9:.3f} GB queries "
            f"{query_seconds:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        report(args, info, arms, fp32_bytes, fp32_query_seconds)
    for old in work.glob("text.arm.onnx*"):
        old.unlink()

    print(report(args, info, arms, fp32_bytes, fp32_query_seconds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
