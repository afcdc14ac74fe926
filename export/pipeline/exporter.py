"""`export_model`: a ColQwen2-family checkpoint in, one verified colembed model folder out.

What differs per family (loader, image graph, what the reference needs) is declared once in
`families.py` over `colembed.families`; every step below is one code path for all families.

In steps, each a function readable and callable alone (as optimum's export-then-validate):
resolve -> stand-in model (where the graph weights are streamed, `streamed_weights.py`) ->
reference outputs (with the check: from the stand-in run layer by layer, `offloaded.py`, or from
the whole loaded model where the weights are not streamed) -> export graphs -> scorer
-> processor files -> verify -> variants -> commit. `export_model` only sequences them, measures
each (time, peak RSS) and frees what the next no longer needs: the torch model is gone before
onnxruntime loads the graphs, so the two never hold the weights at once.

The folder is assembled in a marked staging folder beside the destination and moved into place
only after every check passes (`colembed.safe_fs`), so a failed or interrupted export never leaves
a half-written model, and only a colembed export is ever replaced (`destination.py`).
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import shutil
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

from colembed import safe_fs
from colembed.contracts import GraphContract
from colembed.errors import ExportError
from colembed.families import VisionAttention
from colembed.integrity import describe_file
from colembed.layout import BASE_VARIANT
from colembed.manifest import FORMAT, FORMAT_VERSION, MANIFEST_NAME, GraphEntry, Manifest

from ..families.checkpoint import (
    CheckpointSource,
    architecture_facts,
    check_architecture,
    check_required_files,
    fingerprint,
    resolve_checkpoint,
)
from ..constants import (
    ARCHITECTURE,
    EMBEDDING_TOLERANCE,
    FEATURE_TOLERANCE,
    GRAPH_FILES,
    OPSET,
    OPTIONAL_FILES,
    REQUIRED_FILES,
    SCORER_FILE,
    SCORER_OPSET,
)
from .destination import check_destination, is_export_folder
from .plan import check_plan, plan_export
from ..families import ExportFamily, export_family
from ..measure import StepMeter
from ..graphs.onnx_io import export_graph
from ..graphs.streamed_weights import StandInModel, streaming_applies
from ..families.preprocess_config import read_preprocess_config

log = logging.getLogger("colembed_export")


@dataclass
class ExportReport:
    folder: Path
    manifest: Manifest
    check: dict[str, Any] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)  # StepRecord dicts, in order


@dataclass(frozen=True)
class Resolved:
    """A checkpoint found, checked and fingerprinted, and where its export goes."""

    checkpoint: CheckpointSource
    fingerprint: str
    out: Path
    family: ExportFamily


@dataclass(frozen=True)
class ModelFacts:
    """What the manifest needs from the loaded model; outlives the torch model."""

    preprocess: Any  # colembed PreprocessConfig
    contracts: dict[str, GraphContract]
    architecture: dict[str, Any]
    embedding_dim: int
    family: str
    vision_attention: VisionAttention
    vision_extras: Any = None  # colembed.families.VisionExtras (ColQwen3) or None


def resolve(
    source: str | os.PathLike, out_dir: str | os.PathLike, *, revision: str | None, overwrite: bool
) -> Resolved:
    """Find the checkpoint, refuse what cannot be exported or written, before any heavy work."""
    checkpoint = resolve_checkpoint(source, revision)
    family = export_family(check_architecture(checkpoint.folder).name)
    check_required_files(checkpoint.folder)
    digest = fingerprint(checkpoint.folder)
    out = check_destination(out_dir, checkpoint.folder, digest, overwrite)
    return Resolved(checkpoint=checkpoint, fingerprint=digest, out=out, family=family)


def load(folder: Path, family: ExportFamily) -> tuple[Any, ModelFacts]:
    """The strict fp32 torch model and the facts the graphs and the manifest are built from."""
    model = family.load(folder)
    return model, model_facts(model.config, folder, family)


def model_facts(config: Any, folder: Path, family: ExportFamily) -> ModelFacts:
    """What the graphs and the manifest need from a model's `ColQwen2Config` (a loaded model's or
    a stand-in's: no weight is read)."""
    preprocess = read_preprocess_config(folder)
    text_hidden = config.vlm_config.text_config.hidden_size
    vision_config = config.vlm_config.vision_config.to_dict()
    merged = family.family.merger_width(vision_config, folder / "config.json")
    if merged != text_hidden:
        raise ExportError(
            f"{folder / 'config.json'}: the vision merger gives {merged}-wide "
            f"features ({family.family.vision_names.merger_out}), the language "
            f"model is {text_hidden} wide"
        )
    extras = family.family.extras(vision_config, folder / "config.json")
    contracts = family.family.contracts(
        patch_dim=preprocess.patch_dim,
        vision_head_dim=preprocess.vision_head_dim,
        text_hidden=text_hidden,
        embedding_dim=config.embedding_dim,
        extras=extras,
    )
    attention = family.family.vision_attention(vision_config, folder / "config.json")
    return ModelFacts(
        preprocess=preprocess,
        contracts=contracts,
        architecture=architecture_facts(config, family.family),
        embedding_dim=config.embedding_dim,
        family=family.family.name,
        vision_attention=attention,
        vision_extras=extras,
    )


def export_graphs(
    folder: Path,
    family: ExportFamily,
    facts: ModelFacts,
    staging: Path,
    *,
    opset: int,
    external_data: bool | None,
    meter: StepMeter,
    standin: Any = None,
) -> dict[str, GraphEntry]:
    """The image and text graphs, one at a time, written straight to disk.

    With `standin` (a `streamed_weights.StandInModel`) both graphs are traced from it and each
    weight is written from the checkpoint file one tensor at a time (streamed_weights.py): memory
    holds the graph being traced, not the weights. Without it (checkpoints `streaming_applies`
    refuses) each graph is traced from a fresh load: the weights are memory-mapped from the
    safetensors file and pages once read stay resident until the whole model is freed (dropping a
    submodule releases nothing), so a fresh load per graph keeps only that graph's weights
    resident (benchmarks/results/export/export.md).
    """
    import torch

    from ..families.qwen2.graphs import ONNX_TRANSLATIONS, example_inputs

    graphs: dict[str, GraphEntry] = {}
    for role, wrapper in (("vision", family.image_graph), ("text", family.text_graph_of)):
        with meter.step(f"export the {role} graph"), torch.no_grad():
            model = standin.model if standin is not None else family.load(folder)
            args = example_inputs(
                model, facts.preprocess, facts.vision_attention, facts.vision_extras
            )[role]
            module = wrapper(model).eval()
            if role == "text" and family.text_example_inputs is not None:
                args = family.text_example_inputs(module)
            info = export_graph(
                module,
                args,
                facts.contracts[role],
                staging / GRAPH_FILES[role],
                opset=opset,
                external_data=external_data,
                translations=ONNX_TRANSLATIONS,
                before_save=(
                    None if standin is None else partial(standin.stream_initializers, graph=module)
                ),
            )
            del model, module
        graphs[role] = GraphEntry(
            file=info["file"],
            data_file=info["data_file"],
            opset=opset,
            contract=facts.contracts[role],
        )
    return graphs


def write_scorer(staging: Path) -> GraphEntry:
    """The MaxSim scorer graph (torch-free builder in colembed) written beside the model graphs."""
    from colembed import maxsim_graph

    maxsim_graph.write_maxsim_graph(staging / SCORER_FILE)
    return GraphEntry(file=SCORER_FILE, contract=maxsim_graph.MAXSIM_CONTRACT, opset=SCORER_OPSET)


def copy_processor_files(checkpoint: Path, staging: Path) -> list[str]:
    """The tokenizer and processor files the runtime reads (and configs kept for provenance)."""
    copied = []
    for name in REQUIRED_FILES + OPTIONAL_FILES:
        if (checkpoint / name).is_file():
            shutil.copyfile(checkpoint / name, staging / name)
            copied.append(name)
    return copied


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    found = {}
    for dist in (
        "colembed",
        "torch",
        "transformers",
        "onnx",
        "onnxscript",
        "onnxruntime",
        "numpy",
        "tokenizers",
        "pillow",
    ):
        try:
            found[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return found


def manifest_dict(
    resolved: Resolved,
    facts: ModelFacts,
    staging: Path,
    *,
    name: str | None,
    random_weights: bool,
    variants: dict[str, dict[str, GraphEntry]],
    scorer: GraphEntry,
    checks: dict[str, Any],
) -> dict[str, Any]:
    """The manifest as plain JSON data; every file in `staging` is described."""
    files = sorted(
        p.name
        for p in staging.iterdir()
        if p.is_file() and p.name not in (MANIFEST_NAME, safe_fs.STAGING_MARKER)
    )
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model": {
            "name": name or resolved.out.name,
            "source": resolved.checkpoint.source,
            "revision": resolved.checkpoint.revision,
            "architecture": ARCHITECTURE,
            "checkpoint_sha256": resolved.fingerprint,
            "random_weights": bool(random_weights),
        },
        "family": facts.family,
        "vision_attention": facts.vision_attention.to_dict(),
        **({"vision_extras": facts.vision_extras.to_dict()} if facts.vision_extras else {}),
        "embedding_dim": facts.embedding_dim,
        "preprocess": facts.preprocess.to_dict(),
        "architecture": facts.architecture,
        "variants": {
            v: {role: g.to_dict() for role, g in graphs.items()} for v, graphs in variants.items()
        },
        "scorer": scorer.to_dict(),
        "files": {f: describe_file(staging / f) for f in files},
        "checks": checks,
        "versions": _versions(),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def verify(staging: Path, reference, *, tolerance: float, feature_tolerance: float) -> dict:
    """The staged folder through colembed's runtime against the torch model's kept outputs."""
    from .verify import compare_with_reference

    return compare_with_reference(
        staging, reference, tolerance=tolerance, feature_tolerance=feature_tolerance
    )


def variants_step(
    staging: Path,
    graphs: dict[str, GraphEntry],
    names: Sequence[str],
    write: Callable[[dict[str, dict[str, GraphEntry]]], None],
    progress: Callable[[str], None],
    meter: StepMeter | None = None,
    int8_weight_passes: int | None = None,
) -> dict[str, Any]:
    """Derive and gate the requested variants (export/variants/write.py owns how, including which
    recipe each gets); each part of the step is a sub-step of `meter` (where the step's peak RSS
    arises)."""
    from ..variants.write import no_step, write_variants

    return write_variants(
        staging,
        graphs,
        names,
        write_manifest=write,
        progress=progress,
        step=meter.step if meter is not None else no_step,
        int8_weight_passes=int8_weight_passes,
    )


def commit(staging: Path, out: Path) -> Path:
    """Move the finished folder into place, replacing only a colembed export."""
    return safe_fs.commit_folder(staging, out, replaceable=is_export_folder)


def export_model(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    revision: str | None = None,
    name: str | None = None,
    opset: int = OPSET,
    check: bool = True,
    tolerance: float = EMBEDDING_TOLERANCE,
    feature_tolerance: float = FEATURE_TOLERANCE,
    overwrite: bool = False,
    external_data: bool | None = None,
    variants: Sequence[str] = (),
    int8_weight_passes: int | None = None,
    random_weights: bool = False,
    progress: Callable[[str], None] | None = None,
    base: str | os.PathLike | None = None,
    source_label: str | None = None,
    stream_weights: bool = True,
    max_memory: float | None = None,
) -> ExportReport:
    """Export a ColQwen2-family checkpoint to a colembed model folder: transformers
    `ColQwen2ForRetrieval` over Qwen2-VL or Qwen2.5-VL, or colpali-engine's ColQwen2.5 layout.

    `source` is a local folder or a Hugging Face repo id (`revision` pins it). With `check` (the
    default) the exported graphs are run with onnxruntime through the colembed runtime on sample
    pages and queries and compared with the unpatched torch model; beyond `tolerance` (max abs
    difference per token of the final embeddings) or `feature_tolerance` (image features, max abs
    difference relative to their own scale) nothing is written and ExportError lists every
    comparison with its figure. `variants` (e.g. ("int8", "int4", "fp16")) are derived from the
    checked fp32 graphs, each gated against fp32, each by the fastest of its recipes that passes
    (int8: one int8 code per weight, two when the gate refuses one; `int8_weight_passes` forces
    one, export/variants/recipes.py `recipe_attempts`); a variant that misses its gate is left out, the
    folder is written with fp32 and the variants that passed, then `variants.VariantsRefused`
    (an ExportError; `.written` is the folder) names what was refused with its figures.
    `overwrite` lets an export of another model be replaced; nothing but a colembed export is
    ever replaced. `random_weights` is recorded in the
    manifest (test and benchmark checkpoints say so; it is never guessed). A PEFT LoRA adapter
    folder (vidore/colqwen2.5-v0.2's form) is merged into its base first (`base`, else the
    adapter's own base path; adapter.py); `source_label` is what the manifest names as the source.
    The graphs' weights are written from the checkpoint one tensor at a time where
    `streamed_weights.streaming_applies` allows it (`stream_weights=False`: the whole fp32 model
    loaded per graph instead; the same bytes either way). Where they are streamed the check's
    torch reference runs layer by layer from the checkpoint (offloaded.py) and its onnxruntime
    sessions read the graphs' weights from their mapped files (verify.py), so neither holds a
    copy of the whole model; else the whole model is loaded once for the reference. Before any work the memory plan (plan.py) is said
    through `progress`: each chosen step's expected peak from the checkpoint's tensor sizes; a step
    over `max_memory` (GB; None: the memory the system has available) refuses the export
    (`plan.ExportPlanRefused`, naming the step, its figure and what to drop).
    """
    options = dict(locals())  # the call's arguments, handed on when an adapter is merged first
    say = progress or log.info
    meter = StepMeter(say)
    if variants:
        from ..variants.write import parse_variants

        variants = parse_variants(variants)  # a typo fails now, not after the fp32 export
    if int8_weight_passes is not None:
        from ..variants.recipes import int8_recipe

        int8_recipe(int8_weight_passes)  # likewise
    from ..families.qwen2_5.adapter import adapter_source, export_adapter

    if base is not None or adapter_source(source, revision) is not None:
        return export_adapter(export_model, **options)
    with meter.step("resolve the checkpoint and the destination"):
        resolved = resolve(source, out_dir, revision=revision, overwrite=overwrite)
    if source_label is not None:
        resolved = replace(resolved, checkpoint=replace(resolved.checkpoint, source=source_label))
    folder = resolved.checkpoint.folder
    unstreamed = (
        streaming_applies(folder, resolved.family) if stream_weights else "stream_weights=False"
    )
    plan = plan_export(folder, streamed=unstreamed is None, check=check, variants=variants)
    for line in plan.lines():
        say(line)
    for line in check_plan(plan, max_memory):
        say(line)
    staging = safe_fs.staging_folder(resolved.out, "colembed export")
    try:
        standin = facts = reference = None
        if unstreamed is None:
            with meter.step("check the checkpoint's tensors and build the stand-in model"):
                standin = StandInModel(folder, resolved.family)
                facts = model_facts(standin.model.config, folder, resolved.family)
            say("graph weights: streamed from the checkpoint, one tensor at a time")
        else:
            say(f"graph weights: from the whole loaded model ({unstreamed})")
        if check and standin is not None:
            from .offloaded import offloaded_reference

            with meter.step("run the torch reference layer by layer from the checkpoint"):
                reference = offloaded_reference(standin, resolved.family, folder)
        elif check or standin is None:
            with meter.step("load the checkpoint and run the torch reference"):
                model, facts = load(folder, resolved.family)
                if check:
                    reference = resolved.family.run_reference(
                        resolved.family.prepare_reference(model), folder
                    )
                # each step below loads what it needs: no two steps share resident weights
                del model
        graphs = export_graphs(
            folder,
            resolved.family,
            facts,
            staging,
            opset=opset,
            external_data=external_data,
            meter=meter,
            standin=standin,
        )
        del standin
        with meter.step("write the scorer and copy the processor files"):
            scorer = write_scorer(staging)
            copy_processor_files(folder, staging)
        checks: dict[str, Any] = {}
        extra: dict[str, dict[str, GraphEntry]] = {}

        def write_manifest(
            with_variants: dict[str, dict[str, GraphEntry]] | None = None,
        ) -> Manifest:
            if with_variants is not None:  # the variants listed now (a refused one drops out)
                extra.clear()
                extra.update(with_variants)
            d = manifest_dict(
                resolved,
                facts,
                staging,
                name=name,
                random_weights=random_weights,
                variants={BASE_VARIANT: graphs, **extra},
                scorer=scorer,
                checks=checks,
            )
            manifest = Manifest.from_dict(d)
            manifest.write(staging)
            return manifest

        write_manifest()
        if reference is not None:
            with meter.step("check the graphs against the torch model"):
                checks[BASE_VARIANT] = verify(
                    staging, reference, tolerance=tolerance, feature_tolerance=feature_tolerance
                )
        refusal = None
        if variants:
            from ..variants.write import VariantsRefused

            with meter.step("write and check the variants"):
                try:
                    checks.update(
                        variants_step(
                            staging,
                            graphs,
                            variants,
                            write_manifest,
                            say,
                            meter,
                            int8_weight_passes,
                        )
                    )
                except VariantsRefused as refused:  # the checked fp32 graphs are still written
                    refusal = refused
                    checks.update({n: refused.checks[n] for n in refused.kept})
        manifest = write_manifest()
        with meter.step("commit"):
            written = commit(staging, resolved.out)
    except BaseException as error:
        safe_fs.discard_staging(staging)
        if isinstance(error, ExportError):  # what was measured up to the refusal
            error.steps = meter.as_dicts()
        raise
    say(f"wrote {written} (peak RSS {meter.peak_rss_gb:.2f} GB)")
    if refusal is not None:
        refusal.written, refusal.steps = written, meter.as_dicts()
        refusal.args = (
            f"{refusal}\nwritten without them: {written} "
            f"({', '.join([BASE_VARIANT, *refusal.kept])})",
        )
        raise refusal
    return ExportReport(folder=written, manifest=manifest, check=checks, steps=meter.as_dicts())
