"""Reduced-precision variants of the checked fp32 graphs: written, checked against fp32, recorded.

The exporter calls `write_variants` after the fp32 graphs passed their check against torch. Each
variant is a pair of graph files derived from the fp32 ones, selected at load time by name
(`colembed.load(folder, variant="int8")`) through the manifest. What each variant is lives in
`recipes.py`, the graph surgery in `graph_edits.py`, the gates' measurements in `evaluation.py`.

A variant that misses its gate raises ExportError naming the variant and its figures; the
exporter then removes the staging folder, so nothing is written. Every written graph is sorted,
has `Reshape(allowzero=1)` cleared (DirectML rejects it, graphs.md) and is saved with external data
(`<graph file>_data`) when the fp32 graph was or when its weights exceed the protobuf-safe limit.
This module imports onnx and onnxruntime's quantisation tools when called, never torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from colembed.errors import ExportError
from colembed.manifest import GraphEntry

from .onnx_io import EXTERNAL_DATA_THRESHOLD
from .recipes import (
    CALIBRATED_RECIPES,
    GATES,
    VARIANTS,
    Gate,
    VariantSpec,
    make_graph,
    parse_variants,
    quiet_quantisers,
)

log = logging.getLogger("colembed_export")


def _weight_bytes(model: Any) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values()
               if v.const_value is not None)


def save_graph(model: Any, folder: Path, file: str, external: bool) -> tuple[str, str | None]:
    """Write `model` (onnx_ir) as `folder/file` (+ `file_data` when external); returns the names."""
    import onnx
    import onnx_ir as ir

    path = folder / file
    data_name = file + "_data"
    for stale in (path, folder / data_name):
        if stale.exists():
            stale.unlink()
    external = external or _weight_bytes(model) > EXTERNAL_DATA_THRESHOLD
    if not external:  # tensors a quantiser left in its own external file come inline
        ir.external_data.load_to_model(model)
    ir.save(model, path, external_data=data_name if external else None,
            size_threshold_bytes=1024 if external else 0)
    try:
        onnx.checker.check_model(os.fspath(path), full_check=False)
    except onnx.checker.ValidationError as e:
        raise ExportError(f"{file}: onnx.checker rejected the variant graph: {e}") from e
    return file, (data_name if external else None)


def no_step(name: str) -> contextlib.AbstractContextManager:
    """The `step` of callers that do not measure the variant step's parts."""
    return contextlib.nullcontext()


def _write_graphs(staging: Path, graphs: dict[str, GraphEntry], names: Sequence[str],
                  say: Callable[[str], None], step: Callable[[str], Any] = no_step
                  ) -> tuple[dict[str, dict[str, GraphEntry]], dict[str, dict[str, Any]]]:
    """Each variant's graph files (shared where two variants use the same recipe for a role), and
    per variant what its recipes measured ({figure: {role: value}}, for its gate). `step(name)`
    wraps each part (the exporter's StepMeter: time and peak RSS of each)."""
    from .evaluation import calibration_feeds
    from .graph_edits import finish

    entries: dict[str, dict[str, GraphEntry]] = {}
    measured: dict[str, dict[str, Any]] = {}
    written: dict[tuple[str, str], tuple[GraphEntry, dict[str, Any]]] = {}
    calibration = None
    with tempfile.TemporaryDirectory(prefix=".variants-", dir=staging.parent) as tmp:
        for name in names:
            entries[name], measured[name] = {}, {}
            for role, fp32 in graphs.items():
                recipe = VARIANTS[name].recipes[role]
                if (role, recipe) not in written:
                    if recipe in CALIBRATED_RECIPES and calibration is None:
                        with step("variants: record the calibration feeds"):
                            calibration = calibration_feeds(staging)
                    say(f"writing the {role} graph of the {name} variant ({recipe})")
                    with step(f"variants: make the {role} graph ({recipe})"):
                        model, figures = make_graph(
                            recipe, staging / fp32.file, Path(tmp),
                            calibration[role] if recipe in CALIBRATED_RECIPES else None)
                        cleared = finish(model)
                    with step(f"variants: save the {role} graph ({recipe})"):
                        file, data_file = save_graph(model, staging, f"{role}.{recipe}.onnx",
                                                     external=fp32.data_file is not None)
                        del model
                    log.info("wrote %s (cleared %d Reshape allowzero)", file, cleared)
                    written[(role, recipe)] = (GraphEntry(file=file, data_file=data_file,
                                                          opset=fp32.opset, contract=fp32.contract),
                                               figures)
                entries[name][role], figures = written[(role, recipe)]
                for key, value in figures.items():
                    measured[name].setdefault(key, {})[role] = value
    return entries, measured


def write_variants(
    staging: Path,
    graphs: dict[str, GraphEntry],
    variants: Sequence[str],
    *,
    write_manifest: Callable[[dict[str, dict[str, GraphEntry]]], None],
    progress: Callable[[str], None] | None = None,
    step: Callable[[str], Any] = no_step,
) -> dict[str, dict[str, Any]]:
    """Write each variant's graphs into `staging`, list them in the manifest, gate them vs fp32.

    `graphs` are the checked fp32 entries by role. Returns {variant: figures} for the manifest's
    `checks`; raises ExportError (naming the variant and its figures) when a gate is missed.
    `step(name)` wraps each part (writing each graph, each gate run) to time and measure it.
    """
    from .evaluation import evaluate_variants

    say = progress or (lambda message: log.info(message))
    names = parse_variants(variants)
    if not names:
        return {}
    staging = Path(staging)
    quiet_quantisers()
    entries, measured = _write_graphs(staging, graphs, names, say, step)
    write_manifest(entries)
    say("checking the variants against fp32")
    results, failures = evaluate_variants(staging, names, {n: VARIANTS[n].gate for n in names},
                                          measured, step=step)
    for name, figures in results.items():
        figures["recipes"] = dict(VARIANTS[name].recipes)
        say(f"{name}: per-token cosine to fp32 mean {figures['mean_cosine']:.5f}, min "
            f"{figures['min_cosine']:.5f}; top-1 agreement {figures['ranking']['top1_agreement']:.3f}")
    if failures:
        error = ExportError("variant check failed against fp32; nothing was written:\n  "
                            + "\n  ".join(failures))
        error.checks = results  # every variant's figures, for a benchmark that reports a refusal
        raise error
    return results


__all__ = ["GATES", "VARIANTS", "Gate", "VariantSpec", "parse_variants", "save_graph",
           "write_variants"]
