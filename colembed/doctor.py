"""`colembed doctor`: on the user's machine, where do the graphs run and do they agree with CPU fp32?

Written for a Windows user with onnxruntime-directml, who cannot be reproduced here:
- placement: each graph of the chosen variant runs once in an onnxruntime session with profiling
  on, fed the very inputs a real page and query produce; the profile's node events name the
  execution provider of every node, so the report says how many nodes ran where and which ops
  fell back to the CPU (onnxruntime falls back silently);
- parity: the same sample page and queries through the chosen variant on the chosen providers and
  through fp32 on the CPU; the report gives the max absolute difference and the min per-token
  cosine of the final embeddings.
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
from .sessions import Session, _name, onnxruntime_facts, resolve_providers

SAMPLE_QUERIES = ("What was the revenue in 2023?", "operating margin by region")


def sample_page() -> Any:
    """A deterministic page with text lines and a bar chart."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(0)
    page = Image.new("RGB", (420, 560), "white")
    draw = ImageDraw.Draw(page)
    for row in range(14):
        draw.text((30, 20 + row * 26), f"line {row}: revenue {int(rng.integers(100, 999))}",
                  fill=(20, 20, 20))
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
            session = Session(inside(folder, entry.file), providers,
                              profile_prefix=str(Path(tmp) / role))
            session.run(feeds[role])
            events = json.loads(Path(session.session.end_profiling()).read_text())
            nodes = {e["name"]: e["args"] for e in events
                     if e.get("cat") == "Node" and "provider" in e.get("args", {})}
            where = collections.Counter(args["provider"] for args in nodes.values())
            off = collections.Counter(args.get("op_name", "?") for args in nodes.values()
                                      if args["provider"] != first)
            report[role] = {"session_providers": session.providers,
                            "providers": dict(where), "off_first_provider": dict(off)}
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
    return {"max_abs_diff": diff, "min_token_cosine": cosine, "finite": bool(
        all(np.isfinite(a).all() for a in got))}


def run_doctor(folder: str | Path, *, providers: Any = "auto", variant: str | None = None) -> dict:
    """Placement and parity report for `folder` on `providers` (see the module docstring)."""
    from .model import default_variant, load

    folder = Path(folder)
    resolved = resolve_providers(providers)
    chosen = variant or default_variant(folder, providers)
    reference = load(folder, variant=BASE_VARIANT, providers=None, verify=False)
    model = load(folder, variant=chosen, providers=providers, verify=True)
    feeds = _recorded_feeds(reference)
    return {
        **onnxruntime_facts(),
        "requested_providers": [_name(p) for p in resolved],
        "variant": chosen,
        "placement": placement(folder, chosen, resolved, feeds),
        "parity_vs_cpu_fp32": parity(model, reference),
    }
