"""Two ways to run the same graphs on OpenVINO, timed against onnxruntime's CPU provider.

    python -m benchmarks.openvino --folder MODEL [--ort-openvino-python PYTHON]

MODEL is an export with the `openvino` variant (the embed suite's workdir holds one after
`python -m benchmarks.embed --variants ...,openvino`). One letter page (150 dpi, 744 image tokens) and one query are run
through colembed's fp32 runtime once, recording what it feeds each graph; then each way runs those
very feeds in a process of its own (its own load, its own threads):

- `onnxruntime CPU`: the fp32 graphs as exported (the baseline, and the reference outputs);
- `OpenVINO runtime`: `Core.compile_model` on the `openvino` variant's files (what
  colembed/openvino_runtime.py does), f32 and bf16 inference precision; the load with an empty
  compiled-model cache and again from that cache;
- `onnxruntime-ep-openvino`: the plugin EP on the installed stock onnxruntime
  (`register_execution_provider_library`), when installed: which devices it offers here;
- `onnxruntime-openvino`: the legacy OpenVINO EP package, which replaces onnxruntime, so it runs in
  another environment's Python (`--ort-openvino-python`), on the same `openvino` files.

Per way: load seconds per graph, the median of `--repeats` runs per graph and feed (after a
warm-up), and the max abs difference of the outputs to onnxruntime fp32's. Writes
results/openvino/openvino-2b-2+2.{md,json} by default (`--out`: the path without extension).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.shared.common import (
    letter_page,
    load_average,
    machine_info,
    markdown_table,
    median_seconds,
    results_markdown,
    run_json_subprocess,
    write_results,
)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "openvino"

ROLES = ("vision", "text")


def record_feeds(folder: Path, out: Path) -> list[str]:
    """The fp32 runtime's feeds for a letter page (vision, text) and one query (text), saved as
    `out`/NAME.npz; returns the names."""
    import numpy as np

    import colembed

    model = colembed.load(folder, verify=False)
    recorded: dict[str, list[dict[str, Any]]] = {role: [] for role in ROLES}
    for role, session in model._sessions.items():

        def run(feeds, run_options=None, _run=session.run, _into=recorded[role]):
            _into.append(dict(feeds))
            return _run(feeds, run_options)

        session.run = run
    model.embed_images([letter_page()])
    model.embed_queries(["What was the total revenue in the third quarter?"])
    named = {
        "vision-page": recorded["vision"][0],
        "text-page": recorded["text"][0],
        "text-query": recorded["text"][1],
    }
    for name, feeds in named.items():
        np.savez(out / f"{name}.npz", **feeds)
    return list(named)


def _time(run, feeds, repeats: int) -> float:
    return median_seconds(lambda: run(feeds), repeats, warm_up=True)


def worker(job: dict[str, Any]) -> dict[str, Any]:
    """One way, in this process: load each graph, time each feed, compare to the reference."""
    import numpy as np

    folder, work, threads = Path(job["folder"]), Path(job["work"]), job["threads"]
    feeds = {name: dict(np.load(work / f"{name}.npz")) for name in job["feeds"]}
    files = job["files"]
    result: dict[str, Any] = {"load_s": {}, "run_s": {}, "max_abs_diff": {}}
    runners = {}
    for role in ROLES:
        start = time.perf_counter()
        runners[role] = _open(job["way"], folder / files[role], threads, job)
        result["load_s"][role] = time.perf_counter() - start
        if runners[role] is None:
            return {**result, "unavailable": job.get("why_unavailable")}
    for name, feed in feeds.items():
        run = runners[name.split("-")[0]]
        result["run_s"][name] = _time(run, feed, job["repeats"])
        out = run(feed)
        reference = work / f"reference-{name}.npy"
        if job["way"] == "onnxruntime CPU":
            np.save(reference, out)
        result["max_abs_diff"][name] = float(np.abs(out - np.load(reference)).max())
    return result


def _open(way: str, path: Path, threads: int, job: dict[str, Any]):
    """A callable feeds -> first output for `way` (None: the way offers no device here)."""
    if way == "onnxruntime CPU":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        return lambda feeds: session.run(None, feeds)[0]
    if way.startswith("OpenVINO runtime"):
        import openvino as ov

        config = {
            "INFERENCE_PRECISION_HINT": job["precision"],
            "INFERENCE_NUM_THREADS": threads,
            "PERFORMANCE_HINT": "LATENCY",
        }
        if job.get("cache_dir"):
            config["CACHE_DIR"] = job["cache_dir"]
        if "pinning" in job:
            config["ENABLE_CPU_PINNING"] = job["pinning"]
        compiled = ov.Core().compile_model(str(path), "CPU", config)
        job["precision_compiled"] = compiled.get_property(
            "INFERENCE_PRECISION_HINT"
        ).get_type_name()
        request = compiled.create_infer_request()
        return lambda feeds: request.infer(feeds)[compiled.outputs[0]].copy()
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    ov_options = {"device_type": "CPU", "precision": "FP32", "num_of_threads": str(threads)}
    if way == "onnxruntime-ep-openvino":
        import onnxruntime_ep_openvino as plugin

        ort.register_execution_provider_library(plugin.get_ep_name(), plugin.get_library_path())
        devices = [d for d in ort.get_ep_devices() if d.ep_name == plugin.get_ep_name()]
        if not devices:
            job["why_unavailable"] = (
                "the plugin offers no device on this machine (it registers "
                "Intel devices only: vendor id 0x8086)"
            )
            return None
        options.add_provider_for_devices(
            devices, {"precision": "FP32", "num_of_threads": str(threads)}
        )
        session = ort.InferenceSession(str(path), options)
    else:  # the legacy onnxruntime-openvino build
        session = ort.InferenceSession(
            str(path), options, providers=[("OpenVINOExecutionProvider", ov_options)]
        )
    if session.get_providers()[0] != "OpenVINOExecutionProvider":
        raise RuntimeError(f"{way}: got {session.get_providers()}")
    return lambda feeds: session.run(None, feeds)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path)
    parser.add_argument(
        "--ort-openvino-python",
        help="a Python with onnxruntime-openvino (and numpy) installed instead of onnxruntime",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS / "openvino-2b-2+2")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = worker(json.loads(args.worker))
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if args.folder is None:
        parser.error("--folder is required")
    from colembed.layout import BASE_VARIANT
    from colembed.manifest import read_manifest
    from colembed.sessions import physical_cores

    info = machine_info()
    threads = args.threads or physical_cores()
    manifest = read_manifest(args.folder)
    files = {v: {r: manifest.graph(v, r).file for r in ROLES} for v in (BASE_VARIANT, "openvino")}
    work = Path(tempfile.mkdtemp(prefix="openvino-paths-"))
    names = record_feeds(args.folder, work)
    cache = work / "cache"
    ways = [
        ("onnxruntime CPU", BASE_VARIANT, {}, sys.executable),
        ("OpenVINO runtime f32 (no cache)", "openvino", {"precision": "f32"}, sys.executable),
        (
            "OpenVINO runtime f32 (cache filled)",
            "openvino",
            {"precision": "f32", "cache_dir": str(cache)},
            sys.executable,
        ),
        (
            "OpenVINO runtime f32 (from the cache)",
            "openvino",
            {"precision": "f32", "cache_dir": str(cache)},
            sys.executable,
        ),
        (
            "OpenVINO runtime f32, threads not pinned",
            "openvino",
            {"precision": "f32", "pinning": False},
            sys.executable,
        ),
        ("OpenVINO runtime bf16", "openvino", {"precision": "bf16"}, sys.executable),
    ]
    try:
        import importlib.util

        if importlib.util.find_spec("onnxruntime_ep_openvino"):
            ways.append(("onnxruntime-ep-openvino", "openvino", {}, sys.executable))
    except ImportError:
        pass
    if args.ort_openvino_python:
        ways.append(("onnxruntime-openvino", "openvino", {}, args.ort_openvino_python))
    rows: dict[str, Any] = {}
    load_before = load_average()
    for label, variant, extra, python in ways:
        job = {
            "way": label,
            "folder": str(args.folder),
            "work": str(work),
            "feeds": names,
            "files": files[variant],
            "threads": threads,
            "repeats": args.repeats,
            **extra,
        }
        env = {"PYTHONPATH": str(REPO)} if python != sys.executable else None
        rows[label] = run_json_subprocess(
            [python, "-m", "benchmarks.openvino", "--worker", json.dumps(job)],
            timeout=3600,
            env=env,
            cwd=str(REPO),
        )
        print(f"{label}: {rows[label]}", file=sys.stderr, flush=True)
    load_after = load_average()
    base = rows["onnxruntime CPU"]["run_s"]
    table = []
    for label, row in rows.items():
        if "error" in row or row.get("unavailable"):
            table.append(
                [label, row.get("unavailable") or row.get("error", "")[-200:], "", "", "", "", ""]
            )
            continue
        run = row["run_s"]
        table.append(
            [
                label,
                f"{sum(row['load_s'].values()):.2f}",
                *(f"{run[n]:.3f} ({base[n] / run[n]:.2f}x)" for n in names),
                f"{max(row['max_abs_diff'].values()):.1e}",
                "",
            ]
        )
    arch = manifest.architecture
    body = [
        f"Model: `{args.folder.name}` ({arch.vision_depth} vision + {arch.text_layers} text "
        f"layers, text width {arch.text_hidden}), {threads} threads, median of {args.repeats} runs after a warm-up, each way in its own "
        f"process; load average before {load_before}, after {load_after}.",
        "",
        *markdown_table(
            [
                "way",
                "load s (both graphs)",
                *(f"{n} s (x onnxruntime)" for n in names),
                "max abs diff to onnxruntime fp32",
                "",
            ],
            table,
        ),
    ]
    write_results(
        args.out,
        results_markdown("OpenVINO: the runtime itself vs onnxruntime's OpenVINO EP", info, body),
        info,
        {
            "ways": rows,
            "threads": threads,
            "load_before": load_before,
            "load_after": load_after,
            "folder": str(args.folder),
        },
    )
    print("\n".join(body))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
