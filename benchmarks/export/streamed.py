"""Peak memory and time of the export with streamed graph weights against the whole-model path.

    nice python -m benchmarks.export.streamed                     # Qwen2-VL-2B, full depth
    nice python -m benchmarks.export.streamed --runs streamed-on  # one path: the default export
    python -m benchmarks.export.streamed --vision-depth 2 --text-layers 2 --results /tmp/s
    nice python -m benchmarks.export.streamed --runs streamed-on --variants int8,fp16 \
        --memory-cap 6 --results benchmarks/results/export/streamed-capped

The checkpoint is random, written tensor by tensor into safetensors shards
(`colembed_export.testing.sharded`: never in memory whole), in a work folder this script makes
(`--workdir`, reused by a later run, which also skips the exports already measured there:
`model-*.json`; `--clean` deletes it at the end). Each export runs in a
process of its own (`export_model` with `stream_weights` on or off, the check on or off), so each
process's peak is that export's alone: the largest of the exporter's per-step peaks (StepMeter: RSS
high-water mark reset at each step, and peak anonymous memory; the reset also resets `ru_maxrss`,
so `/usr/bin/time -v` would report only the last steps' peak). The two paths' graphs are
compared byte for byte (every `.onnx_data` file, and the `.onnx` files' initializers).

`--variants` adds the variant step (`colembed export --variant`); a variant refused by its gate is
a result (the folder is written without it), reported with the steps up to the refusal.
`--memory-cap GIB` runs each export in a cgroup-v1 memory cgroup limited to that many GiB, swap
off (Linux, as root, with the memory controller at /sys/fs/cgroup/memory): the kernel reclaims
file pages (mapped weights, page cache) to stay under the cap, anonymous memory it cannot, so an
export finishing under it holds at most the cap of what it cannot give back. The cgroup's peak
usage, failure count and OOM kills are recorded; the cgroup is removed after the export.

Writes benchmarks/results/export/streamed.{md,json} (`--results` elsewhere).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.shared.machine import load_average, machine_info, markdown_header
from colembed.layout import BASE_VARIANT

HERE = Path(__file__).resolve().parents[1]  # the benchmarks folder
RESULTS = HERE / "results" / "export" / "streamed"
CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")
# (stream_weights, check): the whole-model path first, as users have had it
RUNS = ((False, True), (True, True), (False, False), (True, False))
RUN_NAMES = {
    f"{'streamed' if stream else 'whole'}-{'on' if check else 'off'}": (stream, check)
    for stream, check in RUNS
}


def label(stream: bool, check: bool) -> str:
    return f"{'streamed' if stream else 'whole model'}, check {'on' if check else 'off'}"


def child(checkpoint: Path, out: Path, stream: bool, check: bool, variants: list[str]) -> dict:
    """One export in this process; its report as JSON-able data."""
    from colembed_export.pipeline.exporter import export_model
    from colembed_export.variants.write import VariantsRefused

    start = time.perf_counter()
    refused = None
    try:
        report = export_model(
            checkpoint,
            out,
            random_weights=True,
            overwrite=True,
            check=check,
            stream_weights=stream,
            variants=variants,
            progress=lambda m: print(f"[export] {m}", file=sys.stderr, flush=True),
        )
        steps, checks = report.steps, report.check
    except VariantsRefused as e:  # the folder is written without the refused variants
        steps, checks, refused = e.steps, e.checks, str(e)
    seconds = time.perf_counter() - start
    return {
        "stream_weights": stream,
        "check": check,
        "variants": variants,
        "seconds": round(seconds, 1),
        # the largest step peak: the exporter resets the kernel's mark at each step, which
        # resets ru_maxrss (and `/usr/bin/time -v`'s figure) too
        "process_peak_rss_gb": max(s["peak_rss_gb"] for s in steps),
        "steps": steps,
        "max_abs_diff": (checks.get(BASE_VARIANT) or {}).get("max_abs_diff"),
        "variant_checks": {
            name: {
                k: v for k, v in figures.items() if k == "misses" or not isinstance(v, (dict, list))
            }
            for name, figures in checks.items()
            if name != BASE_VARIANT
        },
        "refused": refused,
    }


@contextlib.contextmanager
def memory_cgroup(cap_gib: float):
    """A cgroup-v1 memory cgroup limited to `cap_gib` GiB, swap off; yields its folder and
    removes it on exit (its processes must have ended)."""
    if not (CGROUP_MEMORY / "cgroup.procs").is_file():
        raise SystemExit(f"--memory-cap needs the cgroup-v1 memory controller at {CGROUP_MEMORY}")
    folder = CGROUP_MEMORY / f"colembed-bench-{os.getpid()}"
    folder.mkdir()
    try:
        (folder / "memory.limit_in_bytes").write_text(str(int(cap_gib * (1 << 30))))
        (folder / "memory.swappiness").write_text("0")
        yield folder
    finally:
        folder.rmdir()


def cgroup_figures(folder: Path, cap_gib: float) -> dict:
    """What the cgroup saw: its limit, peak usage (file pages included), how often it hit the
    limit, and OOM kills (memory.oom_control's `oom_kill`, on kernels that count them)."""
    oom = dict(
        line.split()
        for line in (folder / "memory.oom_control").read_text().splitlines()
        if line.strip()
    )
    return {
        "cap_gib": cap_gib,
        "limit_bytes": int((folder / "memory.limit_in_bytes").read_text()),
        "max_usage_gb": round(int((folder / "memory.max_usage_in_bytes").read_text()) / 1e9, 3),
        "failcnt": int((folder / "memory.failcnt").read_text()),
        "oom_kill": int(oom["oom_kill"]) if "oom_kill" in oom else None,
        "under_oom": int(oom.get("under_oom", 0)),
    }


def run_child(
    checkpoint: Path,
    out: Path,
    stream: bool,
    check: bool,
    variants: list[str],
    memory_cap: float | None = None,
) -> dict:
    load = load_average()
    command = [
        sys.executable,
        "-m",
        "benchmarks.export.streamed",
        "--child",
        str(checkpoint),
        str(out),
        str(int(stream)),
        str(int(check)),
        ",".join(variants),
    ]
    with contextlib.ExitStack() as stack:
        cgroup = None if memory_cap is None else stack.enter_context(memory_cgroup(memory_cap))
        join = None
        if cgroup is not None:  # the child joins the cgroup before it runs Python

            def join() -> None:
                (cgroup / "cgroup.procs").write_text(str(os.getpid()))

        done = subprocess.run(
            command, stdout=subprocess.PIPE, text=True, preexec_fn=join, check=False
        )
        figures = None if cgroup is None else cgroup_figures(cgroup, memory_cap)
    if done.returncode != 0:
        raise SystemExit(f"the export failed (exit status {done.returncode}); cgroup: {figures}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["load_average_at_start"] = load
    result["cgroup"] = figures
    return result


def initializers(path: Path) -> dict[str, bytes]:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return {i.name: i.SerializeToString() for i in model.graph.initializer}


def same_bytes(a: Path, b: Path, chunk: int = 1 << 24) -> bool:
    """Two files equal byte for byte, read a chunk at a time (each may be several GB)."""
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(chunk), fb.read(chunk)
            if x != y:
                return False
            if not x:
                return True


def same_graphs(a: Path, b: Path) -> dict[str, bool]:
    """Per graph file: its external data byte for byte, its initializer records (names, shapes,
    offsets into the data) equal."""
    found = {}
    for path in sorted(a.glob("*.onnx_data")):
        found[path.name] = same_bytes(path, b / path.name)
    for name in ("vision.onnx", "text.onnx"):
        found[f"{name} initializers"] = initializers(a / name) == initializers(b / name)
    return found


def markdown(info: dict, results: list[dict], weights_gb: float, same: dict, arch: dict) -> str:
    lines = [
        "# Export with streamed graph weights: peak memory and time",
        "",
        markdown_header(info),
        "",
        f"Checkpoint: random weights written tensor by tensor into safetensors shards, "
        f"Qwen2-VL-2B widths, {arch['vision_depth']} vision blocks + {arch['text_layers']} "
        f"text layers, {weights_gb:.2f} GB of fp32 weights. Each export in a process of its own.",
        "",
        "| path | check | wall min | process peak RSS GB | largest step peak anon GB | "
        "check max abs diff | load at start |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        anon = max((s.get("peak_anon_gb") or 0) for s in r["steps"])
        lines.append(
            f"| {'streamed' if r['stream_weights'] else 'whole model'} | "
            f"{'on' if r['check'] else 'off'} | {r['seconds'] / 60:.1f} | "
            f"{r['process_peak_rss_gb']:.2f} | {anon:.2f} | "
            f"{'-' if r.get('max_abs_diff') is None else format(r['max_abs_diff'], '.2e')} | "
            f"{', '.join(f'{x:.1f}' for x in r['load_average_at_start'] or [])} |"
        )
    for r in results:
        if r.get("variants"):
            verdicts = ", ".join(
                f"{name} {'refused' if figures.get('misses') else 'passed'}"
                for name, figures in (r.get("variant_checks") or {}).items()
            )
            lines += ["", f"Variants {','.join(r['variants'])}: {verdicts or 'none written'}."]
            if r.get("refused"):
                lines += ["", "```", r["refused"], "```"]
        group = r.get("cgroup")
        if group:
            oom = "not counted" if group["oom_kill"] is None else group["oom_kill"]
            lines += [
                "",
                f"Memory cgroup: limit {group['limit_bytes']} bytes ({group['cap_gib']:g} GiB), "
                f"swap off; peak usage {group['max_usage_gb']:.2f} GB (file pages included), "
                f"limit hit {group['failcnt']} times (reclaim), OOM kills {oom}.",
            ]
    lines += ["", "Per step (peak RSS GB / peak anonymous GB / seconds):", ""]
    steps = list(dict.fromkeys(s["step"] for r in results for s in r["steps"]))
    lines += [
        "| step | " + " | ".join(label(r["stream_weights"], r["check"]) for r in results) + " |",
        "|---|" + "---:|" * len(results),
    ]
    for step in steps:
        cells = []
        for r in results:
            s = next((s for s in r["steps"] if s["step"] == step), None)
            cells.append(
                "-"
                if s is None
                else f"{s['peak_rss_gb']:.2f} / {s.get('peak_anon_gb') or 0:.2f} / "
                f"{s['seconds']:.0f}"
            )
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    if same:
        lines += [
            "",
            "Graphs of the two paths (check on), byte for byte: "
            + ", ".join(f"{k} {'identical' if v else 'DIFFERENT'}" for k, v in same.items())
            + ".",
        ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--vision-depth", type=int, default=32)
    parser.add_argument("--text-layers", type=int, default=28)
    parser.add_argument("--workdir", default="/tmp/colembed-bench-export-streamed")
    parser.add_argument("--clean", action="store_true", help="delete the work folder at the end")
    parser.add_argument("--results", default=str(RESULTS), help="path without extension")
    parser.add_argument(
        "--runs",
        nargs="+",
        choices=sorted(RUN_NAMES),
        default=sorted(RUN_NAMES),
        help="which exports to measure (path-check); the byte comparison needs both check-on runs",
    )
    parser.add_argument("--variants", default="", help="e.g. int8,fp16 (default: none)")
    parser.add_argument(
        "--memory-cap",
        type=float,
        default=None,
        metavar="GIB",
        help="run each export in a memory cgroup of this many GiB (cgroup v1, as root)",
    )
    args = parser.parse_args()
    if args.child:
        checkpoint, out, stream, check, variants = args.child
        print(
            json.dumps(
                child(
                    Path(checkpoint),
                    Path(out),
                    stream == "1",
                    check == "1",
                    [v for v in variants.split(",") if v],
                )
            )
        )
        return 0
    variants = [v for v in args.variants.split(",") if v]

    import dataclasses

    from colembed import safe_fs
    from colembed_export.pipeline.destination import is_export_folder
    from colembed_export.testing.sharded import build_sharded_checkpoint
    from colembed_export.testing.tiny_qwen2 import PRESETS

    info = machine_info()
    workdir = safe_fs.make_work_folder(args.workdir, "bench_export_streamed")
    spec = dataclasses.replace(
        PRESETS["qwen2-vl-2b"], vision_depth=args.vision_depth, text_layers=args.text_layers
    )
    checkpoint = workdir / f"qwen2-vl-2b-v{spec.vision_depth}-t{spec.text_layers}-sharded"
    if not (checkpoint / "config.json").is_file():
        start = time.perf_counter()
        build_sharded_checkpoint(checkpoint, spec, seed=0)
        print(f"built {checkpoint} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    weights = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors")) / 1e9
    results, outs = [], {}
    chosen = [RUN_NAMES[name] for name in args.runs]
    for stream, check in [run for run in RUNS if run in chosen]:
        suffix = "".join(f"-{v}" for v in variants) + (
            "" if args.memory_cap is None else f"-cap{args.memory_cap:g}"
        )
        out = workdir / f"model-{'streamed' if stream else 'whole'}-{int(check)}{suffix}"
        outs[(stream, check)] = out
        done = out.with_name(out.name + ".json")  # a run already measured is not run again
        if done.is_file():
            results.append(json.loads(done.read_text()))
            continue
        print(f"--- {label(stream, check)}", file=sys.stderr, flush=True)
        results.append(run_child(checkpoint, out, stream, check, variants, args.memory_cap))
        done.write_text(json.dumps(results[-1], indent=2) + "\n")
        if not check:  # only the checked pair is compared; the disk holds two exports, not four
            safe_fs.remove_tree(out, owner=is_export_folder)
    compared = workdir / "same.json"  # kept: the two exports may be deleted to free the disk
    if not compared.is_file() and {(False, True), (True, True)} <= set(outs):
        compared.write_text(json.dumps(same_graphs(outs[(False, True)], outs[(True, True)])))
    same = json.loads(compared.read_text()) if compared.is_file() else {}
    arch = dataclasses.asdict(spec)
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results + ".json").write_text(
        json.dumps(
            {"machine": info, "weights_gb": weights, "same": same, "runs": results}, indent=2
        )
        + "\n"
    )
    text = markdown(info, results, weights, same, arch)
    Path(args.results + ".md").write_text(text)
    print(text)
    if args.clean:
        safe_fs.remove_tree(workdir, owner=safe_fs.is_work_folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
