"""Finding and loading a ColQwen2-family checkpoint: strictly, in fp32, with no remote code.

A checkpoint that loads with a missing tensor would export cleanly and produce plausible garbage
(a freshly initialised layer), so every missing, unexpected or mis-shaped tensor is an error here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colembed.errors import ExportError, ModelFolderError
from colembed.families import (
    COLQWEN2,
    FAMILIES,
    Family,
    checkpoint_model_types,
    family_of_checkpoint,
)
from colembed.integrity import describe_file

from ..constants import CHECKPOINT_PATTERNS, REQUIRED_FILES


@dataclass(frozen=True)
class CheckpointSource:
    """Where a checkpoint came from (written into the manifest) and where it is on disk."""

    folder: Path
    source: str
    revision: str | None


def resolve_checkpoint(source: str | Path, revision: str | None = None) -> CheckpointSource:
    """A local folder as is, else a Hugging Face repo id downloaded with huggingface-hub."""
    path = Path(source).expanduser()
    if path.is_dir():
        return CheckpointSource(
            folder=path.resolve(), source=str(path.resolve()), revision=revision
        )
    if path.exists():
        raise ExportError(f"{source}: is a file; expected a checkpoint folder or a repo id")
    if str(source).count("/") != 1 or str(source).startswith((".", "/", "~")):
        raise ExportError(f"{source}: no such folder, and not a Hugging Face repo id (owner/name)")
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(
            repo_id=str(source), revision=revision, allow_patterns=list(CHECKPOINT_PATTERNS)
        )
    except Exception as e:  # the hub raises many types; all mean "could not get it"
        raise ExportError(
            f"{source}: could not download the checkpoint ({type(e).__name__}: {e})"
        ) from e
    return CheckpointSource(folder=Path(folder), source=str(source), revision=revision)


def read_config(folder: Path) -> dict:
    """The checkpoint's config.json as a dict; ExportError when absent or not JSON."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ExportError(f"{folder}: no config.json; not a Hugging Face checkpoint folder")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{config_path}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise ExportError(f"{config_path}: expected a JSON object")
    return config


def check_architecture(folder: Path) -> Family:
    """The family of a checkpoint whose layout one of `colembed.families` declares (transformers
    `ColQwen2ForRetrieval` over Qwen2-VL or Qwen2.5-VL, colpali-engine's ColQwen2.5)."""
    config = read_config(folder)
    family = family_of_checkpoint(config)
    if family is not None:
        return family
    model_type, nested = checkpoint_model_types(config)
    accepted = "; ".join(
        f"{f.name}: "
        + ", ".join(
            f"model_type {top!r}" + (f" with vlm_config.model_type {inner!r}" if inner else "")
            for top, inner in f.checkpoint_layouts
        )
        for f in FAMILIES.values()
    )
    hint = ""
    if model_type in (None, COLQWEN2.backbone) or "adapter_config" in str(config):
        hint = (
            " (colpali-engine ColQwen2 checkpoints such as vidore/colqwen2-v1.0 must first be "
            "converted; use the transformers-format vidore/colqwen2-v1.0-hf)"
        )
    raise ExportError(
        f"{folder / 'config.json'}: model_type {model_type!r}"
        + (f" with vlm_config.model_type {nested!r}" if nested else "")
        + f" is no checkpoint layout colembed exports ({accepted}){hint}"
    )


def check_required_files(folder: Path) -> None:
    from .preprocess_config import image_processor_config

    missing = [f for f in REQUIRED_FILES if not (folder / f).is_file()]
    if missing:
        raise ExportError(f"{folder}: checkpoint lacks {missing} (needed by the runtime)")
    try:
        image_processor_config(folder)
    except ModelFolderError as e:
        raise ExportError(f"{folder}: checkpoint lacks its image processor settings ({e})") from e


def fingerprint(folder: Path) -> str:
    """sha256 over the checkpoint's config and weight files: identifies "the same model"."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")) + [folder / "config.json"]:
        digest.update(path.name.encode())
        digest.update(describe_file(path)["sha256"].encode())
    return digest.hexdigest()


def architecture_facts(config, family: Family) -> dict[str, Any]:
    """The numbers of a loaded `ColQwen2Config` the runtime needs (the manifest's `architecture`);
    the vision numbers by the family's own config names."""
    text, vision = config.vlm_config.text_config, config.vlm_config.vision_config
    return {
        "text_hidden": text.hidden_size,
        "text_layers": text.num_hidden_layers,
        "text_heads": text.num_attention_heads,
        # transformers' own rule (Qwen3's attention): the declared `head_dim`, else hidden / heads
        "text_head_dim": getattr(text, "head_dim", None)
        or text.hidden_size // text.num_attention_heads,
        "text_kv_heads": text.num_key_value_heads,
        "text_intermediate": text.intermediate_size,
        "mrope_section": list(text.rope_scaling["mrope_section"]),
        "rope_theta": text.rope_theta,
        "vocab_size": text.vocab_size,
        **family.vision_numbers(vision.to_dict()),
        "embedding_dim": config.embedding_dim,
    }


def load_strict(folder: Path):
    """`ColQwen2ForRetrieval` (transformers layout, either family) in fp32 eval mode; raises
    ExportError listing every bad tensor."""
    import torch
    from transformers import ColQwen2ForRetrieval

    check_architecture(folder)
    try:
        model, info = ColQwen2ForRetrieval.from_pretrained(
            folder,
            dtype=torch.float32,
            output_loading_info=True,
            trust_remote_code=False,
            local_files_only=True,
        )
    except (OSError, ValueError, RuntimeError) as e:
        raise ExportError(f"{folder}: the checkpoint does not load ({e})") from e
    problems = []
    for key, label in (
        ("missing_keys", "missing"),
        ("unexpected_keys", "unexpected"),
        ("mismatched_keys", "mis-shaped"),
        ("error_msgs", "error"),
    ):
        found = sorted(str(k) for k in info.get(key, []) or [])
        if found:
            shown = ", ".join(found[:10]) + (
                f" (+{len(found) - 10} more)" if len(found) > 10 else ""
            )
            problems.append(f"{len(found)} {label} tensor(s): {shown}")
    if problems:
        raise ExportError(
            f"{folder}: refusing a partial checkpoint, it would export random layers: "
            + "; ".join(problems)
        )
    return model.eval()
