"""`colembed doctor`: on the user's machine, where do the graphs run and do they agree with CPU fp32?

Written for a Windows user with onnxruntime-directml, who cannot be reproduced here:
- placement: each graph of the chosen variant runs once in an onnxruntime session with profiling
  on, fed the very inputs a real page and query produce; the profile's node events name the
  execution provider of every node, so the report says how many nodes ran where and which ops
  fell back to the CPU (onnxruntime falls back silently);
- parity: the same sample page and queries through the chosen variant on the chosen providers and
  through fp32 on the CPU; the report gives the max absolute difference and the min per-token
  cosine of the final embeddings;
- speed (`measure`, `colembed doctor --measure`): every variant of the folder on every provider
  that runs it here (onnxruntime's CPU provider; OpenVINO when installed), timed on the sample
  page and queries, with its fidelity to CPU fp32 on them and its export gate's figures; the
  fastest overall and the fastest exact one (fp32 or OpenVINO's f32 form) are named, and the
  provider of the latter is recorded for `providers="auto"` (`provider_choice`).
Nothing here prints; the CLI does. Profiles are written to a temporary folder and removed.
"""

from __future__ import annotations

import collections
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from .layout import BASE_VARIANT
from .sessions import (
    CPU,
    OPENVINO,
    OPENVINO_VARIANTS,
    Session,
    _name,
    onnxruntime_facts,
    openvino_installed,
    resolve_providers,
)

SAMPLE_QUERIES = ("What was the revenue in 2023?", "operating margin by region")
# Timed runs per candidate after one warm-up run (the median is reported).
MEASURE_REPEATS = 3
# The variants that compute fp32 (no reduced precision): "auto" chooses among these only.
EXACT_VARIANTS = (BASE_VARIANT, "openvino")


def sample_page() -> Any:
    """A deterministic page with text lines and a bar chart."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(0)
    page = Image.new("RGB", (420, 560), "white")
    draw = ImageDraw.Draw(page)
    for row in range(14):
        draw.text(
            (30, 20 + row * 26),
            f"line {row}: revenue {int(rng.integers(100, 999))}",
            fill=(20, 20, 20),
        )
    for bar in range(6):
        height = int(rng.integers(30, 140))
        draw.rectangle([40 + bar * 50, 540 - height, 70 + bar * 50, 540], fill=(40, 90, 160))
    return page


def _recorded_feeds(model: Any) -> dict[str, dict[str, np.ndarray]]:
    """The first feeds each graph of `model` gets for the sample page and queries."""
    feeds: dict[str, dict[str, np.ndarray]] = {}
    for role, session in model._sessions.items():  # the runtime's own feeds, at its session edge

        def run(inputs, run_options=None, _run=session.run, _role=role):
            feeds.setdefault(_role, dict(inputs))
            return _run(inputs, run_options)

        session.run = run
    model.embed_images([sample_page()])
    return feeds


def placement(folder: Path, variant: str, providers: list[Any], feeds: dict[str, dict]) -> dict:
    """{role: {"providers": {provider: nodes}, "off_first_provider": {op: nodes}}} by profiling."""
    from .manifest import read_manifest
    from .safe_fs import inside

    manifest = read_manifest(folder)
    report: dict[str, Any] = {}
    first = _name(providers[0])
    with tempfile.TemporaryDirectory(prefix="colembed-doctor-") as tmp:
        for role, entry in manifest.variants[variant].items():
            session = Session(
                inside(folder, entry.file), providers, profile_prefix=str(Path(tmp) / role)
            )
            session.run(feeds[role])
            events = json.loads(Path(session.session.end_profiling()).read_text())
            nodes = {
                e["name"]: e["args"]
                for e in events
                if e.get("cat") == "Node" and "provider" in e.get("args", {})
            }
            where = collections.Counter(args["provider"] for args in nodes.values())
            off = collections.Counter(
                args.get("op_name", "?") for args in nodes.values() if args["provider"] != first
            )
            report[role] = {
                "session_providers": session.providers,
                "providers": dict(where),
                "off_first_provider": dict(off),
            }
            del session
    return report


def parity(model: Any, reference: Any) -> dict[str, float]:
    """Max abs difference and min per-token cosine of `model` against CPU fp32 `reference`."""
    got = model.embed_images([sample_page()]) + model.embed_queries(list(SAMPLE_QUERIES))
    want = reference.embed_images([sample_page()]) + reference.embed_queries(list(SAMPLE_QUERIES))
    diff, cosine = 0.0, 1.0
    for a, b in zip(got, want):
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        diff = max(diff, float(np.abs(a64 - b64).max()))
        norms = np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1)
        cosine = min(cosine, float((np.sum(a64 * b64, axis=1) / np.maximum(norms, 1e-30)).min()))
    return {
        "max_abs_diff": diff,
        "min_token_cosine": cosine,
        "finite": bool(all(np.isfinite(a).all() for a in got)),
    }


def run_doctor(folder: str | Path, *, providers: Any = "auto", variant: str | None = None) -> dict:
    """Placement and parity report for `folder` on `providers` (see the module docstring)."""
    from .model import default_variant, load

    folder = Path(folder)
    resolved = resolve_providers(providers)
    chosen = variant or default_variant(folder, providers)
    reference = load(folder, variant=BASE_VARIANT, providers=None, verify=False)
    model = load(folder, variant=chosen, providers=providers, verify=True)
    feeds = _recorded_feeds(reference)
    facts = onnxruntime_facts()
    if _name(resolved[0]) == OPENVINO:  # OpenVINO compiles a whole graph or refuses it
        from .openvino_runtime import openvino_facts

        facts.update(openvino_facts())
        where = {
            role: {
                "session_providers": session.providers,
                "providers": {OPENVINO: "all"},
                "off_first_provider": {},
                "precision_compiled": session.precision,
            }
            for role, session in model._sessions.items()
        }
    else:
        where = placement(folder, chosen, resolved, feeds)
    return {
        **facts,
        "requested_providers": [_name(p) for p in resolved],
        "variant": chosen,
        "placement": where,
        "parity_vs_cpu_fp32": parity(model, reference),
    }


def _median_seconds(run: Any, repeats: int) -> float:
    import statistics
    import time

    run()  # warm-up: first-run allocations, kernel selection
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def candidates(variants: Any) -> list[tuple[str, str]]:
    """(provider, variant) pairs that run here: onnxruntime's CPU provider runs the folder's
    onnxruntime variants, OpenVINO (when installed) its own."""
    found = [(CPU, v) for v in variants if v not in OPENVINO_VARIANTS]
    if openvino_installed():
        found += [(OPENVINO, v) for v in variants if v in OPENVINO_VARIANTS]
    return found


def measure(
    folder: str | Path,
    *,
    threads: int | None = None,
    repeats: int = MEASURE_REPEATS,
    remember: bool = True,
) -> dict[str, Any]:
    """Time every (provider, variant) that runs here on the sample page and queries (median of
    `repeats` after a warm-up), with its fidelity to CPU fp32 on them; name the fastest and the
    fastest exact one, and (`remember`) record the latter's provider for "auto"."""
    from . import provider_choice
    from .manifest import read_manifest
    from .model import load

    folder = Path(folder)
    manifest = read_manifest(folder)
    reference = load(folder, variant=BASE_VARIANT, providers=None, threads=threads, verify=False)
    page, queries = sample_page(), list(SAMPLE_QUERIES)
    rows = []
    for provider, variant in candidates(manifest.variants):
        model = (
            reference
            if (provider, variant) == (CPU, BASE_VARIANT)
            else load(
                folder,
                variant=variant,
                threads=threads,
                verify=False,
                providers=None if provider == CPU else provider,
            )
        )
        row = {
            "provider": provider,
            "variant": variant,
            "page_s": _median_seconds(lambda m=model: m.embed_images([page]), repeats),
            "query_s": _median_seconds(lambda m=model: m.embed_queries(queries[:1]), repeats),
            "fidelity_vs_cpu_fp32": parity(model, reference),
        }
        if provider == OPENVINO:
            row["precision_compiled"] = model._sessions["vision"].precision
        check = manifest.checks.get(variant)
        if check is not None and variant != BASE_VARIANT:
            row["gate"] = {k: check.get(k) for k in ("mean_cosine", "min_cosine")}
        rows.append(row)
        del model

    def cost(row: dict[str, Any]) -> float:
        return row["page_s"] + row["query_s"]

    fastest = min(rows, key=cost)
    exact = min((r for r in rows if r["variant"] in EXACT_VARIANTS), key=cost)
    report = {"candidates": rows, "fastest": fastest, "fastest_exact": exact, "threads": threads}
    if remember:
        report["recorded_for_auto"] = str(
            provider_choice.remember(
                folder,
                {
                    "provider": exact["provider"],
                    "variant": exact["variant"],
                    "page_s": exact["page_s"],
                    "query_s": exact["query_s"],
                },
            )
        )
    return report
