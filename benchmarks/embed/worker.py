"""bench_embed's per-runtime worker: one runtime (torch or a colembed variant) in this process.

`run_worker(job)` loads the runtime, times a letter page, a page at a token budget, single queries
and 16-query batches, records load time and peak RSS, optionally profiles one page
(`page_profile`) and saves the embeddings for the accuracy figures. `spawn(job)` runs it in a
fresh interpreter so that each runtime's peak RSS is its own. Also the machine's GEMM peaks
(`gemm_peaks`), measured with the same threads.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]  # the benchmarks folder

from benchmarks.shared.common import (  # noqa: E402
    BUDGET_TOKENS,
    QUERIES,
    budget_page,
    image_tokens,
    letter_page,
    rss_mib,
    run_json_subprocess,
    timed,
)

from colembed.sessions import Session  # noqa: E402

_timed = timed


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
        [helper.make_node("MatMulInteger", ["a", "w"], ["y"])],
        "int8peak",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, ["m", size])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, ["m", size])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    session = Session(model.SerializeToString(), threads=threads)
    activations = rng.integers(0, 256, (size, size), dtype=np.uint8)
    session.run({"a": activations})
    best8 = min(_timed(lambda: session.run({"a": activations})) for _ in range(repeats))
    return {
        "size": size,
        "threads": threads,
        "fp32_gflops": fp32 / 1e9,
        "int8_gops": 2 * size**3 / best8 / 1e9,
        "fp32_how": f"numpy {np.__version__} float32 {size}^3 matmul, best of {repeats}",
        "int8_how": f"onnxruntime MatMulInteger u8 x s8 {size}^3, best of {repeats}",
    }


def run_worker(job: dict[str, Any]) -> dict[str, Any]:
    """One runtime in this process: load, time, embed; returns figures (and saves embeddings)."""
    import numpy as np

    base = rss_mib()
    start = time.perf_counter()
    openvino = False  # the runtime is OpenVINO (an openvino* variant)
    if job["runtime"] == "torch":
        from benchmarks.embed.torch_reference import TorchRuntime

        from colembed_export.families.preprocess_config import read_preprocess_config

        model = TorchRuntime(
            job["checkpoint"],
            job["threads"],
            job.get("family", "colqwen2"),
            runtime=job.get("torch_runtime", "torch"),
        )
        config = read_preprocess_config(Path(job["checkpoint"]))
    else:
        import colembed
        from colembed.sessions import OPENVINO_VARIANTS

        # the OpenVINO variants run on OpenVINO (a compiled-model cache of the job's own, so the
        # load time is a first compile's)
        openvino = job["variant"] in OPENVINO_VARIANTS
        model = colembed.load(
            job["folder"],
            variant=job["variant"],
            threads=job["threads"],
            cpu_mem_arena=job.get("cpu_mem_arena", True),
            providers=[("openvino", {"cache_dir": ""})] if openvino else None,
        )
        config = model.config
    load_s = time.perf_counter() - start
    after_load = rss_mib()
    page = letter_page()
    small = budget_page(page, BUDGET_TOKENS, config)
    result: dict[str, Any] = {
        "load_s": load_s,
        "rss_base_mib": base["rss"],
        "rss_after_load_mib": after_load["rss"],
        "peak_rss_load_mib": after_load["peak"],
    }
    if openvino:
        # what OpenVINO compiled, not what was asked: a bf16 request compiles f32 on a CPU
        # without bf16 arithmetic
        result["openvino_compiled"] = {
            role: {
                "INFERENCE_PRECISION_HINT": session.precision,
                "EXECUTION_MODE_HINT": session.compiled.get_property("EXECUTION_MODE_HINT").name,
                "DYNAMIC_QUANTIZATION_GROUP_SIZE": int(
                    session.compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")
                ),
            }
            for role, session in model._sessions.items()
        }

    def timed_runs(fn, repeats):
        fn()  # warm-up: first-run allocations, kernel selection
        return [_timed(fn) for _ in range(repeats)]

    letter = model.embed_images([page])
    result["letter_rows"] = int(letter[0].shape[0])
    result["letter_image_tokens"] = image_tokens(page, config)
    result["budget_image_tokens"] = image_tokens(small, config)
    times = timed_runs(lambda: model.embed_images([page]), job["page_repeats"])
    result["page_s"] = {"median": statistics.median(times), "min": min(times), "all": times}
    if job.get("budget_page", True):
        budget = model.embed_images([small])
        result["budget_rows"] = int(budget[0].shape[0])
        times = timed_runs(lambda: model.embed_images([small]), job["page_repeats"])
        result["budget_page_s"] = {
            "median": statistics.median(times),
            "min": min(times),
            "all": times,
        }

    queries = QUERIES[:16]
    model.embed_queries(queries[:1])
    latencies = [
        _timed(lambda q=q: model.embed_queries([q])) for q in (QUERIES * 4)[: job["query_repeats"]]
    ]
    result["query_latency_s"] = {
        "all": latencies,
        "median": statistics.median(latencies),
        "p90": float(np.percentile(latencies, 90)),
        "min": min(latencies),
    }
    query_rows = model.embed_queries(queries, batch_size=16)
    result["query_rows"] = [int(q.shape[0]) for q in query_rows]
    times = timed_runs(lambda: model.embed_queries(queries, batch_size=16), job["batch_repeats"])
    result["batch16_s"] = {"median": statistics.median(times), "min": min(times)}
    result["peak_rss_embed_mib"] = rss_mib()["peak"]
    if job.get("profile") and job["runtime"] == "colembed":
        result["profile"] = page_profile(model, page, job["threads"])

    if job.get("embeddings_out"):
        from benchmarks.shared.retrieval import synthetic_retrieval_set

        retrieval_pages, retrieval_queries = [], []
        if job["retrieval_pages"]:
            pages, texts = synthetic_retrieval_set(job["retrieval_pages"], 20)
            retrieval_pages = model.embed_images(pages, batch_size=8)
            retrieval_queries = model.embed_queries(texts)
        np.savez(
            job["embeddings_out"],
            **{
                "letter": letter[0],
                **{f"q{i}": q for i, q in enumerate(query_rows)},
                **{f"rp{i}": p for i, p in enumerate(retrieval_pages)},
                **{f"rq{i}": q for i, q in enumerate(retrieval_queries)},
            },
        )
    return result


# Op types of the quantised weight-GEMMs (the quantisation of their input included): everything
# else in a variant's graphs (attention, softmax, norms, rotary, activations, layout) is fp32.
QUANTISED_GEMM_OPS = frozenset(
    {
        "DynamicQuantizeMatMul",
        "MatMulIntegerToFloat",
        "DynamicQuantizeLinear",
        "MatMulInteger",
        "MatMulNBits",
    }
)


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
    out: dict[str, Any] = {
        "page_s": page_s,
        "host_s": page_s - sum(graph_s.values()),
        "graph_s": graph_s,
        "kernels": {},
        # the peaks beside the profiled runs: on a shared machine the bound
        # then compares kernel times and peaks taken under the same load
        "peaks": gemm_peaks(threads, repeats=3),
    }
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
        if (
            e.get("cat") == "Node"
            and e["name"].endswith("_kernel_time")
            and run["ts"] <= e["ts"] <= run["ts"] + run["dur"]
        ):
            op = e["args"]["op_name"]
            by_op[op] = by_op.get(op, 0.0) + e["dur"] / 1e6
    return {"run_s": run["dur"] / 1e6, "by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1]))}


def spawn(job: dict[str, Any], timeout: float) -> dict[str, Any]:
    """`run_worker(job)` in a fresh interpreter (its own peak RSS): this Python, or for a torch
    job the one its family's reference runs in (`torch_reference.interpreter`: ColQwen3's pinned
    reference has its own environment)."""
    python = sys.executable
    if job["runtime"] == "torch":
        from benchmarks.embed.torch_reference import interpreter

        python = interpreter(job.get("family", "colqwen2"))
    return run_json_subprocess([python, "-m", __spec__.name, json.dumps(job)], timeout=timeout)


if __name__ == "__main__":
    try:
        answer = run_worker(json.loads(sys.argv[1]))
    except Exception as e:  # noqa: BLE001  (reported in the table; the run goes on)
        answer = {"error": f"{type(e).__name__}: {e}"}
    print("RESULT " + json.dumps(answer), flush=True)
