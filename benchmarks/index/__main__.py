"""Page stores side by side: Qdrant Edge (exact, two-stage, and the schema-1 two-stage plan on the
same store), colembed's numpy scorer, qdrant-client local mode; and indexing throughput against
embedding alone.

    python -m benchmarks.index                 # 1,000 and 10,000 pages (~8 GB peak)
    python -m benchmarks.index --pages 1000    # one size
    python -m benchmarks.index --quick         # 200 pages, smoke (not committed)
    python -m benchmarks.index --ingest-only   # indexing throughput (< 5 min)
    python -m benchmarks.index --long-run /tmp/x --pages 10000 --set local \
        --kill-at 2500 --kill-at 5000 --kill-at 7500 [--ab-cadence] [--pool-factor 3]
                                                  # long runs (index/long_run.py); pooled: --pool-factor

Data (`--set`): synthetic page embeddings of real shape, what each models and does not said in
its module: `synthetic_pages.py` (a topic spanning the page, grid-structured) and
`local_answer.py` (the answer in 1-3% of a page's tokens). Random structure, not a trained model:
two-stage recall@10 here is a floor, not the trained figure.

Each store runs in its own subprocess (peak RSS is per process): insert pages/s through colembed's
Store adapter (points with all three vectors, as `Index.add` writes them), disk size, reopen time
(a fresh process opening the folder), query p50/p90 for 1 query and for a batch of 16 queries.
edge-previous: the same store searched with the schema-1 two-stage plan (rows + cols MaxSim over
every page, `Store.plan_schema = 1`: what colembed 0.1.0 ran), so the new plan's gain is a ratio
within one run; recall@10 against exact is reported for both plans.
colembed numpy: `colembed.top_k` over the same vectors held in memory (float32).
Indexing throughput (`--no-ingest` skips it, `--ingest-only` runs it alone, `--ingest-model
tiny|bench` picks the models; default both): `Index.add` over PDFs vs `model.embed_pages` over the same pages
already rendered (same batch size), best of alternating rounds, the store opened outside the timed
part; and each stage alone in CPU seconds per page (hash, render, pool + upsert, embed). On a
machine whose cores the embedding fills, the other stages' CPU cannot hide behind it, so
embed CPU / (embed + render + hash + store CPU) bounds the ratio. Two models: the tiny one
(embedding unrealistically cheap, so the bound is low) and the Qwen2-VL-2B widths at 2 + 2 layers
that bench_embed.py --quick builds (cached in its --workdir; what users run has these widths and
16x the depth, so their bound is higher still).

Writes benchmarks/results/index/index.{md,json} (--quick: index-quick.*, --ingest-only: index-ingest.*).

The code: this driver (options, one subprocess per job), `index_stores.py` (the store jobs),
`index_ingest.py` (the ingest job), `index_report.py` (tables), `index_long.py` (long runs killed
and resumed), over `common.py`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # the benchmarks folder
from benchmarks.shared.common import BENCH_WORKDIR, load_average, machine_info, write_note  # noqa: E402
from benchmarks.index.ingest import INGEST_MODELS, bench_ingest  # noqa: E402
from benchmarks.index.long_run import (  # noqa: E402
    long_from_log,
    long_markdown,
    long_run,
    worker_long,
    worker_reopen,
)
from benchmarks.index.report import write_results  # noqa: E402
from benchmarks.index.stores import (  # noqa: E402
    CLIENT_LOCAL_MAX_PAGES,
    EDGE_BACKENDS,
    NUMPY_MAX_PAGES,
    SETS,
    disk_mib,
    worker_build,
    worker_numpy,
    worker_query,
)


def run_worker(args) -> None:
    """One job of `--worker` (this script run by `_sub`): its result as a JSON line."""
    folder = Path(args.folder) if args.folder else None
    if args.worker == "numpy":
        out = worker_numpy(args.pages)
    elif args.worker.startswith("build:"):
        out = worker_build(
            args.worker[6:], args.pages, folder, args.set[0], (args.pool_factor or [1])[0]
        )
    elif args.worker == "long":
        out = worker_long(
            args.pages, folder, args.set[0], args.log_bytes, (args.pool_factor or [1])[0]
        )
    elif args.worker == "reopen":
        out = worker_reopen(args.pages, folder, args.set[0])
    elif args.worker.startswith("ingest:"):
        out = bench_ingest(args.worker[7:], args.model, folder)
    else:
        out = worker_query(args.worker[6:], args.pages, folder, args.set[0])
    print(json.dumps(out))


def _sub(worker: str, pages: int, folder: Path | None = None, extra: tuple = ()) -> dict:
    """Run one job in a fresh interpreter (its peak RSS its own) and return its result."""
    cmd = [sys.executable, "-m", __spec__.name, "--worker", worker, "--pages", str(pages), *extra]
    if folder:
        cmd += ["--folder", str(folder)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_pooled(
    pages: int, scratch: Path, data: str, factors: list[int], baseline: dict | None = None
) -> dict:
    """Index-time pooling: per pool factor a store of the same pages (factor 1: unpooled), its
    default two-stage plan and its exact scan; quality against the unpooled store's exact top 10
    (`index_report.pooling_markdown`). One store on disk at a time. `baseline`: the factor-1
    results of an earlier run of this function on the same set and size (the data are
    deterministic), so pooled stores can be measured in parallel runs beside it."""
    results = dict(baseline or {})
    for factor in sorted(set(factors) | (set() if baseline else {1})):
        folder = scratch / f"edge-{data}-{pages}-pool{factor}"
        extra = ("--set", data, "--pool-factor", str(factor))
        build = _sub("build:edge", pages, folder, extra)
        for backend in ("edge-two-stage", "edge-exact"):
            results[f"{backend}-pool{factor}"] = {
                **build,
                **_sub(f"query:{backend}", pages, folder, extra),
            }
            print(
                data,
                backend,
                factor,
                pages,
                results[f"{backend}-pool{factor}"],
                file=sys.stderr,
                flush=True,
            )
        shutil.rmtree(folder)
    return results


def bench_stores(
    pages: int, scratch: Path, data: str = "page-wide", store: Path | None = None
) -> dict:
    """Every backend on one data set; `store`: an Edge folder this script built before with the
    same set and size (its build figures are then not measured: "reused")."""
    results = {}
    edge = store or scratch / f"edge-{data}-{pages}"
    extra = ("--set", data)
    if store is None:
        build = _sub("build:edge", pages, edge, extra)
    else:
        from colembed.index.backends import upgrade_index

        t = time.perf_counter()
        upgrade_index(store)  # a folder of an older build: its token table made from its vectors
        build = {
            "reused": str(store),
            "table_rebuild_s": time.perf_counter() - t,
            "disk_mib": disk_mib(store),
        }
    for backend in EDGE_BACKENDS:
        results[backend] = {**build, **_sub(f"query:{backend}", pages, edge, extra)}
        print(data, backend, pages, results[backend], file=sys.stderr, flush=True)
    if store is None:
        shutil.rmtree(edge)
    if data == "local":
        return results
    if pages <= NUMPY_MAX_PAGES:
        results["numpy"] = _sub("numpy", pages, None, extra)
        print("numpy", pages, results["numpy"], file=sys.stderr, flush=True)
    if pages <= CLIENT_LOCAL_MAX_PAGES:
        local = scratch / f"local-{pages}"
        build = _sub("build:client-local", pages, local, extra)
        results["client-local"] = {**build, **_sub("query:client-local", pages, local, extra)}
        print("client-local", pages, results["client-local"], file=sys.stderr, flush=True)
        shutil.rmtree(local)
    return results


def long_main(args) -> None:
    """--long-run / --long-from-log: index_long.py's results, written as index-long-N.*"""
    pages = (args.pages or [10000])[0]
    if args.long_from_log:
        log, stopped, command = args.long_from_log
        result = {
            "machine": dict(machine_info(), command=command),
            "load_before": None,
            **long_from_log(Path(log), command, pages, args.set[0], stopped),
        }
    else:
        result = {
            "machine": machine_info(),
            "load_before": load_average(),
            **long_run(
                __spec__.name,
                _sub,
                pages,
                args.kill_at,
                args.long_run,
                args.set[0],
                args.long_queries,
                args.ab_cadence,
                (args.pool_factor or [1])[0],
            ),
            "command": "python -m benchmarks.index " + " ".join(sys.argv[1:]),
        }
    result["load_after"] = load_average()
    name = f"index-long-{pages // 1000}k" if pages % 1000 == 0 else f"index-long-{pages}"
    if (args.pool_factor or [1])[0] > 1:
        name += f"-pool{args.pool_factor[0]}"
    write_note(HERE / "results" / "index" / name, result, long_markdown(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--pages", type=int, action="append", help="store sizes (default 1000, 10000)"
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--model", type=Path, help="a model folder for the ingest check instead of --ingest-model's"
    )
    parser.add_argument("--no-ingest", action="store_true", help="stores only")
    parser.add_argument(
        "--ingest-only",
        action="store_true",
        help="indexing throughput only (writes index-ingest.{md,json})",
    )
    parser.add_argument(
        "--ingest-model",
        choices=sorted(INGEST_MODELS),
        action="append",
        help="models for the ingest check (default: tiny and bench)",
    )
    parser.add_argument(
        "--set",
        choices=SETS,
        action="append",
        help="data sets (default both; local_answer.py's and the page-wide one)",
    )
    parser.add_argument(
        "--store",
        type=Path,
        help="query this Edge folder (built before by this script with one --set "
        "and one --pages) instead of building one",
    )
    parser.add_argument(
        "--pool-factor",
        type=int,
        action="append",
        help="measure index-time token pooling at these factors beside 1 "
        "(writes index-pooling.{md,json}); with --long-run: the one factor "
        "the store is built at (writes index-long-N-poolF.{md,json})",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="with --pool-factor: a JSON of the factor-1 stores' results from an "
        "earlier run (same set and size) instead of building that store",
    )
    parser.add_argument(
        "--long-run",
        type=Path,
        metavar="FOLDER",
        help="one long build of --pages pages into FOLDER (new), killed at each "
        "--kill-at and resumed (index/long_run.py); writes "
        "index-long-N.{md,json}",
    )
    parser.add_argument(
        "--kill-at",
        type=int,
        action="append",
        default=[],
        help="with --long-run: SIGKILL the writer once this many pages are stored",
    )
    parser.add_argument(
        "--ab-cadence",
        action="store_true",
        help="with --long-run: alternate the legs between the cadence without its "
        "byte bound and the current one (an interleaved A/B of the kills)",
    )
    parser.add_argument(
        "--long-queries",
        action="store_true",
        help="with --long-run: then time two-stage and exact queries on it",
    )
    parser.add_argument(
        "--long-from-log",
        nargs=3,
        metavar=("LOG", "WHY", "COMMAND"),
        help="write the results of a --long-run stopped early from its stderr LOG "
        "(its kill lines), saying WHY it stopped and its COMMAND",
    )
    parser.add_argument("--log-bytes", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.set = args.set or list(SETS)
    if args.worker:
        args.pages = args.pages[0]
        return run_worker(args)
    if args.long_run or args.long_from_log:
        return long_main(args)
    sizes = [] if args.ingest_only else [200] if args.quick else (args.pages or [1000, 10000])
    results = {"machine": machine_info(), "load_before": load_average(), "stores": {}, "ingest": {}}
    if args.pool_factor:
        results["command"] = "python -m benchmarks.index " + " ".join(sys.argv[1:])
        results["pooling"] = {}
        BENCH_WORKDIR.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="colembed-bench-pool-", dir=BENCH_WORKDIR) as tmp:
            for pages in args.pages or [10000]:
                for data in args.set:
                    baseline = json.loads(args.baseline.read_text()) if args.baseline else None
                    results["pooling"][f"{data}:{pages}"] = bench_pooled(
                        pages, Path(tmp), data, args.pool_factor, baseline
                    )
        results["load_after"] = load_average()
        sets = "" if len(args.set) > 1 else f"-{args.set[0]}"
        factors = "-".join(map(str, sorted(set(args.pool_factor))))
        return write_results(
            results, f"index-pooling{sets}-{max(args.pages or [10000])}-pool{factors}"
        )
    with tempfile.TemporaryDirectory(prefix="colembed-bench-index-") as tmp:
        scratch = Path(tmp)
        if not args.no_ingest:
            for name in args.ingest_model or ["tiny", "bench"]:  # one process each (peak RSS)
                extra = ("--model", str(args.model)) if args.model else ()
                results["ingest"][name] = _sub(f"ingest:{name}", 0, scratch, extra)
                print("ingest", name, results["ingest"][name], file=sys.stderr, flush=True)
        for pages in sizes:
            for data in args.set or SETS:
                results["stores"][f"{data}:{pages}"] = bench_stores(
                    pages, scratch, data, args.store
                )
    results["load_after"] = load_average()
    write_results(
        results, "index-ingest" if args.ingest_only else "index-quick" if args.quick else "index"
    )


if __name__ == "__main__":
    main()
