"""`export_model`: a ColQwen2 checkpoint in, one verified colembed model folder out.

The folder is assembled in a staging directory beside the destination and moved into place only
after the check passes, so a failed or interrupted export never leaves a half-written model and
never clobbers a good one.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from colembed.contracts import text_contract, vision_contract
from colembed.errors import ExportError
from colembed.manifest import (
    MANIFEST_NAME,
    GraphEntry,
    Manifest,
    describe_file,
    read_manifest,
)

from .checkpoint import CheckpointSource, check_architecture, load_strict, resolve_checkpoint
from .onnx_io import DEFAULT_OPSET, export_graph

log = logging.getLogger("colembed_export")

# Files copied from the checkpoint: what the runtime's tokenizer and preprocessing read, plus the
# configs kept for provenance. Optional ones are copied when present.
REQUIRED_FILES = ("tokenizer.json", "config.json", "preprocessor_config.json")
OPTIONAL_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                  "vocab.json", "merges.txt", "processor_config.json", "chat_template.jinja",
                  "colembed_tiny.json")
DEFAULT_TOLERANCE = 1e-4  # absolute, per token, on the final unit-norm embeddings
# Relative to the tensor's own scale (max abs diff / max abs): image features of trained towers
# reach the hundreds, where fp32 rounding alone exceeds any sensible absolute bound.
DEFAULT_FEATURE_TOLERANCE = 1e-4


@dataclass
class ExportReport:
    folder: Path
    manifest: Manifest
    check: dict[str, Any] = field(default_factory=dict)


def _checkpoint_fingerprint(folder: Path) -> str:
    """sha256 over the checkpoint's config and weight files: identifies "the same model"."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")) + [folder / "config.json"]:
        digest.update(path.name.encode())
        digest.update(describe_file(path)["sha256"].encode())
    return digest.hexdigest()


def _check_destination(out: Path, fingerprint: str, overwrite: bool) -> None:
    if not out.exists() or overwrite:
        return
    if not out.is_dir():
        raise ExportError(f"{out}: exists and is not a folder")
    if not any(out.iterdir()):
        return
    if not (out / MANIFEST_NAME).is_file():
        raise ExportError(
            f"{out}: folder is not empty and is not a colembed model; choose another --out "
            "or pass overwrite=True (--overwrite)")
    try:
        existing = read_manifest(out).model.checkpoint_sha256
    except ExportError:
        existing = None
    except Exception:
        existing = None
    if existing != fingerprint:
        raise ExportError(
            f"{out}: already holds a different model (checkpoint fingerprint "
            f"{str(existing)[:12]} != {fingerprint[:12]}); pass overwrite=True (--overwrite) "
            "to replace it")


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    found = {}
    for dist in ("colembed", "torch", "transformers", "onnx", "onnxscript", "onnxruntime",
                 "numpy", "tokenizers", "pillow"):
        try:
            found[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return found


def _architecture(config) -> dict[str, Any]:
    text, vision = config.vlm_config.text_config, config.vlm_config.vision_config
    return {
        "text_hidden": text.hidden_size,
        "text_layers": text.num_hidden_layers,
        "text_heads": text.num_attention_heads,
        "text_kv_heads": text.num_key_value_heads,
        "text_intermediate": text.intermediate_size,
        "mrope_section": list(text.rope_scaling["mrope_section"]),
        "rope_theta": text.rope_theta,
        "vocab_size": text.vocab_size,
        "vision_depth": vision.depth,
        "vision_embed_dim": vision.embed_dim,
        "vision_heads": vision.num_heads,
        "vision_mlp_ratio": vision.mlp_ratio,
        "embedding_dim": config.embedding_dim,
    }


def _example_inputs(model, preprocess) -> tuple[tuple, tuple]:
    """Small example tensors for tracing (shapes only matter; all axes are exported dynamic)."""
    import torch

    vision = model.vlm.model.visual
    head_dim = vision.config.embed_dim // vision.config.num_heads
    merge = preprocess.merge_size
    patches = 2 * merge * 3 * merge  # a 2-image batch on a (2m x 3m) grid: no axis of size 1
    hidden = model.config.vlm_config.text_config.hidden_size
    vision_args = (
        torch.randn(2, patches, preprocess.patch_dim),
        torch.randn(patches, head_dim),
        torch.randn(patches, head_dim),
    )
    ids = torch.full((2, 7), preprocess.pad_token_id, dtype=torch.long)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0).unsqueeze(0).expand(3, -1, -1).contiguous()
    index = torch.zeros(2, 7, dtype=torch.long)
    index[0, 2:5] = torch.arange(1, 4)
    text_args = (ids, mask, positions, index, torch.randn(3, hidden))
    return vision_args, text_args


def export_model(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    revision: str | None = None,
    name: str | None = None,
    opset: int = DEFAULT_OPSET,
    check: bool = True,
    tolerance: float = DEFAULT_TOLERANCE,
    feature_tolerance: float = DEFAULT_FEATURE_TOLERANCE,
    overwrite: bool = False,
    external_data: bool | None = None,
    variants: Sequence[str] = (),
    progress: Callable[[str], None] | None = None,
) -> ExportReport:
    """Export a transformers `ColQwen2ForRetrieval` checkpoint to a colembed model folder.

    `source` is a local folder or a Hugging Face repo id (`revision` pins it). With `check` (the
    default) the exported graphs are run with onnxruntime through the colembed runtime on sample
    pages and queries and compared with the unpatched torch model; beyond `tolerance` (max abs
    difference per token of the final embeddings) or `feature_tolerance` (image features, max abs
    difference relative to their own scale) nothing is written and ExportError lists every
    comparison with its figure.
    `variants` (e.g. ("int8", "int4", "fp16")) are derived from the checked fp32 graphs, each
    checked against fp32 with its own gate; the manifest records every check's figures.
    """
    import torch

    from colembed.preprocess.config import PreprocessConfig

    say = progress or (lambda message: log.info(message))
    if variants:
        from .variants import parse_variants

        variants = parse_variants(variants)  # a typo fails now, not after the fp32 export
    out = Path(out_dir).expanduser().resolve()
    say(f"resolving checkpoint {source}")
    ckpt: CheckpointSource = resolve_checkpoint(source, revision)
    check_architecture(ckpt.folder)
    missing = [f for f in REQUIRED_FILES if not (ckpt.folder / f).is_file()]
    if missing:
        raise ExportError(f"{ckpt.folder}: checkpoint lacks {missing} (needed by the runtime)")
    fingerprint = _checkpoint_fingerprint(ckpt.folder)
    _check_destination(out, fingerprint, overwrite)

    say("loading checkpoint (fp32, strict)")
    model = load_strict(ckpt.folder)
    preprocess = PreprocessConfig.from_checkpoint(ckpt.folder)
    config = model.config
    vision_cfg = model.vlm.model.visual.config
    text_hidden = config.vlm_config.text_config.hidden_size
    contracts = {
        "vision": vision_contract(preprocess.patch_dim, vision_cfg.embed_dim // vision_cfg.num_heads,
                                  text_hidden),
        "text": text_contract(text_hidden, config.embedding_dim),
    }

    from .graphs import ONNX_TRANSLATIONS, ImageGraph, TextGraph

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.staging-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    try:
        vision_args, text_args = _example_inputs(model, preprocess)
        graphs: dict[str, GraphEntry] = {}
        with torch.no_grad():
            for role, module, args in (
                ("vision", ImageGraph(model.vlm.model.visual).eval(), vision_args),
                ("text", TextGraph(model).eval(), text_args),
            ):
                say(f"exporting the {role} graph")
                info = export_graph(module, args, contracts[role], staging / f"{role}.onnx",
                                    opset=opset, external_data=external_data,
                                    translations=ONNX_TRANSLATIONS)
                graphs[role] = GraphEntry(file=info["file"], data_file=info["data_file"],
                                          opset=opset, contract=contracts[role])
        scorer = _write_scorer(staging)
        for name_ in REQUIRED_FILES + OPTIONAL_FILES:
            if (ckpt.folder / name_).is_file():
                shutil.copyfile(ckpt.folder / name_, staging / name_)

        def manifest_with(checks: dict[str, Any]) -> Manifest:
            files = sorted(p.name for p in staging.iterdir() if p.is_file() and p.name != MANIFEST_NAME)
            return Manifest.from_dict({
                "model": {
                    "name": name or out.name,
                    "source": ckpt.source,
                    "revision": ckpt.revision,
                    "architecture": "ColQwen2ForRetrieval",
                    "checkpoint_sha256": fingerprint,
                    "random_weights": (ckpt.folder / "colembed_tiny.json").is_file(),
                },
                "embedding_dim": config.embedding_dim,
                "preprocess": preprocess.to_dict(),
                "architecture": _architecture(config),
                "variants": {v: {r: g.to_dict() for r, g in gs.items()}
                             for v, gs in {"fp32": graphs, **extra_variants}.items()},
                "scorer": scorer.to_dict() if scorer else None,
                "files": {f: describe_file(staging / f) for f in files},
                "checks": checks,
                "versions": _versions(),
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            })

        extra_variants: dict[str, dict[str, GraphEntry]] = {}
        manifest_with({}).write(staging)
        checks: dict[str, Any] = {}
        if check:
            from .verify import verify_export

            say("checking the exported graphs against the torch model")
            checks["fp32"] = verify_export(model, ckpt.folder, staging, tolerance=tolerance,
                                           feature_tolerance=feature_tolerance)
        if variants:
            from .variants import write_variants

            def write_manifest(with_variants: dict[str, dict[str, GraphEntry]]) -> None:
                extra_variants.clear()
                extra_variants.update(with_variants)
                manifest_with(checks).write(staging)

            variant_checks = write_variants(staging, graphs, variants, write_manifest=write_manifest,
                                            progress=say)
            checks.update(variant_checks)
        manifest = manifest_with(checks)
        manifest.write(staging)
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    say(f"wrote {out}")
    return ExportReport(folder=out, manifest=manifest, check=checks)


def _write_scorer(folder: Path) -> GraphEntry | None:
    """The MaxSim scorer graph (torch-free builder in colembed) written beside the model graphs."""
    from colembed import maxsim_graph

    path = folder / "maxsim.onnx"
    maxsim_graph.write_maxsim_graph(path)
    return GraphEntry(file=path.name, contract=maxsim_graph.MAXSIM_CONTRACT,
                      opset=maxsim_graph.MAXSIM_OPSET)
