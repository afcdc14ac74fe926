"""The release guard: this checkout's colembed against another version, interleaved, in one run.

    python -m benchmarks.embed --against 56e6bc6            # a git ref (0.1.0 here)
    python -m benchmarks.embed --against /path/to/site-packages-or-checkout

Both versions run side by side on the same machine state: each in its own long-lived process
(`common.Worker`; the other version's process gets `PYTHONPATH` pointing at a `git worktree` of the
ref, or at the folder given), with the torch eager fp32 reference as a third process for the
x-torch columns. For each variant the driver times one item per process in turn (A B T, then
T B A, ...), `--rounds` times, so slow drifts of a shared machine hit every side alike. Columns:
a letter page (744 image tokens), 16 queries in one call, 1 query (single-query calls over the 16
queries), for fp32 and int8.

Each sample holds at least SAMPLE_SECONDS of work: the warm-up times every item once per side and
sets the item's repeats (the same for every side, from the fastest side) so that a sample of a
~30 ms single query or a ~0.3 s batch is not one scheduler tick of a shared machine. A "1 query"
sample is `repeats` passes over the 16 queries, one call each (every side runs the same queries);
its figure is the mean per call.

Graphs: "same" (default when the other version can load this checkout's export: same file
format) times both runtimes on the very same graph files, so the difference is the runtime alone;
"own" gives each version its own exporter's graphs of the same checkpoint (what a user of each
release would have run), which is what to use when a graph rewrite is a suspect.

The verdict: per column the median over rounds of (other / this) time; this checkout fails when
any column's median ratio is below 1 - `--margin` (exit status 1). The per-round spread is
reported beside it: on a shared machine a margin below that spread means nothing.

The model: a random-weight checkpoint at Qwen2-VL-2B widths, heads and vocabulary with 2 vision
blocks and 2 language layers (realistic per-layer shapes at a depth that fits a few minutes; it
does not model the full depth's share of attention, see `--full`).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.shared.common import (
    QUERIES,
    Worker,
    letter_page,
    load_average,
    machine_info,
    markdown_header,
    markdown_table,
    serve,
    spread,
    timed,
    write_note,
)

HERE = Path(__file__).resolve().parents[1]  # the benchmarks folder
REPO = HERE.parent
COLUMNS = {  # column key -> (variant, item)
    "page fp32": ("fp32", "page"),
    "16 queries fp32": ("fp32", "q16"),
    "1 query fp32": ("fp32", "q1"),
    "page int8": ("int8", "page"),
    "16 queries int8": ("int8", "q16"),
    "1 query int8": ("int8", "q1"),
}
SINGLE_QUERIES = 16  # single-query calls per pass of a "1 query" sample (QUERIES[:16], one each)
SAMPLE_SECONDS = 0.5  # the least work in one timed sample (see the module docstring)


# ------------------------------------------------------------------------------- the worker
class _Embedder:
    """The worker's state: one runtime loaded, its items ready."""

    def __init__(self) -> None:
        self.model = None
        self.page = letter_page()

    def load(
        self,
        runtime: str,
        variant: str = "fp32",
        folder: str | None = None,
        checkpoint: str | None = None,
        threads: int | None = None,
        family: str = "colqwen2",
    ) -> dict[str, Any]:
        self.model = None
        start = time.perf_counter()
        if runtime.startswith("torch"):
            from benchmarks.embed.torch_reference import TorchRuntime

            self.model = TorchRuntime(checkpoint, threads, family, runtime=runtime)
            where = "torch"
        else:
            import colembed

            self.model = colembed.load(folder, variant=variant, threads=threads)
            where = colembed.__file__
        return {"load_s": time.perf_counter() - start, "module": where}

    def time(self, item: str, repeats: int = 1) -> dict[str, Any]:
        """Seconds per call of `item`, the mean over `repeats` calls (for "q1": `repeats`
        passes over the 16 queries, one single-query call each)."""
        model = self.model
        if item == "page":
            calls = [lambda: model.embed_images([self.page])] * repeats
        elif item == "q16":
            calls = [lambda: model.embed_queries(QUERIES[:16], batch_size=16)] * repeats
        elif item == "q1":
            calls = [
                lambda q=q: model.embed_queries([q]) for q in QUERIES[:SINGLE_QUERIES]
            ] * repeats
        else:
            raise ValueError(f"unknown item {item!r}")
        return {"s": sum(timed(call) for call in calls) / len(calls), "calls": len(calls)}


def worker_main() -> int:
    embedder = _Embedder()
    return serve({"load": embedder.load, "time": embedder.time})


# ------------------------------------------------------------------------------- the other side
def checkout(ref: str, work: Path) -> tuple[Path, str]:
    """A folder to put on PYTHONPATH for `ref`: a git ref becomes a detached worktree of this
    repository (reused if there), whose `export/` is linked as `colembed_export`; an existing
    folder is used as it is (an installed version's site-packages or a checkout)."""
    given = Path(ref).expanduser()
    if given.is_dir():
        return given, str(given)
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", ref],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    tree = work / f"ref-{commit}"
    if not (tree / "colembed").is_dir():
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), commit],
            check=True,
            capture_output=True,
        )
    shim = work / f"ref-{commit}-path"
    shim.mkdir(exist_ok=True)
    for name, target in (("colembed", tree / "colembed"), ("colembed_export", tree / "export")):
        link = shim / name
        if not link.exists():
            link.symlink_to(target)
    return shim, commit


def ref_export(path: Path, ckpt: Path, out: Path, progress) -> Path:
    """The other version's own export of `ckpt` (fp32 + int8), in a subprocess on its path."""
    # (imported here: the other version's worker imports this module beside its own colembed)
    from colembed.layout import MANIFEST_NAME

    if (out / MANIFEST_NAME).is_file():  # made by an earlier run: reused
        return out
    progress(f"exporting {ckpt.name} with the other version's exporter")
    code = (
        "import sys\n"
        "try:\n    from colembed_export.pipeline.exporter import export_model\n"
        "except ImportError:  # a version from before the exporter's folders\n"
        "    from colembed_export.exporter import export_model\n"
        "export_model(sys.argv[1], sys.argv[2], overwrite=True, variants=['int8'])"
    )
    # `-P`: no current folder on sys.path, or a run from this checkout would import its own
    # colembed instead of the other version's
    subprocess.run(
        [sys.executable, "-P", "-c", code, str(ckpt), str(out)],
        check=True,
        env=dict(os.environ, PYTHONPATH=str(path)),
    )
    return out


# ------------------------------------------------------------------------------- the driver
def run_against(args, ckpt: Path, folder: Path, work: Path, progress) -> int:
    """Time this checkout against each of `args.against` (comma-separated refs), all interleaved
    in one run; write results/embed/embed-against.{json,md}; 0 when no column is slower than the margin
    against any of them."""
    info = machine_info()
    ours = "this checkout"
    sides: dict[str, tuple[dict[str, str], Path]] = {ours: ({"PYTHONPATH": str(REPO)}, folder)}
    argv = [sys.executable, "-P", "-m", "benchmarks.embed.against", "--serve"]
    graphs: dict[str, str] = {}
    for ref in args.against.split(","):
        path, label = checkout(ref, work)
        env = {"PYTHONPATH": str(path) + os.pathsep + str(REPO)}
        mode, other_folder = args.graphs, folder
        if mode in ("same", "auto"):
            with Worker("probe", argv, env=env) as probe:
                try:
                    probe.call(
                        "load",
                        runtime="colembed",
                        variant="int8",
                        folder=str(folder),
                        threads=args.threads,
                    )
                    mode = "same"
                except RuntimeError as e:
                    if mode == "same":
                        raise
                    progress(f"{label} cannot load this export ({str(e)[:200]}): own graphs")
                    mode = "own"
        if mode == "own":
            other_folder = ref_export(
                path, ckpt, work / f"model-{label}-{ckpt.name.removeprefix('ckpt-')}", progress
            )
        graphs[label] = mode
        sides[label] = (env, other_folder)
    others = [side for side in sides if side != ours]
    rounds = args.rounds
    times: dict[str, dict[str, list[float]]] = {
        side: {c: [] for c in COLUMNS} for side in [*sides, "torch"]
    }
    loads: dict[str, Any] = {}
    repeats: dict[str, int] = {}
    load_start = load_average()
    torch_worker = None if args.no_torch else Worker("torch", argv, env=sides[ours][0])
    try:
        if torch_worker:
            loads["torch"] = torch_worker.call(
                "load", runtime="torch", checkpoint=str(ckpt), threads=args.threads
            )
        for variant in args.against_variants.split(","):
            workers = {side: Worker(side, argv, env=env) for side, (env, _) in sides.items()}
            try:
                for side, w in workers.items():
                    loads[f"{side} {variant}"] = w.call(
                        "load",
                        runtime="colembed",
                        variant=variant,
                        folder=str(sides[side][1]),
                        threads=args.threads,
                    )
                everyone = dict(workers, **({"torch": torch_worker} if torch_worker else {}))
                columns = [c for c, (v, _) in COLUMNS.items() if v == variant]
                warm: dict[str, list[float]] = {c: [] for c in columns}
                for side, w in everyone.items():  # warm-up: first-run allocations, kernel choice
                    for c in columns:
                        got = w.call("time", item=COLUMNS[c][1])
                        if side != "torch":
                            warm[c].append(got["s"] * got["calls"])
                for c in columns:  # the same repeats for every side, from the fastest
                    repeats[c] = sample_repeats(min(warm[c]))
                for r in range(rounds):
                    order = list(everyone.items())
                    if r % 2:
                        order.reverse()
                    for c in columns:
                        for side, w in order:
                            times[side][c].append(
                                w.call("time", item=COLUMNS[c][1], repeats=repeats[c])["s"]
                            )
                    progress(
                        f"{variant} round {r + 1}/{rounds}: "
                        + "; ".join(
                            f"{c} " + "/".join(f"{times[side][c][-1]:.3f}" for side in sides)
                            for c in columns
                        )
                        + f" s ({', '.join(sides)})"
                    )
            finally:
                for w in workers.values():
                    w.close()
    finally:
        if torch_worker:
            torch_worker.close()
    results = {
        "against": args.against,
        "variants": args.against_variants,
        "others": others,
        "graphs": graphs,
        "rounds": rounds,
        "margin": args.margin,
        "loads": loads,
        "load_average_start": load_start,
        "load_average_end": load_average(),
        "model": str(ckpt.name),
        "sample_seconds": SAMPLE_SECONDS,
        "repeats": repeats,
        "calls_per_sample": {
            c: repeats[c] * (SINGLE_QUERIES if COLUMNS[c][1] == "q1" else 1) for c in repeats
        },
        "folders": {side: str(f) for side, (_, f) in sides.items()},
        "threads": args.threads,
        "machine": info,
        "times": times,
        "versus": {other: summarise(times, ours, other, args.margin) for other in others},
    }
    results["verdict"] = (
        "fail" if any(v["verdict"] == "fail" for v in results["versus"].values()) else "pass"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    write_note(args.out / "embed-against", results, markdown(results))
    return 0 if results["verdict"] == "pass" else 1


def sample_repeats(one_sample_s: float, least_s: float = SAMPLE_SECONDS) -> int:
    """How many repeats of an item make a sample of at least `least_s` seconds, given one
    repeat's time on the fastest side."""
    if one_sample_s <= 0:
        return 1
    return max(1, math.ceil(least_s / one_sample_s))


def summarise(times, ours: str, other: str, margin: float) -> dict[str, Any]:
    """Per column: both sides' seconds, the per-round ratio other / ours (> 1: ours faster) and
    each side's x torch, with their spreads; the verdict against `other`."""
    ratios = {}
    for c in COLUMNS:
        a, b = times[ours][c], times[other][c]
        if not a:
            continue  # a variant not timed in this run
        paired = [y / x for x, y in zip(a, b)]
        entry = {"ours_s": spread(a), "other_s": spread(b), "other_over_ours": spread(paired)}
        t = times["torch"][c]
        if t:
            entry["x_torch_ours"] = spread([tt / x for tt, x in zip(t, a)])
            entry["x_torch_other"] = spread([tt / y for tt, y in zip(t, b)])
            entry["torch_s"] = spread(t)
        ratios[c] = entry
    slower = [c for c, e in ratios.items() if e["other_over_ours"]["median"] < 1 - margin]
    return {"columns": ratios, "slower_columns": slower, "verdict": "fail" if slower else "pass"}


def samples_line(results: dict[str, Any]) -> str:
    """What one timed sample is, per column (results before SAMPLE_SECONDS: 4 single calls)."""
    calls = results.get("calls_per_sample")
    if not calls:
        return "1 query = mean of 4 single-query calls"
    return (
        f"each sample >= {results['sample_seconds']} s of work on the fastest side, calls per "
        "sample (mean per call reported): " + ", ".join(f"{c} {n}" for c, n in calls.items())
    )


def markdown(results: dict[str, Any]) -> str:
    ours = "this checkout"
    lines = [
        f"# colembed against {results['against']}, interleaved in one run",
        "",
        markdown_header(results["machine"]),
        f"- load average at start {results['load_average_start']}, at end "
        f"{results['load_average_end']}; threads {results['threads'] or 'physical cores'}",
        f"- model: {results['model']} (random weights, Qwen2-VL-2B widths); graphs: "
        + ", ".join(f"{k}: {v}" for k, v in results["graphs"].items())
        + f" (same = every version on this checkout's export, {results['folders'][ours]}); "
        f"{results['rounds']} rounds after a warm-up, each round one item per process in "
        "turn, order reversed every other round; " + samples_line(results),
        "",
        f"Verdict: **{results['verdict']}** (fails when a column's median over rounds of "
        f"REF / this-checkout time < {1 - results['margin']:.2f}; margin "
        f"{results['margin']:.0%})",
        "",
    ]
    first = next(iter(results["versus"].values()))["columns"]
    head = ["", *first]
    rows = [[f"{ours} s (median)", *(f"{e['ours_s']['median']:.3f}" for e in first.values())]]
    for other, v in results["versus"].items():
        cols = v["columns"]
        rows += [
            [f"{other} s (median)", *(f"{e['other_s']['median']:.3f}" for e in cols.values())],
            [
                f"**{other} / this** (median of rounds)",
                *(f"**{e['other_over_ours']['median']:.3f}**" for e in cols.values()),
            ],
            [
                "  spread of that ratio (min - max)",
                *(
                    f"{e['other_over_ours']['min']:.2f} - {e['other_over_ours']['max']:.2f}"
                    for e in cols.values()
                ),
            ],
        ]
        if v["slower_columns"]:
            rows.append(
                [
                    f"  slower than {other}",
                    *("yes" if c in v["slower_columns"] else "" for c in cols),
                ]
            )
    if all("x_torch_ours" in e for e in first.values()):
        rows.append(
            [
                "torch eager fp32 s (median)",
                *(f"{e['torch_s']['median']:.3f}" for e in first.values()),
            ]
        )
        for other, v in results["versus"].items():
            rows.append(
                [
                    f"x torch, {other}",
                    *(f"{e['x_torch_other']['median']:.2f}" for e in v["columns"].values()),
                ]
            )
        rows.append(
            [f"x torch, {ours}", *(f"{e['x_torch_ours']['median']:.2f}" for e in first.values())]
        )
    lines += markdown_table(head, rows)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        raise SystemExit(worker_main())
    raise SystemExit("run it as `bench_embed.py --against REF`")
