"""Reduced-precision variants of the checked fp32 graphs: written, checked against fp32, recorded.

The exporter calls `write_variants` after the fp32 graphs passed their check against torch. Each
variant is a pair of graph files derived from the fp32 ones, selected at load time by name
(`colembed.load(folder, variant="int8")`) through the manifest. What each variant is lives in
`recipes.py`, the graph surgery in `graphs/edits.py`, the gates' measurements in `variants/gates.py`.

A variant that misses its gate is not written: its graph files are removed from the staging
folder and the manifest, and `VariantsRefused` (an ExportError naming the variant and its
figures) tells the exporter, which writes the checked fp32 graphs and every variant that passed
before it raises it (a refusal at the end of a half-hour 4B export used to discard the checked fp32
graphs with it). Every written graph is sorted,
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
from colembed.fidelity import describe_token
from colembed.manifest import GraphEntry

from ..graphs.onnx_io import EXTERNAL_DATA_THRESHOLD
from .sharp_scores import vision_stays_fp32
from .recipes import (
    CALIBRATED_RECIPES,
    INT8_RECIPES,
    OPENVINO_RECIPES,
    GATES,
    VARIANTS,
    Gate,
    VariantSpec,
    make_graph,
    parse_variants,
    quiet_quantisers,
    recipe_attempts,
    recipe_label,
    weight_passes_of,
)

log = logging.getLogger("colembed_export")


def _weight_bytes(model: Any) -> int:
    return sum(
        v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None
    )


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
    ir.save(
        model,
        path,
        external_data=data_name if external else None,
        size_threshold_bytes=1024 if external else 0,
    )
    try:
        onnx.checker.check_model(os.fspath(path), full_check=False)
    except onnx.checker.ValidationError as e:
        raise ExportError(f"{file}: onnx.checker rejected the variant graph: {e}") from e
    return file, (data_name if external else None)


def no_step(name: str) -> contextlib.AbstractContextManager:
    """The `step` of callers that do not measure the variant step's parts."""
    return contextlib.nullcontext()


class _GraphWriter:
    """Writes variant graphs into the staging folder, each (role, recipe) once: a graph file two
    variants (or two attempts) use is written once and shared; the calibration feeds are
    recorded once, when the first calibrated recipe needs them, and kept for a later attempt.
    `step(name)` wraps each part (the exporter's StepMeter: time and peak RSS of each)."""

    def __init__(
        self,
        staging: Path,
        graphs: dict[str, GraphEntry],
        say: Callable[[str], None],
        step: Callable[[str], Any] = no_step,
    ) -> None:
        self.staging, self.graphs, self.say, self.step = staging, graphs, say, step
        self.written: dict[tuple[str, str], tuple[GraphEntry, dict[str, Any]]] = {}
        self.calibration: dict[str, Any] | None = None
        self.sharp: list[Any] | None = None  # the text graph's sharp attentions, measured once

    def sharp_attentions(self) -> list[Any]:
        """The fp32 text graph's sharp attentions on the calibration feeds (sharp_scores.py),
        which every int8 recipe keeps fp32; measured when the first int8 graph needs them."""
        from .gates import calibration_feeds
        from .sharp_scores import sharp_attentions

        if self.sharp is None:
            if self.calibration is None:
                with self.step("variants: record the calibration feeds"):
                    self.calibration = calibration_feeds(self.staging)
            text = self.graphs.get("text")
            with self.step("variants: measure the text attentions' score spreads"):
                self.sharp = (
                    sharp_attentions(self.staging / text.file, self.calibration["text"])
                    if text is not None
                    else []
                )
        return self.sharp

    def write(
        self, plan: dict[str, dict[str, str]]
    ) -> tuple[dict[str, dict[str, GraphEntry]], dict[str, dict[str, Any]]]:
        """Each variant's graph entries for its recipes in `plan` ({variant: {role: recipe}}),
        and per variant what its recipes measured ({figure: {role: value}}, for its gate)."""
        from .gates import calibration_feeds
        from ..graphs.edits import finish, spilled_initializers

        entries: dict[str, dict[str, GraphEntry]] = {}
        measured: dict[str, dict[str, Any]] = {}
        with tempfile.TemporaryDirectory(prefix=".variants-", dir=self.staging.parent) as tmp:
            for name, recipes in plan.items():
                entries[name], measured[name] = {}, {}
                for role, fp32 in self.graphs.items():
                    recipe = recipes[role]
                    sharp = self.sharp_attentions() if recipe in INT8_RECIPES else []
                    if (role, recipe) not in self.written and role == "vision":
                        if sharp and vision_stays_fp32(sharp):
                            self.written[(role, recipe)] = (fp32, vision_kept_fp32(sharp))
                    if (role, recipe) not in self.written:
                        if recipe in CALIBRATED_RECIPES and self.calibration is None:
                            with self.step("variants: record the calibration feeds"):
                                self.calibration = calibration_feeds(self.staging)
                        self.say(f"writing the {role} graph of the {name} variant ({recipe})")
                        # the new weights wait on disk, not in memory, until the graph is saved
                        with spilled_initializers(Path(tmp) / f"{role}.{recipe}.spill"):
                            with self.step(f"variants: make the {role} graph ({recipe})"):
                                model, figures = make_graph(
                                    recipe,
                                    self.staging / fp32.file,
                                    Path(tmp),
                                    self.calibration[role]
                                    if recipe in CALIBRATED_RECIPES
                                    else None,
                                    sharp=sharp if role == "text" else (),
                                )
                                cleared = finish(model)
                            with self.step(f"variants: save the {role} graph ({recipe})"):
                                file, data_file = save_graph(
                                    model,
                                    self.staging,
                                    f"{role}.{recipe}.onnx",
                                    external=fp32.data_file is not None,
                                )
                                del model
                        log.info("wrote %s (cleared %d Reshape allowzero)", file, cleared)
                        if recipe in OPENVINO_RECIPES:  # the form must be OpenVINO's exactly
                            from ..graphs.openvino import openvino_problems

                            problems = openvino_problems(self.staging / file)
                            if problems:
                                raise ExportError(
                                    f"{file}: not in OpenVINO's form: " + "; ".join(problems)
                                )
                        self.written[(role, recipe)] = (
                            GraphEntry(
                                file=file,
                                data_file=data_file,
                                opset=fp32.opset,
                                contract=fp32.contract,
                            ),
                            figures,
                        )
                    entries[name][role], figures = self.written[(role, recipe)]
                    for key, value in figures.items():
                        measured[name].setdefault(key, {})[role] = value
        return entries, measured

    def remove_unused(self, entries: dict[str, dict[str, GraphEntry]]) -> list[str]:
        """Delete the graph files this writer wrote that no variant in `entries` lists (a refused
        attempt's), so the folder and its manifest hold only what is written; returns them."""
        used = {e.file for graphs in entries.values() for e in graphs.values()}
        fp32 = {e.file for e in self.graphs.values()}  # a variant may reuse an fp32 graph
        removed = []
        for key, (entry, _) in list(self.written.items()):
            if entry.file not in used and entry.file not in fp32:
                for name in (entry.file, entry.data_file):
                    if name and (self.staging / name).exists():
                        (self.staging / name).unlink()
                        removed.append(name)
                del self.written[key]
        return removed


def vision_kept_fp32(sharp: Sequence[Any]) -> dict[str, Any]:
    """The figures of an int8 vision graph kept fp32 (sharp_scores.vision_stays_fp32): the
    variant reads the fp32 vision graph file itself."""
    on_pages = ", ".join(
        f"{a.path} ({a.spread:.0f} logits > {a.limit:.0f})" for a in sharp if a.on_pages
    )
    return {
        "int8_kept_fp32": {
            "every MatMul": f"its features form the keys of sharp text attentions on pages: "
            f"{on_pages}"
        }
    }


def _write_graphs(
    staging: Path,
    graphs: dict[str, GraphEntry],
    plan: dict[str, dict[str, str]],
    say: Callable[[str], None],
    step: Callable[[str], Any] = no_step,
) -> tuple[dict[str, dict[str, GraphEntry]], dict[str, dict[str, Any]]]:
    """Each variant's graph files for its recipes in `plan` ({variant: {role: recipe}}, e.g.
    `recipe_attempts(name)[0]`) and what its recipes measured, without the gate (the fidelity
    benchmarks judge one recipe)."""
    return _GraphWriter(staging, graphs, say, step).write(plan)


def verdict(figures: dict[str, Any]) -> dict[str, Any]:
    """What the manifest keeps of a refused attempt: its recipes, its overall and per-bucket
    figures, its worst item by name and the gate's misses."""
    worst = figures["worst_item"]
    return {
        "recipes": figures["recipes"],
        "int8_weight_passes": figures.get("int8_weight_passes"),
        "mean_cosine": figures["mean_cosine"],
        "min_cosine": figures["min_cosine"],
        "buckets": figures["buckets"],
        "worst_item": worst,
        "worst_item_min": figures["items"][worst]["min"] if worst else None,
        "misses": figures.get("misses", []),
    }


def summary(name: str, figures: dict[str, Any]) -> str:
    """One line on a variant's check: its figures, which recipe was written and, when an attempt
    before it was refused, that attempt's figures and worst item (the CLI prints it)."""
    line = (
        f"{name}: per-token cosine to fp32 mean {figures['mean_cosine']:.5f}, min "
        f"{figures['min_cosine']:.5f}"
    )
    if "ranking" in figures:
        line += f"; top-1 agreement {figures['ranking']['top1_agreement']:.3f}"
    if figures.get("worst_token"):
        line += f"; worst query {describe_token(figures['worst_token'])}"
    if weight_passes_of(figures.get("recipes") or {}) is not None:
        line += f"; {recipe_label(figures['recipes'])}"
    for refused in figures.get("refused_attempts", []):
        line += (
            f" ({recipe_label(refused['recipes'])} refused by the gate: mean "
            f"{refused['mean_cosine']:.5f}, min {refused['min_cosine']:.5f}, worst item "
            f"{refused['worst_item']!r} min {refused['worst_item_min']:.5f})"
        )
    return line


class VariantsRefused(ExportError):
    """One or more variants missed their gates (or the gate set cannot judge any): `refused` names
    them, `kept` the variants that passed and stay in the staging folder's manifest, `checks`
    every variant's figures (a benchmark reports a refusal from them). The exporter writes the
    folder without the refused ones, then raises this with `written` set to it."""

    def __init__(
        self,
        message: str,
        *,
        refused: Sequence[str],
        kept: Sequence[str],
        checks: dict[str, dict[str, Any]],
    ) -> None:
        super().__init__(message)
        self.refused, self.kept, self.checks = list(refused), list(kept), checks
        self.written: Path | None = None


def write_variants(
    staging: Path,
    graphs: dict[str, GraphEntry],
    variants: Sequence[str],
    *,
    write_manifest: Callable[[dict[str, dict[str, GraphEntry]]], None],
    progress: Callable[[str], None] | None = None,
    step: Callable[[str], Any] = no_step,
    int8_weight_passes: int | None = None,
) -> dict[str, dict[str, Any]]:
    """Write each variant's graphs into `staging`, list them in the manifest, gate them vs fp32.

    Each variant is made by the first of its recipe sets (`recipes.recipe_attempts`) whose
    graphs pass its gate: the fastest recipe that holds (int8: one code per weight, else two).
    A refused attempt's graphs are deleted, the next attempt's written and gated against the same
    fp32 run; the written variant's figures record its recipes (`recipes`, `int8_weight_passes`)
    and each refused attempt's verdict (`refused_attempts`). `int8_weight_passes` forces one int8
    recipe (no fallback). `graphs` are the checked fp32 entries by role. Returns {variant:
    figures} for the manifest's `checks`. A variant none of whose attempts passed is removed
    (its files and its manifest entry) and `VariantsRefused` names every refused attempt with its
    figures and worst item, after the variants that passed are written and listed. `step(name)`
    wraps each part (writing each graph, each gate run) to time and measure it.
    """
    from .gates import evaluate_variants, fp32_reference, refusal_lines

    say = progress or (lambda message: log.info(message))
    names = parse_variants(variants)
    if not names:
        return {}
    staging = Path(staging)
    quiet_quantisers()
    attempts = {n: recipe_attempts(n, int8_weight_passes) for n in names}
    # fp32's run of the gate set first: it is what every variant is judged against, and when it
    # refuses (a ranking set fp32 cannot tell apart) no variant can be judged, so none is made.
    # Measured at Qwen3-VL-4B size, full depth, random weights: the refusal came after 9 min of
    # making variant graphs that could never have been written
    # (results/export/export-colqwen3-full-variants.md).
    say("running the gate set through fp32, the reference every variant is judged against")
    try:
        reference = fp32_reference(staging, step=step)
    except ExportError as error:
        raise VariantsRefused(
            f"no variant was made ({', '.join(names)}): {error}", refused=names, kept=[], checks={}
        ) from error
    writer = _GraphWriter(staging, graphs, say, step)
    entries, measured = writer.write({n: attempts[n][0] for n in names})
    write_manifest(entries)
    say("checking the variants against fp32")
    gates = {n: VARIANTS[n].gate for n in names}
    results: dict[str, dict[str, Any]] = {}
    refused: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    lines: dict[str, list[str]] = {n: [] for n in names}
    found, _ = evaluate_variants(staging, names, gates, measured, step=step, reference=reference)
    tried = 1  # attempts made of every variant in `found`
    while True:
        retry = []
        for name, figures in found.items():
            figures["recipes"] = attempts[name][tried - 1]
            if weight_passes_of(figures["recipes"]) is not None:
                figures["int8_weight_passes"] = weight_passes_of(figures["recipes"])
            results[name] = figures
            if "misses" not in figures:
                say(summary(name, figures))
                continue
            label = recipe_label(figures["recipes"])
            lines[name] += refusal_lines(name, figures, label)
            if tried < len(attempts[name]):
                refused[name].append(verdict(figures))
                say(
                    f"{name}: {label} refused by the gate (mean {figures['mean_cosine']:.5f}, "
                    f"min {figures['min_cosine']:.5f}; worst item {figures['worst_item']!r}); "
                    f"trying {recipe_label(attempts[name][tried])}"
                )
                retry.append(name)
        if not retry:
            break
        with step(
            "variants: the next recipe for "
            + ", ".join(f"{n} ({recipe_label(attempts[n][tried])})" for n in retry)
        ):
            # the refused attempt's files go first (unless another variant uses them): the disk
            # holds one attempt's graphs at a time
            writer.remove_unused({n: e for n, e in entries.items() if n not in retry})
            again, measured = writer.write({n: attempts[n][tried] for n in retry})
            entries.update(again)
            write_manifest(entries)
            found, _ = evaluate_variants(
                staging, retry, gates, measured, step=step, reference=reference
            )
        tried += 1
    for name, figures in results.items():
        if refused[name]:
            figures["refused_attempts"] = refused[name]
    failed = [name for name in names if "misses" in results[name]]
    if failed:
        kept = {n: e for n, e in entries.items() if n not in failed}
        writer.remove_unused(kept)
        write_manifest(kept)
        raise VariantsRefused(
            f"variant check failed against fp32; not written: {', '.join(failed)}:\n  "
            + "\n  ".join(line for name in failed for line in lines[name]),
            refused=failed,
            kept=list(kept),
            checks=results,
        )
    return results


__all__ = [
    "GATES",
    "VARIANTS",
    "Gate",
    "VariantSpec",
    "VariantsRefused",
    "parse_variants",
    "save_graph",
    "summary",
    "write_variants",
]
