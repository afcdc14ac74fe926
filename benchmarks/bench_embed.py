"""Embedding benchmark: torch reference vs every colembed variant, side by side, same threads.

    python benchmarks/bench_embed.py --quick                 # 2+2 layers, few repeats (< 10 min)
    python benchmarks/bench_embed.py                         # 4+4 layers (default)
    python benchmarks/bench_embed.py --vision-depth 32 --text-layers 28   # the real depth
    python benchmarks/bench_embed.py --family colqwen2.5 --quick      # ColQwen2.5, 2+2 layers

What it does, in one run:
1. builds a random-weight checkpoint of the `--family` with its published model's widths, heads and
   vocabulary at the requested depth (colqwen2: Qwen2-VL-2B, export/tiny.py preset "qwen2-vl-2b";
   colqwen2.5: Qwen2.5-VL-3B, export/tiny_qwen2_5.py preset "qwen2.5-vl-3b", both attention kinds
   kept, benchmarks/benchmark_specs.py) and exports it with `--variants` (cached in `--workdir`,
   keyed by family and depth);
2. measures the machine's fp32 GEMM peak (numpy sgemm) and int8 matmul peak (onnxruntime
   MatMulInteger, u8 x s8) with the same threads;
3. runs each runtime in its own subprocess (so peak RSS is its own): the torch reference
   (transformers 4.57.1 `ColQwen2ForRetrieval`, eager, fp32; for ColQwen2.5 over the
   Qwen2.5-VL config with the `get_dtype` shim) and colembed fp32 + each variant:
   load (time, peak RSS), a letter page at 150 dpi (744 image tokens) and at a 256-token budget
   (pages/s), query latency at batch 1 (median, p90), queries/s at batch 16, peak RSS of
   embedding; then the variant's embeddings of a synthetic retrieval set (100 pages, 20 queries)
   for the accuracy figures against colembed fp32;
4. inspects onnxruntime's transformer optimiser on the fp32 graphs (which fusions fire, op counts
   before/after, graph time before/after); with `--profile`, where one letter page's time goes per
   colembed runtime (onnxruntime's profiler) and the int8 bound: the page's x torch if every
   quantised GEMM ran at the int8 peak;
5. writes `benchmarks/results/embed.json` and `embed.md` (`embed-colqwen2_5.*` for ColQwen2.5;
   machine, versions, command, date), with the targets fp32 >= torch per page, int8 >= 2.5x.

FLOP/s are counted from the architecture and shapes (benchmarks/flops.py): useful work only (real
tokens, no padding). Everything is end to end (preprocessing included) except the optimiser's
graph timings. Random weights lack the outliers of trained weights: the accuracy figures are
necessary, not sufficient.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from flops import Shapes, page_flops, text_flops  # noqa: E402
from machine import machine_info, markdown_header, rss_mib  # noqa: E402

from colembed.layout import MANIFEST_NAME, TOKENIZER_FILE  # noqa: E402
from colembed.sessions import Session, physical_cores  # noqa: E402

WIDTHS = {"colqwen2": "Qwen2-VL-2B", "colqwen2.5": "Qwen2.5-VL-3B"}
RESULT_STEMS = {"colqwen2": "embed", "colqwen2.5": "embed-colqwen2_5"}
LETTER_150DPI = (1275, 1650)  # width, height in pixels: 8.5 x 11 in at 150 dpi
BUDGET_TOKENS = 256
QUERIES = [
    "What was the total revenue in the third quarter?",
    "Which region reported the highest growth?",
    "operating margin 2023",
    "Who signed the audit report?",
    "List the risks related to currency exchange rates",
    "How many employees work in research and development?",
    "capital expenditure forecast",
    "What is the dividend per share?",
    "Describe the supply chain disruptions mentioned in the report",
    "net income",
    "Where is the company headquartered?",
    "What does the chart on page two show?",
    "energy consumption per unit of output",
    "Which subsidiaries were sold during the year?",
    "What are the main product lines?",
    "tax rate reconciliation",
    "When does the credit facility mature?",
    "How did inventory levels change?",
    "customer concentration risk",
    "What accounting standards were adopted?",
]


# ------------------------------------------------------------------------------------ inputs
def letter_page():
    """A letter-size page at 150 dpi with lines of text and a chart, deterministic."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(7)
    width, height = LETTER_150DPI
    page = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(page)
    draw.text((90, 80), "Annual report 2023 - consolidated results", fill="black")
    for row in range(60):
        y = 140 + row * 22
        words = " ".join(rng.choice(QUERIES[row % len(QUERIES)].split(), 6))
        draw.text((90, y), words, fill=(30, 30, 30))
    for bar in range(8):
        h = int(rng.integers(40, 300))
        draw.rectangle([700 + bar * 55, 1500 - h, 740 + bar * 55, 1500], fill=(40, 90, 160))
    return page


def image_tokens(page, config) -> int:
    """Image tokens of a page under the model's own bound (`config`: its PreprocessConfig;
    ColQwen2 was trained with at most 768)."""
    from colembed.preprocess.images import smart_resize

    f = config.resize_factor
    h, w = smart_resize(page.height, page.width, factor=f, min_pixels=config.min_pixels,
                        max_pixels=config.max_pixels)
    return (h // f) * (w // f)


def budget_page(page, tokens: int, config):
    """The page resized as a `tokens` budget resizes it (`config.with_max_image_tokens(tokens)`),
    so a model with its default bound processes exactly the budgeted grid."""
    from PIL import Image

    from colembed.preprocess.images import smart_resize

    budget = config.with_max_image_tokens(tokens)
    h, w = smart_resize(page.height, page.width, factor=budget.resize_factor,
                        min_pixels=budget.min_pixels, max_pixels=budget.max_pixels)
    return page.resize((w, h), Image.BICUBIC)


# ------------------------------------------------------------------------------------ peaks
def gemm_peaks(threads: int, size: int = 3072, repeats: int = 7) -> dict[str, Any]:
    """fp32 GEMM peak (numpy sgemm) and int8 matmul peak (onnxruntime MatMulInteger u8 x s8)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    fp32 = 2 * size**3 / best

    weight = rng.integers(-127, 128, (size, size), dtype=np.int8)
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "w"], ["y"])], "int8peak",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, ["m", size])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, ["m", size])],
        [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    session = Session(model.SerializeToString(), threads=threads)
    activations = rng.integers(0, 256, (size, size), dtype=np.uint8)
    session.run({"a": activations})
    best8 = min(_timed(lambda: session.run({"a": activations})) for _ in range(repeats))
    return {"size": size, "threads": threads, "fp32_gflops": fp32 / 1e9,
            "int8_gops": 2 * size**3 / best8 / 1e9,
            "fp32_how": f"numpy {np.__version__} float32 {size}^3 matmul, best of {repeats}",
            "int8_how": f"onnxruntime MatMulInteger u8 x s8 {size}^3, best of {repeats}"}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ------------------------------------------------------------------------------------ workers
class TorchRuntime:
    """transformers 4.57.1 ColQwen2ForRetrieval, eager attention, fp32: the reference (made
    runnable for its family by the exporter's own declaration: ColQwen2.5's `get_dtype` shim)."""

    def __init__(self, checkpoint: str, threads: int, family: str = "colqwen2") -> None:
        import torch
        from transformers import ColQwen2ForRetrieval, ColQwen2Processor

        from colembed_export.families import export_family

        torch.set_num_threads(threads)
        self.torch = torch
        self.processor = ColQwen2Processor.from_pretrained(checkpoint, use_fast=False)
        self.model = export_family(family).prepare_reference(ColQwen2ForRetrieval.from_pretrained(
            checkpoint, dtype=torch.float32, attn_implementation="eager").eval())

    def _rows(self, batch) -> list:
        with self.torch.no_grad():
            out = self.model(**batch).embeddings
        return [out[i][batch["attention_mask"][i] == 1].numpy() for i in range(out.shape[0])]

    def embed_images(self, images, batch_size=4):
        return [row for i in range(0, len(images), batch_size)
                for row in self._rows(self.processor.process_images(images[i:i + batch_size]))]

    def embed_queries(self, texts, batch_size=16):
        return [row for i in range(0, len(texts), batch_size)
                for row in self._rows(self.processor.process_queries(texts[i:i + batch_size]))]


def run_worker(job: dict[str, Any]) -> dict[str, Any]:
    """One runtime in this process: load, time, embed; returns figures (and saves embeddings)."""
    import numpy as np

    base = rss_mib()
    start = time.perf_counter()
    if job["runtime"] == "torch":
        from colembed_export.preprocess_config import read_preprocess_config

        model = TorchRuntime(job["checkpoint"], job["threads"], job.get("family", "colqwen2"))
        config = read_preprocess_config(Path(job["checkpoint"]))
    else:
        import colembed

        model = colembed.load(job["folder"], variant=job["variant"], threads=job["threads"],
                              cpu_mem_arena=job.get("cpu_mem_arena", True))
        config = model.config
    load_s = time.perf_counter() - start
    after_load = rss_mib()
    page = letter_page()
    small = budget_page(page, BUDGET_TOKENS, config)
    result: dict[str, Any] = {"load_s": load_s, "rss_base_mib": base["rss"],
                              "rss_after_load_mib": after_load["rss"],
                              "peak_rss_load_mib": after_load["peak"]}

    def timed_runs(fn, repeats):
        fn()  # warm-up: first-run allocations, kernel selection
        return [_timed(fn) for _ in range(repeats)]

    letter = model.embed_images([page])
    result["letter_rows"] = int(letter[0].shape[0])
    result["letter_image_tokens"] = image_tokens(page, config)
    result["budget_image_tokens"] = image_tokens(small, config)
    times = timed_runs(lambda: model.embed_images([page]), job["page_repeats"])
    result["page_s"] = {"median": statistics.median(times), "min": min(times), "all": times}
    budget = model.embed_images([small])
    result["budget_rows"] = int(budget[0].shape[0])
    times = timed_runs(lambda: model.embed_images([small]), job["page_repeats"])
    result["budget_page_s"] = {"median": statistics.median(times), "min": min(times), "all": times}

    queries = QUERIES[:16]
    model.embed_queries(queries[:1])
    latencies = [_timed(lambda q=q: model.embed_queries([q])) for q in
                 (QUERIES * 4)[:job["query_repeats"]]]
    result["query_latency_s"] = {"median": statistics.median(latencies),
                                 "p90": float(np.percentile(latencies, 90)), "min": min(latencies)}
    query_rows = model.embed_queries(queries, batch_size=16)
    result["query_rows"] = [int(q.shape[0]) for q in query_rows]
    times = timed_runs(lambda: model.embed_queries(queries, batch_size=16), job["batch_repeats"])
    result["batch16_s"] = {"median": statistics.median(times), "min": min(times)}
    result["peak_rss_embed_mib"] = rss_mib()["peak"]
    if job.get("profile") and job["runtime"] == "colembed":
        result["profile"] = page_profile(model, page, job["threads"])

    if job.get("embeddings_out"):
        from retrieval import synthetic_retrieval_set

        pages, texts = synthetic_retrieval_set(job["retrieval_pages"], 20)
        retrieval_pages = model.embed_images(pages, batch_size=8)
        retrieval_queries = model.embed_queries(texts)
        np.savez(job["embeddings_out"],
                 **{"letter": letter[0], **{f"q{i}": q for i, q in enumerate(query_rows)},
                    **{f"rp{i}": p for i, p in enumerate(retrieval_pages)},
                    **{f"rq{i}": q for i, q in enumerate(retrieval_queries)}})
    return result


# Op types of the quantised weight-GEMMs (the quantisation of their input included): everything
# else in a variant's graphs (attention, softmax, norms, rotary, activations, layout) is fp32.
QUANTISED_GEMM_OPS = frozenset({"DynamicQuantizeMatMul", "MatMulIntegerToFloat",
                                "DynamicQuantizeLinear", "MatMulInteger", "MatMulNBits"})


def page_profile(model, page, threads: int) -> dict[str, Any]:
    """Where one page's time goes: host work (preprocessing, Python) and, per graph, onnxruntime's
    kernel time by op type (its profiler, on the feeds the runtime made for `page`)."""
    import tempfile

    from colembed.sessions import Session

    feeds: dict[str, dict[str, Any]] = {}
    graph_s: dict[str, float] = {}
    sessions = model._sessions  # the benchmark looks inside the runtime; users never need to

    def spy(role, run):
        def timed(inputs, run_options=None):
            start = time.perf_counter()
            try:
                return run(inputs, run_options)
            finally:
                graph_s[role] = graph_s.get(role, 0.0) + time.perf_counter() - start
                feeds.setdefault(role, dict(inputs))
        return timed

    for role, session in sessions.items():
        session.run = spy(role, session.run)
    try:
        page_s = _timed(lambda: model.embed_images([page]))
    finally:
        for session in sessions.values():
            del session.run  # back to the class's method
    out: dict[str, Any] = {"page_s": page_s, "host_s": page_s - sum(graph_s.values()),
                           "graph_s": graph_s, "kernels": {},
                           # the peaks beside the profiled runs: on a shared machine the bound
                           # then compares kernel times and peaks taken under the same load
                           "peaks": gemm_peaks(threads, repeats=3)}
    with tempfile.TemporaryDirectory(prefix="colembed-profile-") as tmp:
        for role in feeds:
            path = model.folder / model.manifest.graph(model.variant, role).file
            session = Session(path, threads=threads, profile_prefix=str(Path(tmp) / role))
            session.run(feeds[role])  # warm-up, excluded below
            session.run(feeds[role])
            out["kernels"][role] = _last_run_kernels(Path(session.session.end_profiling()))
            del session
    return out


def _last_run_kernels(profile: Path) -> dict[str, Any]:
    """{"run_s": the last run's wall time, "by_op": {op type: kernel seconds}} from a profile."""
    events = json.loads(profile.read_text())
    run = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"][-1]
    by_op: dict[str, float] = {}
    for e in events:
        if (e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
                and run["ts"] <= e["ts"] <= run["ts"] + run["dur"]):
            op = e["args"]["op_name"]
            by_op[op] = by_op.get(op, 0.0) + e["dur"] / 1e6
    return {"run_s": run["dur"] / 1e6, "by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1]))}


def _subprocess(job: dict[str, Any], timeout: float) -> dict[str, Any]:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}


# ------------------------------------------------------------------------------ optimiser
def optimiser_report(folder: Path, threads: int, page_tokens: int) -> dict[str, Any]:
    """onnxruntime.transformers.optimizer on the fp32 graphs: fusions, op counts, graph time."""
    import collections
    import logging
    import tempfile

    import numpy as np
    import onnx
    from onnxruntime.transformers import optimizer

    from colembed.contracts import colqwen2_contracts
    from colembed.preprocess.config import PreprocessConfig

    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    arch = manifest["architecture"]
    config = PreprocessConfig.from_dict(manifest["preprocess"])
    contracts = colqwen2_contracts(patch_dim=config.patch_dim,
                                   vision_head_dim=config.vision_head_dim,
                                   text_hidden=arch["text_hidden"],
                                   embedding_dim=manifest["embedding_dim"])
    rng = np.random.default_rng(0)
    report: dict[str, Any] = {}
    patches = page_tokens * config.merge_size**2
    tokens = page_tokens + 20
    index = np.zeros((1, tokens), np.int64)
    index[0, 5:5 + page_tokens] = np.arange(1, page_tokens + 1)
    feeds = {
        "vision": contracts["vision"].feeds(
            rng.standard_normal((1, patches, config.patch_dim), dtype=np.float32),
            np.ones((patches, config.vision_head_dim), np.float32),
            np.zeros((patches, config.vision_head_dim), np.float32)),
        "text": contracts["text"].feeds(
            np.full((1, tokens), config.pad_token_id, np.int64),
            np.ones((1, tokens), np.int64),
            np.broadcast_to(np.arange(tokens), (3, 1, tokens)).copy(),
            index,
            rng.standard_normal((page_tokens, arch["text_hidden"]), dtype=np.float32)),
    }
    model_types = {"vision": "clip", "text": "bert"}  # the fusion sets that match our patterns
    with tempfile.TemporaryDirectory(prefix="colembed-opt-") as tmp:
        for role in ("vision", "text"):
            src = folder / manifest["variants"]["fp32"][role]["file"]
            before = collections.Counter(n.op_type for n in
                                         onnx.load(str(src), load_external_data=False).graph.node)
            opt_path = Path(tmp) / f"{role}.opt.onnx"
            session_path = Path(tmp) / f"{role}.ort-all.onnx"
            optimised = optimizer.optimize_model(
                str(src), model_type=model_types[role], num_heads=0, hidden_size=0, opt_level=0,
                use_gpu=False)
            fused = {k: v for k, v in optimised.get_fused_operator_statistics().items() if v}
            optimised.save_model_to_file(str(opt_path), use_external_data_format=True)
            after = collections.Counter(n.op_type for n in optimised.model.graph.node)
            del optimised
            timing = {}
            for label, path in (("exported", src), ("transformer_optimiser", opt_path)):
                session = Session(path, threads=threads,
                                  save_optimized=session_path if label == "exported" else None)
                session.run(feeds[role])
                timing[label] = min(_timed(lambda: session.run(feeds[role])) for _ in range(3))
                del session
            in_session = collections.Counter(
                n.op_type for n in onnx.load(str(session_path), load_external_data=False).graph.node)
            report[role] = {
                "model_type": model_types[role],
                "fusions": fused,
                "op_counts_exported": dict(before),
                "op_delta_transformer_optimiser": _delta(before, after),
                "op_delta_ort_session_all": _delta(before, in_session),
                "graph_s": timing,
                "tokens": page_tokens,
            }
    return report


def _delta(before, after) -> dict[str, int]:
    return {k: after[k] - before[k] for k in sorted(set(before) | set(after)) if after[k] != before[k]}


# --------------------------------------------------------------------------------- driver
def prepare_model(args, work: Path, progress, *, stress: bool = False) -> tuple[Path, Path, Any]:
    """Build (once) and export the benchmark checkpoint: random weights, or with `stress` the
    stress checkpoint (trained-model activation traits, export/tiny.py) at the same widths."""
    from benchmark_specs import FAMILY_PRESETS, build, reduced_spec

    spec = reduced_spec(args.family, FAMILY_PRESETS[args.family], args.vision_depth,
                        args.text_layers)
    size = {"colqwen2": "2b", "colqwen2.5": "2.5-3b"}[args.family]
    tag = f"{'stress-' if stress else ''}{size}-v{args.vision_depth}-t{args.text_layers}"
    ckpt = work / f"ckpt-{tag}"
    if not (ckpt / "colembed_tiny.json").is_file():
        progress(f"building the {'stress' if stress else 'random-weight'} checkpoint {tag}")
        build(args.family, ckpt, spec, stress=stress)
    folder = work / f"model-{tag}"
    wanted = set(args.variants)
    have = set()
    if (folder / MANIFEST_NAME).is_file():
        have = set(json.loads((folder / MANIFEST_NAME).read_text())["variants"])
    if not wanted <= have:
        from colembed_export.exporter import export_model

        from colembed.errors import ExportError

        variants = sorted(wanted - {"fp32", INT8_BASELINE})
        while True:
            progress(f"exporting {tag} with variants {variants}")
            start = time.perf_counter()
            try:
                export_model(ckpt, folder, overwrite=True, variants=variants, progress=progress)
            except ExportError as e:
                # A variant that misses its accuracy gate is a result, not a crash: record it
                # and benchmark the others.
                missed = [v for v in variants if f"\n  {v}: " in str(e)]
                if not missed:
                    raise
                progress(f"gate missed, benchmarking without {missed}: {e}")
                GATE_MISSES.update({f"{v}{' (stress)' if stress else ''}": str(e) for v in missed})
                variants = [v for v in variants if v not in missed]
                continue
            progress(f"export took {time.perf_counter() - start:.0f} s")
            break
        if not stress:
            args.variants = [v for v in args.variants if v not in GATE_MISSES]
    return ckpt, folder, spec


INT8_BASELINE = "int8-plain"  # the int8 recipe without outlier smoothing, for the speed comparison


def add_int8_baseline(folder: Path, progress) -> None:
    """Write the plain int8 recipe (per-channel dynamic, no smoothing) beside the folder's
    variants as `int8-plain`, so one run times both recipes on the same machine state."""
    import tempfile

    from colembed.integrity import describe_file
    from colembed.manifest import MANIFEST_NAME
    from colembed_export.graph_edits import finish
    from colembed_export.recipes import quantize_int8
    from colembed_export.variants import save_graph

    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    if INT8_BASELINE in manifest["variants"]:
        return
    progress("writing the plain int8 baseline")
    entries = {}
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        for role, fp32 in manifest["variants"]["fp32"].items():
            model = quantize_int8(folder / fp32["file"], Path(tmp), calibration=None)
            finish(model)
            file, data = save_graph(model, folder, f"{role}.{INT8_BASELINE}.onnx",
                                    external=fp32["data_file"] is not None)
            entries[role] = {**fp32, "file": file, "data_file": data}
            for name in (file, data):
                if name:
                    manifest["files"][name] = describe_file(folder / name)
    manifest["variants"][INT8_BASELINE] = entries
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1))


def gate_figures(folders: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """The exporter's gate figures per variant, per checkpoint (random weights, stress)."""
    out: dict[str, dict[str, Any]] = {}
    for label, folder in folders.items():
        checks = json.loads((folder / "colembed_manifest.json").read_text())["checks"]
        for name, figures in checks.items():
            if name != "fp32" and "mean_cosine" in figures:
                out.setdefault(name, {})[label] = {k: figures.get(k) for k in (
                    "mean_cosine", "min_cosine", "finite", "ranking", "gate", "tokens",
                    "non_finite_tokens", "fp16_gemm_peak", "fp16_gemm_peak_at", "fp16_kept_fp32")}
    return out


GATE_MISSES: dict[str, str] = {}  # variant -> the exporter's message, when a gate was missed


def folder_bytes(folder: Path, variant: str) -> int:
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    files = {f for g in manifest["variants"][variant].values() for f in (g["file"], g["data_file"]) if f}
    return sum((folder / f).stat().st_size for f in files | {TOKENIZER_FILE})


def derive(rows: dict[str, dict], shapes: Shapes, peaks: dict, folder: Path,
           checkpoint: Path) -> None:
    """Add FLOP/s, peak fractions, speed-ups and memory ratios to each runtime's figures."""
    torch_row = rows.get("torch", {})
    for name, r in rows.items():
        if "error" in r:
            continue
        page = page_flops(shapes, r["letter_image_tokens"], r["letter_rows"])
        r["pages_per_s"] = 1 / r["page_s"]["median"]
        r["budget_pages_per_s"] = 1 / r["budget_page_s"]["median"]
        r["queries_per_s_batch16"] = 16 / r["batch16_s"]["median"]
        r["page_gflops"] = page["total"] / r["page_s"]["median"] / 1e9
        r["page_flops"] = page
        r["page_fraction_fp32_peak"] = r["page_gflops"] / peaks["fp32_gflops"]
        r["page_fraction_int8_peak"] = r["page_gflops"] / peaks["int8_gops"]
        query_flops = sum(text_flops(shapes, n) for n in r["query_rows"])
        r["batch16_gflops"] = query_flops / r["batch16_s"]["median"] / 1e9
        r["load_peak_over_base_mib"] = r["peak_rss_load_mib"] - r["rss_base_mib"]
        size = (folder_bytes(folder, r["variant"]) if r["runtime"] == "colembed"
                else sum(p.stat().st_size for p in checkpoint.glob("*.safetensors")))
        r["files_mib"] = size / 2**20
        r["load_rss_over_files"] = r["load_peak_over_base_mib"] / r["files_mib"]
        if torch_row and "error" not in torch_row and name != "torch":
            r["speedup_vs_torch"] = {
                "pages": r["pages_per_s"] / torch_row["pages_per_s"],
                "budget_pages": r["budget_pages_per_s"] / torch_row["budget_pages_per_s"],
                "query_latency": torch_row["query_latency_s"]["median"]
                / r["query_latency_s"]["median"],
                "batch16": r["queries_per_s_batch16"] / torch_row["queries_per_s_batch16"],
            }
        split = time_split(r, peaks)
        if split:
            r["time_split"] = split


def time_split(r: dict[str, Any], peaks: dict[str, Any]) -> dict[str, Any] | None:
    """Where a profiled page's time went, and the int8 bound: the page's x torch if every
    quantised GEMM ran at the measured int8 peak and everything else took what it took (the fp32
    kernels, the runtime between kernels, host preprocessing). A target above the bound cannot be
    met by faster GEMMs; only the rest can move it."""
    prof = r.get("profile")
    if not prof:
        return None
    kernels = list(prof["kernels"].values())
    graphs = sum(k["run_s"] for k in kernels)
    by_op: dict[str, float] = {}
    for k in kernels:
        for op, seconds in k["by_op"].items():
            by_op[op] = by_op.get(op, 0.0) + seconds
    quantised = sum(v for op, v in by_op.items() if op in QUANTISED_GEMM_OPS)
    fp32_ops = {op: v for op, v in by_op.items() if op not in QUANTISED_GEMM_OPS}
    page = prof["host_s"] + graphs
    split = {"page_s": page, "host_s": prof["host_s"], "graphs_s": graphs,
             "quantised_gemm_s": quantised, "fp32_kernels_s": sum(fp32_ops.values()),
             "between_kernels_s": graphs - sum(by_op.values()),
             "fp32_by_op": dict(sorted(fp32_ops.items(), key=lambda kv: -kv[1]))}
    if quantised:
        near = prof.get("peaks", peaks)
        int8_peak, fp32_peak = near["int8_gops"] * 1e9, near["fp32_gflops"] * 1e9
        gemm_ops, attention = r["page_flops"]["weight_gemms"], r["page_flops"]["attention"]
        split["quantised_gemm_fraction_int8_peak"] = gemm_ops / quantised / int8_peak
        split["bound_page_fraction"] = (page - quantised + gemm_ops / int8_peak) / page
        # no cost but the matrix products, each at its peak: what no kernel work can beat
        split["light_page_fraction"] = (gemm_ops / int8_peak + attention / fp32_peak) / page
        pages = r.get("speedup_vs_torch", {}).get("pages")
        if pages:
            split["bound_x_torch"] = pages / split["bound_page_fraction"]
            split["light_x_torch"] = pages / split["light_page_fraction"]
    return split


def accuracy(work: Path, names: list[str]) -> dict[str, Any]:
    """Each variant's embeddings vs colembed fp32's (and fp32 vs torch on the letter page)."""
    import numpy as np

    from colembed_export.evaluation import cosine_figures
    from retrieval import maxsim_scores, topk_agreement

    def load(name):
        path = work / f"emb-{name}.npz"
        if not path.is_file():
            return None
        data = np.load(path)
        group = lambda prefix: [data[k] for k in sorted((k for k in data.files  # noqa: E731
                                                         if k.startswith(prefix) and k[len(prefix):].isdigit()),
                                                        key=lambda k: int(k[len(prefix):]))]
        return {"letter": data["letter"], "q": group("q"), "rp": group("rp"), "rq": group("rq")}

    ref = load("fp32")
    out: dict[str, Any] = {}
    if ref is None:
        return out
    fp32_scores = maxsim_scores(ref["rq"], ref["rp"])
    for name in names:
        got = load(name)
        if got is None:
            continue
        figures = cosine_figures([got["letter"], *got["rp"]], [ref["letter"], *ref["rp"]],
                                 got["q"] + got["rq"], ref["q"] + ref["rq"])
        figures["top5"] = topk_agreement(maxsim_scores(got["rq"], got["rp"]), fp32_scores, k=5,
                                         tie=0.005)
        out[name] = figures
    return out


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(results: dict[str, Any]) -> str:
    rows, peaks, m = results["runtimes"], results["peaks"], results["machine"]
    s = results["setting"]
    lines = [
        f"# Embedding benchmark ({s['vision_depth']} vision + {s['text_layers']} language layers, "
        f"{s['model']})",
        "",
        markdown_header(m),
        f"- threads: {s['threads']} (intra-op = physical cores); fp32 GEMM peak "
        f"{peaks['fp32_gflops']:.0f} GFLOP/s ({peaks['fp32_how']}); int8 peak "
        f"{peaks['int8_gops']:.0f} GOP/s ({peaks['int8_how']})",
        f"- page: letter at 150 dpi ({LETTER_150DPI[0]}x{LETTER_150DPI[1]} px -> 744 image tokens) "
        f"and the same page at a {BUDGET_TOKENS}-token budget; batch 1, end to end "
        "(preprocessing included); medians",
        "",
        "| runtime | pages/s 744 tok | pages/s 256 tok | query p50 ms | query p90 ms | "
        "queries/s @16 | page GFLOP/s | % fp32 peak | % int8 peak | x torch pages | "
        "x torch q-latency | x torch q/s@16 | files MiB | load peak RSS MiB (x files) | "
        "embed peak RSS MiB | load s |",
        "|" + "---|" * 16,
    ]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:80]!r} |")
            continue
        sp = r.get("speedup_vs_torch", {})
        lines.append(
            f"| {name} | {fmt(r['pages_per_s'], '.3f')} | {fmt(r['budget_pages_per_s'], '.3f')} | "
            f"{r['query_latency_s']['median'] * 1e3:.0f} | {r['query_latency_s']['p90'] * 1e3:.0f} | "
            f"{r['queries_per_s_batch16']:.1f} | {r['page_gflops']:.0f} | "
            f"{100 * r['page_fraction_fp32_peak']:.0f}% | "
            f"{100 * r['page_fraction_int8_peak']:.0f}% | {fmt(sp.get('pages'))} | "
            f"{fmt(sp.get('query_latency'))} | {fmt(sp.get('batch16'))} | {r['files_mib']:.0f} | "
            f"{r['load_peak_over_base_mib']:.0f} ({r['load_rss_over_files']:.2f}x) | "
            f"{r['peak_rss_embed_mib']:.0f} | {r['load_s']:.1f} |")
    for name, message in results.get("gate_misses", {}).items():
        lines.append(f"| {name} | not written: export gate missed ({message.splitlines()[-1].strip()}) |")
    acc = results.get("accuracy", {})
    if acc:
        lines += ["", "Accuracy against colembed fp32 (letter page, 16 queries, 100-page synthetic "
                  "retrieval set with 20 queries; random weights: necessary, not sufficient)", "",
                  "| variant | mean token cosine | min token cosine | top-5 same set | "
                  "top-5 within 0.5% ties | gate |", "|---|---|---|---|---|---|"]
        from colembed_export.recipes import GATES

        for name, a in acc.items():
            # the fp16 peak is measured at export: judged in the exporter's gate table below
            gate = GATES.get(name) and dataclasses.replace(GATES[name], fp16_peak=None)
            ok = "-" if gate is None else ("pass" if not gate.misses(a) else "MISS")
            lines.append(f"| {name} | {a['mean_cosine']:.5f} | {a['min_cosine']:.5f} | "
                         f"{100 * a['top5']['same_set']:.0f}% | {100 * a['top5']['within_ties']:.0f}% "
                         f"| {ok} |")
    lines += target_markdown(rows)
    lines += split_markdown(rows)
    lines += gate_markdown(results.get("gates", {}))
    opt = results.get("optimiser")
    if opt and "error" not in opt:
        lines += ["", "onnxruntime transformer optimiser on the fp32 graphs "
                  f"({opt['vision']['tokens']} image tokens):", "",
                  "| graph | fusions fired | op delta (optimiser) | op delta (session level ALL) | "
                  "graph s exported -> optimised |", "|---|---|---|---|---|"]
        for role in ("vision", "text"):
            o = opt[role]
            lines.append(f"| {role} ({o['model_type']}) | {o['fusions']} | "
                         f"{o['op_delta_transformer_optimiser']} | {o['op_delta_ort_session_all']} | "
                         f"{o['graph_s']['exported']:.3f} -> "
                         f"{o['graph_s']['transformer_optimiser']:.3f} |")
    return "\n".join(lines) + "\n"


# Speed targets against the torch reference, per page (744 image tokens), in the same run.
TARGETS = {"fp32": 1.0, "int8": 2.5}


def target_markdown(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Each target variant's page speed-up over torch against its target."""
    lines = []
    for name, target in TARGETS.items():
        ratio = rows.get(name, {}).get("speedup_vs_torch", {}).get("pages")
        if ratio is not None:
            lines.append(f"{name} {ratio:.2f}x torch per page (target >= {target}x: "
                         f"{'met' if ratio >= target else 'MISSED'})")
    return ["", "Targets: " + "; ".join(lines)] if lines else []


def split_markdown(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The `--profile` table: one profiled letter page per variant, and the int8 bound."""
    split = {name: r["time_split"] for name, r in rows.items() if r.get("time_split")}
    if not split:
        return []
    lines = ["", "Where a letter page's time goes (`--profile`: onnxruntime's profiler on the page's "
             "own feeds, one run after a warm-up; seconds)", "",
             "| runtime | page | host (preprocessing, Python) | quantised GEMMs (% of int8 peak) | "
             "fp32 kernels: largest op types | between kernels | bound x torch | "
             "light x torch |",
             "|---|---|---|---|---|---|---|---|"]
    for name, t in split.items():
        top = ", ".join(f"{op} {v:.2f}" for op, v in list(t["fp32_by_op"].items())[:6])
        gemms = (f"{t['quantised_gemm_s']:.2f} ({100 * t['quantised_gemm_fraction_int8_peak']:.0f}%)"
                 if t["quantised_gemm_s"] else "-")
        lines.append(f"| {name} | {t['page_s']:.2f} | {t['host_s']:.2f} | {gemms} | "
                     f"{t['fp32_kernels_s']:.2f}: {top} | {t['between_kernels_s']:.2f} | "
                     f"{fmt(t.get('bound_x_torch'))} | {fmt(t.get('light_x_torch'))} |")
    lines += ["", "bound x torch: the page's x torch if every quantised GEMM ran at the int8 peak "
              "(measured beside the profile) and everything else took what it took here; light x "
              "torch: if the page cost nothing but its weight GEMMs at the int8 peak and its "
              "attention products at the fp32 peak."]
    return lines


def gate_markdown(gates: dict[str, dict[str, Any]]) -> list[str]:
    """The exporter's variant gates per checkpoint: per-token cosine to fp32 over its sample pages
    and queries, top-1 agreement on its clear-winner ranking set (colembed_export.evaluation)."""
    if not gates:
        return []
    labels = sorted({label for per in gates.values() for label in per}, key=lambda l: l != "random weights")
    lines = ["", "Variant gates as the exporter checked them (per-token cosine to fp32, mean / min; "
             "top-1 agreement on the clear-winner ranking set)", "",
             "| variant | " + " | ".join(f"{l}: mean / min cosine | {l}: top-1 | {l}: gate"
                                         for l in labels) + " |",
             "|---|" + "---|---|---|" * len(labels)]
    for name, per in gates.items():
        cells = []
        for label in labels:
            f = per.get(label)
            if f is None:
                cells += ["-", "-", "-"]
                continue
            from colembed_export.recipes import GATES

            ok = "pass" if not GATES[name].misses(f) else "MISS"
            cells += [f"{f['mean_cosine']:.5f} / {f['min_cosine']:.5f}",
                      f"{100 * f['ranking']['top1_agreement']:.0f}% of {f['ranking']['queries']}", ok]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=("colqwen2", "colqwen2.5"), default="colqwen2",
                        help="model family (widths of Qwen2-VL-2B or Qwen2.5-VL-3B)")
    parser.add_argument("--quick", action="store_true",
                        help="small setting: 2+2 layers, few repeats, 40 retrieval pages")
    parser.add_argument("--vision-depth", type=int, help="vision layers (real: 32; default 4)")
    parser.add_argument("--text-layers", type=int, help="language layers (real: 28; default 4)")
    parser.add_argument("--variants", default="fp32,int8,int4,fp16")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch reference")
    parser.add_argument("--no-optimiser", action="store_true", help="skip the optimiser report")
    parser.add_argument("--arena-off", action="store_true",
                        help="also run fp32 with the CPU memory arena off")
    parser.add_argument("--stress", action="store_true",
                        help="also export the stress checkpoint (trained-model activation traits) "
                             "at the same widths and depth and report its gate figures")
    parser.add_argument("--int8-baseline", action="store_true",
                        help="also time the plain int8 recipe (no outlier smoothing) in this run")
    parser.add_argument("--profile", action="store_true",
                        help="profile one letter page per colembed runtime: time by op type, "
                             "and the int8 bound (quantised GEMMs at the int8 peak)")
    parser.add_argument("--threads", type=int, help="intra-op threads (default: physical cores)")
    parser.add_argument("--workdir", type=Path, default=Path(os.environ.get(
        "COLEMBED_BENCH_DIR", Path.home() / ".cache" / "colembed-bench")))
    parser.add_argument("--out", type=Path, default=HERE / "results",
                        help="folder for embed.json / embed.md")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        try:
            result = run_worker(json.loads(args.worker))
        except Exception as e:  # reported in the table instead of killing the whole run
            result = {"error": f"{type(e).__name__}: {e}"}
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    started = time.perf_counter()
    info = machine_info()
    threads = args.threads or physical_cores()
    args.vision_depth = args.vision_depth or (2 if args.quick else 4)
    args.text_layers = args.text_layers or (2 if args.quick else 4)
    args.variants = ["fp32"] + [v for v in args.variants.split(",") if v and v != "fp32"]
    repeats = ({"page_repeats": 2, "query_repeats": 12, "batch_repeats": 2, "retrieval_pages": 100}
               if args.quick else
               {"page_repeats": 5, "query_repeats": 40, "batch_repeats": 5, "retrieval_pages": 100})
    work = args.workdir.expanduser()
    work.mkdir(parents=True, exist_ok=True)

    def progress(message: str) -> None:
        print(f"[bench {time.perf_counter() - started:6.0f}s] {message}", file=sys.stderr, flush=True)

    ckpt, folder, spec = prepare_model(args, work, progress)
    gate_folders = {"random weights": folder}
    if args.stress:
        gate_folders["stress"] = prepare_model(args, work, progress, stress=True)[1]
    if args.int8_baseline and "int8" in args.variants:
        add_int8_baseline(folder, progress)
    shapes = Shapes.from_manifest(json.loads((folder / MANIFEST_NAME).read_text()))
    shapes = dataclasses.replace(shapes, full_blocks=len(getattr(spec, "fullatt_block_indexes", ())))
    progress("measuring GEMM peaks")
    peaks = gemm_peaks(threads)
    progress(f"fp32 peak {peaks['fp32_gflops']:.0f} GFLOP/s, int8 peak {peaks['int8_gops']:.0f} GOP/s")

    jobs: dict[str, dict[str, Any]] = {}
    if not args.no_torch:
        jobs["torch"] = {"runtime": "torch", "variant": "torch", "checkpoint": str(ckpt),
                         "family": args.family}
    for variant in args.variants:
        jobs[variant] = {"runtime": "colembed", "variant": variant, "folder": str(folder),
                         "embeddings_out": str(work / f"emb-{variant}.npz")}
        if variant == "int8" and args.int8_baseline:
            jobs[INT8_BASELINE] = {"runtime": "colembed", "variant": INT8_BASELINE,
                                   "folder": str(folder)}
    if args.arena_off:
        jobs["fp32 (arena off)"] = {"runtime": "colembed", "variant": "fp32", "folder": str(folder),
                                    "cpu_mem_arena": False}
    rows: dict[str, dict[str, Any]] = {}
    for name, job in jobs.items():
        progress(f"running {name}")
        job.update(repeats, threads=threads, profile=args.profile)
        stale = job.get("embeddings_out")
        if stale and Path(stale).exists():
            Path(stale).unlink()
        rows[name] = _subprocess(job, timeout=3600) | {"runtime": job["runtime"],
                                                       "variant": job["variant"]}
        if "error" in rows[name]:
            progress(f"{name} failed: {rows[name]['error'][-300:]}")
        else:
            r = rows[name]
            progress(f"{name}: page {r['page_s']['median']:.2f} s, query "
                     f"{r['query_latency_s']['median'] * 1e3:.0f} ms, 16 queries "
                     f"{r['batch16_s']['median']:.2f} s")
    # Peaks again at the end: a busy machine understates a single measurement; keep the best.
    again = gemm_peaks(threads)
    peaks["fp32_gflops_runs"] = [peaks["fp32_gflops"], again["fp32_gflops"]]
    peaks["int8_gops_runs"] = [peaks["int8_gops"], again["int8_gops"]]
    peaks["fp32_gflops"] = max(peaks["fp32_gflops_runs"])
    peaks["int8_gops"] = max(peaks["int8_gops_runs"])
    derive(rows, shapes, peaks, folder, ckpt)
    results: dict[str, Any] = {
        "machine": info,
        "setting": {"vision_depth": args.vision_depth, "text_layers": args.text_layers,
                    "threads": threads, "quick": args.quick, "stress": args.stress, **repeats,
                    "family": args.family, "workdir": str(work),
                    "model": f"{WIDTHS[args.family]} widths, random weights"},
        "peaks": peaks,
        "runtimes": rows,
        "accuracy": accuracy(work, [v for v in args.variants if v != "fp32"]),
        "gate_misses": GATE_MISSES,
        "gates": gate_figures(gate_folders),
    }
    if not args.no_optimiser:
        progress("transformer optimiser report")
        try:
            results["optimiser"] = optimiser_report(folder, threads, page_tokens=744)
        except Exception as e:  # informative section; never fails the benchmark
            results["optimiser"] = {"error": f"{type(e).__name__}: {e}"}
    results["elapsed_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    stem = RESULT_STEMS[args.family]
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
    table = markdown(results)
    (args.out / f"{stem}.md").write_text(table)
    print(table)
    progress(f"wrote {args.out / stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
