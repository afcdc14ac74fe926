"""A PEFT LoRA adapter over a ColQwen2.5 base, merged into one torch model at export.

The published `vidore/colqwen2.5-v0.2` is not a full checkpoint: it is a LoRA adapter
(`adapter_config.json` + `adapter_model.safetensors`) whose `base_model_name_or_path` is
`vidore/colqwen2.5-base`, trained with colpali-engine on the language model's projections and
`custom_text_proj` (docs/reference-colqwen2_5.md). colembed's graphs are plain weights, so the
adapter is merged into the base here (W + B A * alpha / r, by peft itself) before anything is
exported; the runtime never sees an adapter.

The adapter names modules as the model it was trained on did (colpali-engine's layout, whose
names moved with transformers' 4.52 refactor); the base is loaded as transformers'
`ColQwen2ForRetrieval` (`checkpoint_qwen2_5.load_colqwen2_5`). `ADAPTER_TO_TRANSFORMERS`
renames the adapter's module paths to that model's, and peft then targets exactly the renamed
modules: every LoRA tensor must land on a module, or the load is refused.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

from colembed.errors import ModelFolderError

from .checkpoint_qwen2_5 import COLPALI_TO_TRANSFORMERS

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # peft's key prefix in a saved adapter
LORA_MARKER = ".lora_"  # lora_A / lora_B / lora_embedding_* / lora_magnitude_vector
PEFT_NOTES = ("The PEFT config's `base_model_name_or_path` was renamed",
              "Input and output embeddings are no longer tied")
# Adapter module-path prefix -> ColQwen2ForRetrieval module-path prefix; the first match wins.
ADAPTER_TO_TRANSFORMERS = (
    # trained on transformers >= 4.52's Qwen2_5_VLForConditionalGeneration layout
    ("model.language_model.", "vlm.model.language_model."),
    ("model.visual.", "vlm.model.visual."),
    # colpali-engine 0.3.12 (ColQwen2_5 is a Qwen2_5_VLModel)
    ("language_model.", "vlm.model.language_model."),
    # colpali-engine before it (ColQwen2_5 was a Qwen2_5_VLForConditionalGeneration, text model
    # at `model.`): the published base's own key names
    *COLPALI_TO_TRANSFORMERS,
    # trained on transformers' ColQwen2ForRetrieval itself
    ("vlm.", "vlm."),
    ("embedding_proj_layer.", "embedding_proj_layer."),
)


def is_adapter(folder: str | Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def adapter_config(folder: str | Path) -> dict:
    """The adapter's config.json as data; only LoRA adapters are accepted."""
    path = Path(folder) / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFolderError(f"unreadable adapter config: {e}", path=path) from e
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else None
        raise ModelFolderError(f"peft_type {kind!r}: only LoRA adapters can be merged", path=path)
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(key):
            raise ModelFolderError(f"{key} is not supported in a ColQwen2.5 adapter "
                                   f"(got {config[key]!r})", path=path)
    return config


def adapter_base(folder: str | Path, base: str | Path | None = None) -> Path:
    """The base checkpoint folder: `base` when given, else the adapter's `base_model_name_or_path`
    (a local folder as is, a Hub repo id downloaded). Unreachable: an error naming it."""
    from colembed.errors import ExportError

    from .checkpoint import resolve_checkpoint

    folder = Path(folder)
    if base is not None:
        if not Path(base).expanduser().is_dir():
            raise ModelFolderError("the base model given for the adapter is not a folder", path=base)
        return Path(base).expanduser().resolve()
    name = adapter_config(folder).get("base_model_name_or_path")
    if not name:
        raise ModelFolderError("the adapter names no base_model_name_or_path; pass the base "
                               "checkpoint folder with --base PATH", path=folder / ADAPTER_CONFIG)
    try:
        return resolve_checkpoint(name).folder
    except ExportError as e:
        raise ModelFolderError(
            f"the adapter's base model {name!r} (base_model_name_or_path) is not a local folder "
            f"and could not be downloaded ({e}); download it and pass it with --base PATH",
            path=folder / ADAPTER_CONFIG) from e


def to_transformers_module(path: str) -> str | None:
    """An adapter's module path in `ColQwen2ForRetrieval`'s names (None: not a ColQwen2.5 module)."""
    for old, new in ADAPTER_TO_TRANSFORMERS:
        if path.startswith(old):
            return new + path[len(old):]
    return None


def adapter_weights(folder: str | Path) -> dict:
    """The adapter's tensors (fp32) under peft's keys for the renamed modules."""
    import torch
    from safetensors.torch import load_file

    path = Path(folder) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise ModelFolderError(f"no {ADAPTER_WEIGHTS} (the adapter's weights)", path=folder)
    out, unknown = {}, []
    for key, value in load_file(str(path)).items():
        renamed = to_transformers_module(key.removeprefix(PEFT_PREFIX))
        if not key.startswith(PEFT_PREFIX) or renamed is None:
            unknown.append(key)
        else:
            out[PEFT_PREFIX + renamed] = value.to(torch.float32)
    if unknown:
        raise ModelFolderError(f"adapter weights for no ColQwen2.5 module: {unknown[:5]}", path=path)
    return out


def merge_adapter(folder: str | Path, *, base: str | Path | None = None):
    """The base `ColQwen2ForRetrieval` with the adapter merged into its weights (fp32, eval)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    from .checkpoint_qwen2_5 import load_colqwen2_5

    folder = Path(folder)
    adapter_config(folder)  # refuses what cannot be merged before the base is loaded
    base_folder = adapter_base(folder, base)
    if is_adapter(base_folder):
        raise ModelFolderError("the adapter's base is itself an adapter; merge it first", path=base_folder)
    model = load_colqwen2_5(base_folder)
    weights = adapter_weights(folder)
    targets = sorted({key[len(PEFT_PREFIX):key.index(LORA_MARKER)] for key in weights
                      if LORA_MARKER in key})
    modules = dict(model.named_modules())
    absent = [t for t in targets if t not in modules]
    if not targets or absent:
        raise ModelFolderError(f"adapter modules absent from the base model: {absent[:5] or 'all'}",
                               path=folder / ADAPTER_WEIGHTS)
    config = LoraConfig.from_pretrained(str(folder))
    # Target exactly the modules the weights name (the saved regex speaks the training layout).
    config.target_modules, config.exclude_modules = set(targets), None
    config.layers_to_transform, config.layers_pattern = None, None
    config.inference_mode = True
    with warnings.catch_warnings():  # peft's notes on renaming the base path and on untying
        for note in PEFT_NOTES:       # the embeddings (targets never include them)
            warnings.filterwarnings("ignore", message=note, category=UserWarning)
        wrapped = get_peft_model(model, config)
        result = set_peft_model_state_dict(wrapped, weights)
        missing = [k for k in result.missing_keys if LORA_MARKER in k]
        if missing or result.unexpected_keys:
            raise ModelFolderError(f"adapter weights do not fit the base: missing {missing[:5]}, "
                                   f"unexpected {list(result.unexpected_keys)[:5]}", path=folder)
        return wrapped.merge_and_unload(safe_merge=True).eval()


def adapter_source(source: str | Path, revision: str | None = None) -> Path | None:
    """The folder of `source` (local, or a Hub repo id downloaded) when it is an adapter."""
    from .checkpoint import resolve_checkpoint

    folder = resolve_checkpoint(source, revision).folder
    return folder if is_adapter(folder) else None


def merge_to_folder(adapter: Path, out: Path, *, base: str | Path | None = None) -> Path:
    """The adapter merged into its base, written at `out` in transformers' layout, with the
    processor and tokenizer files of the adapter folder (the published adapter ships them), else
    of the base: a checkpoint the exporter reads like any other."""
    from .constants import OPTIONAL_FILES, REQUIRED_FILES

    base_folder = adapter_base(adapter, base)
    model = merge_adapter(adapter, base=base_folder)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="2GB")
    del model
    for name in REQUIRED_FILES + OPTIONAL_FILES:
        found = next((f / name for f in (adapter, base_folder) if (f / name).is_file()), None)
        if name != "config.json" and found is not None:
            shutil.copyfile(found, out / name)
    return out


def export_adapter(export: Callable[..., Any], source: str | Path, out_dir: str | Path, *,
                   base: str | Path | None, revision: str | None, **options: Any) -> Any:
    """`export(checkpoint, out_dir, **options)` (the exporter's `export_model`) on the adapter
    merged into its base. The merged checkpoint lives in a marked work folder beside the
    destination and is removed afterwards, whatever happens; the manifest names the adapter."""
    from colembed import safe_fs

    options.pop("source_label", None)
    adapter = adapter_source(source, revision)
    if adapter is None:
        raise ModelFolderError("a base model was given, but this is not an adapter (no "
                               f"{ADAPTER_CONFIG})", path=source)
    out = Path(out_dir)
    work = safe_fs.make_work_folder(out.parent / f".{out.name}.merged-adapter",
                                    "colembed export: a LoRA adapter merged into its base")
    try:
        merged = merge_to_folder(adapter, work / "checkpoint", base=base)
        label = f"{source} (LoRA adapter{f' @ {revision}' if revision else ''}) merged into " \
                f"{base or adapter_config(adapter).get('base_model_name_or_path')}"
        return export(merged, out_dir, source_label=label, **options)
    finally:
        safe_fs.remove_tree(work, owner=safe_fs.is_work_folder)


__all__ = ["ADAPTER_CONFIG", "ADAPTER_TO_TRANSFORMERS", "ADAPTER_WEIGHTS", "adapter_base",
           "adapter_config", "adapter_source", "adapter_weights", "export_adapter", "is_adapter",
           "merge_adapter", "merge_to_folder"]
