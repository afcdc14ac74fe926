"""bench_embed's models: the benchmark checkpoint (random weights or the stress checkpoint, at a
family's real widths and a chosen depth), its export with the requested variants (cached, keyed by
family and depth), the plain int8 baseline, and the exporter's gate figures."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]  # the benchmarks folder

from colembed.layout import BASE_VARIANT, MANIFEST_NAME  # noqa: E402


# The export in --workdir is reused only when it was made by the exporter source it would be made
# by now: an A/B of an exporter change (--against REF) would otherwise time the cached graphs of
# whatever checkout wrote them first against REF (this has happened). The stamp sits beside
# the model folder, not in it: the exporter replaces only folders holding nothing but its own
# files (colembed_export.pipeline.destination), so a stamp inside made every re-export a refusal.
EXPORTER_STAMP = "bench_exporter.sha256"


def exporter_stamp(folder: Path) -> Path:
    """Where the fingerprint of the exporter that wrote `folder` is kept: beside it."""
    return folder.with_name(f"{folder.name}.{EXPORTER_STAMP}")


def exporter_fingerprint() -> str:
    """sha256 over the exporter package's sources and data files (paths and bytes), the colembed
    runtime's too (its layout and manifest code decide what an export writes)."""
    import hashlib
    import importlib.util

    digest = hashlib.sha256()
    for package in ("colembed_export", "colembed"):
        root = Path(importlib.util.find_spec(package).origin).parent
        for path in sorted(root.rglob("*")):
            if (
                path.is_file()
                and path.suffix in (".py", ".json")
                and "__pycache__" not in path.parts
            ):
                digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def prepare_model(args, work: Path, progress, *, stress: bool = False) -> tuple[Path, Path, Any]:
    """Build (once) and export the benchmark checkpoint: random weights, or with `stress` the
    stress checkpoint (trained-model activation traits, export/testing/tiny_qwen2.py) at the same widths."""
    from benchmarks.shared.specs import FAMILY_PRESETS, build, reduced_spec

    spec = reduced_spec(
        args.family, FAMILY_PRESETS[args.family], args.vision_depth, args.text_layers
    )
    size = {"colqwen2": "2b", "colqwen2.5": "2.5-3b", "colqwen3": "3-4b"}[args.family]
    tag = f"{'stress-' if stress else ''}{size}-v{args.vision_depth}-t{args.text_layers}"
    ckpt = work / f"ckpt-{tag}"
    if not (ckpt / "colembed_tiny.json").is_file():
        progress(f"building the {'stress' if stress else 'random-weight'} checkpoint {tag}")
        build(args.family, ckpt, spec, stress=stress)
    folder = work / f"model-{tag}"
    wanted = set(args.variants)
    have = set()
    stamp, fingerprint = exporter_stamp(folder), exporter_fingerprint()
    if (folder / MANIFEST_NAME).is_file() and stamp.is_file() and stamp.read_text() == fingerprint:
        have = set(json.loads((folder / MANIFEST_NAME).read_text())["variants"])
    elif (folder / MANIFEST_NAME).is_file():
        progress(f"re-exporting {tag}: {folder} was written by another exporter source")
    if not wanted <= have:
        from colembed_export.pipeline.exporter import export_model
        from colembed_export.variants.write import VariantsRefused

        variants = sorted(wanted - {BASE_VARIANT, INT8_BASELINE})
        progress(f"exporting {tag} with variants {variants}")
        start = time.perf_counter()
        try:
            export_model(
                ckpt,
                folder,
                overwrite=True,
                variants=variants,
                int8_weight_passes=getattr(args, "int8_weight_passes", None),
                progress=progress,
            )
        except VariantsRefused as e:
            # A variant that misses its accuracy gate is a result, not a crash: the folder is
            # written with the others; record the refusal and benchmark what was written.
            progress(f"gate missed, benchmarking without {e.refused}: {e}")
            GATE_MISSES.update({f"{v}{' (stress)' if stress else ''}": str(e) for v in e.refused})
        progress(f"export took {time.perf_counter() - start:.0f} s")
        stamp.write_text(fingerprint)
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
    from colembed_export.graphs.edits import finish
    from colembed_export.variants.recipes import quantize_int8
    from colembed_export.variants.write import save_graph

    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    if INT8_BASELINE in manifest["variants"]:
        return
    progress("writing the plain int8 baseline")
    entries = {}
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        for role, fp32 in manifest["variants"][BASE_VARIANT].items():
            model = quantize_int8(folder / fp32["file"], Path(tmp), calibration=None)
            finish(model)
            file, data = save_graph(
                model,
                folder,
                f"{role}.{INT8_BASELINE}.onnx",
                external=fp32["data_file"] is not None,
            )
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
            if name != BASE_VARIANT and "mean_cosine" in figures:
                out.setdefault(name, {})[label] = {
                    k: figures.get(k)
                    for k in (
                        "mean_cosine",
                        "min_cosine",
                        "finite",
                        "ranking",
                        "gate",
                        "tokens",
                        "non_finite_tokens",
                        "fp16_gemm_peak",
                        "fp16_gemm_peak_at",
                        "fp16_kept_fp32",
                    )
                }
    return out


GATE_MISSES: dict[str, str] = {}  # variant -> the exporter's message, when a gate was missed
