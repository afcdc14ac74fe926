"""colembed.distributed on one machine: pages/s with 1 and 2 model actors, and what Ray costs
per page against the single-process indexer, same pages, same model, one run.

    python -m benchmarks.distributed                # tiny random-weight model
    python -m benchmarks.distributed --model DIR    # any exported model folder

Method. `--files` PDFs of `--pages` letter pages at 150 dpi (`common.make_pdfs`, as bench_index.py
makes them), each configuration indexing all of them into a new Qdrant Edge folder (the
single-process indexer's own target and writer), then indexing them again (everything skipped); the mean of `--rounds`:
- single: `colembed.Index(...).add(...)`, the model loaded once beforehand (2 threads);
- ray x1: `index_with_ray`, 1 actor holding the model with 2 threads (cpus_per_actor=2);
- ray x2: 2 actors with 1 thread each.
Per page = (job - re-run) / pages, so what a job costs with nothing to embed (Ray: worker
processes, actors starting and loading the model, hashing and planning; single: hashing and
planning) cancels and is reported apart. Measured twice: CPU seconds of this process and every
process under it (Ray's GCS, raylet, workers and actors; `TreeCpu`) and wall seconds. CPU seconds are what a saturated node divides its cores by, and
stay meaningful on a machine shared with other jobs; wall seconds are not, there. Overhead at 1
actor = per-page(ray x1) / per-page(single) - 1 (target <= 5%). Ray runs on a local cluster
started here (2 CPUs, 300 MB object store, no dashboard). A probe actor loads the model, embeds
one page and reports its process's peak RSS (memory per actor).

Writes benchmarks/results/distributed/distributed.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
from benchmarks.shared.common import (  # noqa: E402
    load_average,
    load_caveat,
    machine_info,
    make_pdfs,
    results_markdown,
    rss_mib,
    write_note,
)

from colembed.layout import BASE_VARIANT  # noqa: E402

OBJECT_STORE_BYTES = 300 * 2**20
CONFIGS = {
    "single": None,
    "ray x1": dict(actors=1, cpus_per_actor=2),
    "ray x2": dict(actors=2, cpus_per_actor=1),
}
BATCH_SIZE = 4
SAMPLE_S = 0.1  # CPU sampling interval of the process tree
CORES_PER_MACHINE = 2  # the projection's machines are this one: 2 cores, one actor using both
# Qdrant ingestion per node for the projection: Edge's measured insert rate of whole pages
# (~770 x 128 float16 + pooled vectors) on this 2-core machine, benchmarks/results/index/history/index-10k.md.
QDRANT_PAGES_PER_S_PER_NODE = 74


def build_tiny(scratch: Path) -> Path:
    from colembed_export.pipeline.exporter import export_model
    from colembed_export.testing.tiny_qwen2 import build_checkpoint

    checkpoint = build_checkpoint(scratch / "ckpt", "tiny", seed=0)
    return export_model(
        checkpoint, scratch / "model", name="colqwen2-tiny-random", random_weights=True
    ).folder


class TreeCpu:
    """CPU seconds (user + system) used by this process and every process under it while in
    the `with` block. Ray reaps its exited workers without accounting their time to a parent, so
    a thread samples each process's cumulative time every `SAMPLE_S` and keeps the last value
    seen (a process that exits loses at most its last interval)."""

    def __enter__(self) -> TreeCpu:
        self.seen: dict[int, float] = {}
        self.names: dict[int, str] = {}
        self.base = dict(self._sample())
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            self.seen.update(self._sample())
            for pid in self.seen:  # a Ray worker's name says what it runs now; keep the last
                try:
                    name = Path(f"/proc/{pid}/comm").read_text().strip()
                except OSError:
                    continue
                if name != "ray::IDLE" or pid not in self.names:
                    self.names[pid] = name

    def by_role(self) -> dict[str, float]:
        """CPU seconds per role: this process (the driver), the model actors, other Ray workers
        (render and write tasks), Ray's daemons (raylet, GCS, agents, monitors)."""
        roles: dict[str, float] = {}
        for pid, seconds in self.seen.items():
            name = self.names.get(pid, "")
            role = (
                "driver"
                if pid == os.getpid()
                else "model actors"
                if "PageEmbedder" in name or name.startswith("ray::MapWorker")
                else "other Ray workers"
                if name.startswith("ray::") and "Agent" not in name
                else "Ray daemons"
            )
            roles[role] = roles.get(role, 0.0) + seconds - self.base.get(pid, 0.0)
        return roles

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.seen.update(self._sample())
        self.seconds = sum(t - self.base.get(pid, 0.0) for pid, t in self.seen.items())

    @staticmethod
    def _sample() -> dict[int, float]:
        tick = os.sysconf("SC_CLK_TCK")
        parents, cpu = {}, {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            parents[int(entry.name)] = int(fields[1])
            cpu[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
        mine, frontier = {os.getpid()}, {os.getpid()}
        while frontier:
            frontier = {p for p, parent in parents.items() if parent in frontier} - mine
            mine |= frontier
        return {p: cpu[p] for p in mine}


def index_once(name: str, docs: list[Path], model_dir: Path, model, db: Path) -> tuple:
    """(wall s, CPU s, pages added, CPU s by role) of indexing `docs` into the Edge folder `db`."""
    import colembed
    from colembed.distributed import QdrantTarget, index_with_ray

    wall = time.perf_counter()
    with TreeCpu() as cpu:
        if CONFIGS[name] is None:
            with colembed.Index(db, model=model) as index:
                result = index.add(docs, batch_size=BATCH_SIZE, progress=False)
        else:
            result = index_with_ray(
                [str(d) for d in docs],
                QdrantTarget(str(db)),
                model=model_dir,
                batch_size=BATCH_SIZE,
                progress=False,
                **CONFIGS[name],
            )
    assert result.ok, result
    return time.perf_counter() - wall, cpu.seconds, result.pages_added, cpu.by_role()


def run_config(name: str, docs: list[Path], model_dir: Path, model, db: Path) -> dict:
    wall, cpu, pages, roles = index_once(name, docs, model_dir, model, db)
    again_wall, again_cpu, again, again_roles = index_once(name, docs, model_dir, model, db)
    assert pages > 0 and again == 0
    per_page = {k: (v - again_roles.get(k, 0.0)) / pages for k, v in roles.items()}
    return {
        "job_wall_s": wall,
        "job_cpu_s": cpu,
        "rerun_wall_s": again_wall,
        "cpu_s_per_page_by_role": per_page,
        "rerun_cpu_s": again_cpu,
        "pages": pages,
        "wall_s_per_page": (wall - again_wall) / pages,
        "cpu_s_per_page": (cpu - again_cpu) / pages,
    }


def actor_peak_rss(model_dir: Path, page) -> dict:
    """Peak RSS (MiB) of a Ray actor process after loading the model and embedding one page."""
    import ray

    @ray.remote(num_cpus=1)
    class Probe:
        def measure(self, folder: str, image) -> dict:
            import colembed

            before = rss_mib()["peak"]
            colembed.load(folder, threads=1).embed_pages([image])
            return {"worker_before_model_mib": before, "peak_mib": rss_mib()["peak"]}

    probe = Probe.remote()
    try:
        return ray.get(probe.measure.remote(str(model_dir), page))
    finally:
        ray.kill(probe)


def bench(model_dir: Path, scratch: Path, files: int, pages: int, rounds: int) -> dict:
    import ray

    import colembed
    from colembed.index.sources import Document

    make_pdfs(scratch / "docs", files, pages)
    docs = sorted((scratch / "docs").glob("*.pdf"))
    model = colembed.load(model_dir)
    with Document(docs[0], max_pixels=model.config.max_pixels) as doc:
        page = doc.render(1)
    ray.init(
        num_cpus=2,
        object_store_memory=OBJECT_STORE_BYTES,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(HERE)}},
    )
    try:
        index_once("ray x1", docs[:1], model_dir, model, scratch / "warm-up")  # Ray's worker pool
        rows = {}
        for name in CONFIGS:
            runs = [
                run_config(name, docs, model_dir, model, scratch / f"db-{name}-{r}")
                for r in range(rounds)
            ]
            rows[name] = {
                k: sum(x[k] for x in runs) / rounds
                for k in runs[0]
                if not isinstance(runs[0][k], dict)
            }  # mean of rounds
            rows[name]["cpu_s_per_page_by_role"] = runs[-1]["cpu_s_per_page_by_role"]
            rows[name]["rounds_cpu_s_per_page"] = [x["cpu_s_per_page"] for x in runs]
            print(name, rows[name], file=sys.stderr, flush=True)
        actor = actor_peak_rss(model_dir, page)
    finally:
        ray.shutdown()
    single = rows["single"]
    return {
        "model": model.name + (" (random weights)" if model.manifest.model.random_weights else ""),
        "image_tokens_per_page": len(model.embed_pages([page])[0][0]),
        "pages": files * pages,
        "batch_size": BATCH_SIZE,
        "rounds": rounds,
        "configs": rows,
        "overhead_1_actor_cpu": rows["ray x1"]["cpu_s_per_page"] / single["cpu_s_per_page"] - 1,
        "overhead_1_actor_wall": rows["ray x1"]["wall_s_per_page"] / single["wall_s_per_page"] - 1,
        "scaling_2_actors_wall": rows["ray x1"]["wall_s_per_page"]
        / rows["ray x2"]["wall_s_per_page"],
        "actor_rss": actor,
        "driver_rss_mib": rss_mib(),
    }


def projection(r: dict, nodes: tuple[int, ...] = (1, 10, 100, 1000)) -> list[str]:
    """N 2-core machines, one actor each: the tiny model as measured, and the Qwen2-VL-2B-width
    model of bench_embed (its single-process pages/s, results/embed/embed.json) plus the Ray overhead
    per page measured here, in CPU seconds; bounded by Qdrant's ingestion."""
    overhead = r["configs"]["ray x1"]["cpu_s_per_page"] - r["configs"]["single"]["cpu_s_per_page"]
    embed = json.loads((HERE / "results" / "embed" / "embed.json").read_text())
    wide_cpu = CORES_PER_MACHINE / embed["runtimes"][BASE_VARIANT]["pages_per_s"]
    setting = embed["setting"]
    per_machine = {
        "tiny (measured)": CORES_PER_MACHINE / r["configs"]["ray x1"]["cpu_s_per_page"],
        f"2B widths, {setting['vision_depth']}+{setting['text_layers']} layers, fp32 "
        f"(projected: {wide_cpu:.1f} CPU s per page + {overhead:.3f})": CORES_PER_MACHINE
        / (wide_cpu + overhead),
    }
    lines = [
        f"Ray's measured overhead, {overhead:.3f} CPU s per page, is "
        f"{100 * overhead / wide_cpu:.1f}% of a 2B-width {setting['vision_depth']}+"
        f"{setting['text_layers']}-layer page ({wide_cpu:.1f} CPU s: bench_embed's "
        f"{embed['runtimes'][BASE_VARIANT]['pages_per_s']:.3f} pages/s on 2 threads) and less "
        "at full depth.",
        "",
        "| model | machines | pages/s | Qdrant nodes to keep up | 1M pages take |",
        "|---|---:|---:|---:|---:|",
    ]
    for model, rate in per_machine.items():
        for n in nodes:
            qdrant = max(1, -(-int(n * rate) // QDRANT_PAGES_PER_S_PER_NODE))
            lines.append(
                f"| {model} | {n} | {n * rate:.1f} | {qdrant} | {1e6 / (n * rate) / 3600:.1f} h |"
            )
    return lines


def markdown(results: dict) -> str:
    r = results["bench"]
    lines = [
        f"Model: {r['model']} ({r['image_tokens_per_page']} tokens per letter page). "
        f"{r['pages']} PDF pages into a new Qdrant Edge folder, then again (all skipped); "
        f"batch size {r['batch_size']}; mean of {r['rounds']} rounds. Per page = (job - "
        "re-run) / pages; CPU = this process and every process under it (Ray's included); "
        "see the script's docstring.",
        "",
        f"Load average before / after: {results.get('load_before')} / "
        f"{results.get('load_after')}" + load_caveat(results),
        "",
        "| configuration | CPU s per page (rounds) | x single | wall s per page | x single "
        "| job wall s | re-run wall s (fixed cost) | re-run CPU s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    single = r["configs"]["single"]
    for name, c in r["configs"].items():
        each = ", ".join(f"{x:.3f}" for x in c["rounds_cpu_s_per_page"])
        lines.append(
            f"| {name} | {c['cpu_s_per_page']:.3f} ({each}) | "
            f"{c['cpu_s_per_page'] / single['cpu_s_per_page']:.3f} | "
            f"{c['wall_s_per_page']:.3f} | "
            f"{c['wall_s_per_page'] / single['wall_s_per_page']:.2f} | "
            f"{c['job_wall_s']:.1f} | {c['rerun_wall_s']:.1f} | {c['rerun_cpu_s']:.1f} |"
        )
    lines += [
        "",
        "CPU seconds per page by process (last round; job minus re-run): "
        + "; ".join(
            f"{name}: "
            + ", ".join(
                f"{role} {v:.3f}" for role, v in sorted(c["cpu_s_per_page_by_role"].items())
            )
            for name, c in r["configs"].items()
        )
        + ".",
    ]
    lines += [
        "",
        f"Ray's overhead per page at 1 actor: **{100 * r['overhead_1_actor_cpu']:+.1f}% "
        f"CPU** (target <= 5%), {100 * r['overhead_1_actor_wall']:+.1f}% wall. 2 actors vs "
        f"1 actor on these 2 cores: {r['scaling_2_actors_wall']:.2f}x the pages/s (wall).",
        f"Actor peak RSS after loading the model and embedding a page: "
        f"{r['actor_rss']['peak_mib']:.0f} MiB (the Ray worker alone: "
        f"{r['actor_rss']['worker_before_model_mib']:.0f} MiB).",
        "",
        "## Projection for N machines",
        "",
        "A 2-core machine with one actor = 2 / (CPU seconds per page). Assumes the cores "
        "are saturated, letter pages (~750 tokens), documents read from shared storage at "
        "no cost, no shared bottleneck but Qdrant, and (an assumption, not measured: no "
        "server runs here) each Qdrant node ingesting whole pages as fast as Qdrant Edge "
        f"did on this 2-core machine, {QDRANT_PAGES_PER_S_PER_NODE} pages/s "
        "(benchmarks/results/index/history/index-10k.md); real depth divides the 2B-width rate further "
        "(docs/distributed.md).",
        "",
        *projection(r),
        "",
    ]
    return results_markdown(
        "Distributed indexing benchmark (colembed.distributed on Ray Data)",
        results["machine"],
        lines,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="an exported model folder (default: build the tiny one)")
    parser.add_argument("--files", type=int, default=12)
    parser.add_argument("--pages", type=int, default=8, help="pages per PDF")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--markdown-only", action="store_true", help="rewrite distributed.md from distributed.json"
    )
    args = parser.parse_args()
    out = HERE / "results" / "distributed"
    if args.markdown_only:
        results = json.loads((out / "distributed.json").read_text())
        (out / "distributed.md").write_text(markdown(results))
        return
    results = {"machine": machine_info(), "load_before": load_average()}
    with tempfile.TemporaryDirectory(prefix="colembed-bench-distributed-") as tmp:
        scratch = Path(tmp)
        model_dir = Path(args.model) if args.model else build_tiny(scratch)
        results["bench"] = bench(model_dir, scratch, args.files, args.pages, args.rounds)
    results["load_after"] = load_average()
    write_note(out / "distributed", results, markdown(results))


if __name__ == "__main__":
    main()
