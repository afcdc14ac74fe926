"""A PEFT LoRA adapter over a ColQwen2.5 base, merged into one torch model at export.

The published ColQwen2.5 retrievers are not full checkpoints: `vidore/colqwen2.5-v0.2`, nomic-ai's
`colnomic-embed-multimodal-3b`/`-7b`, T-Systems' and Metric-AI's multilingual ColQwen2.5 are LoRA
adapters (`adapter_config.json` + `adapter_model.safetensors`) over a ColQwen2.5 base named by
`base_model_name_or_path` (docs/models-colqwen2_5.md). colembed's graphs are plain weights, so the
adapter is merged into the base here (W + B A * alpha / r, by peft itself) before anything is
exported; the runtime never sees an adapter.

What an adapter may hold besides LoRA pairs: the full trained tensors of its `modules_to_save`
(e.g. a `custom_text_proj` trained whole rather than through LoRA) and, with `bias` "all" or
"lora_only", trained biases. Each replaces the base's tensor after the merge (peft saves the trained
value, not a delta); any other tensor is refused by name.

The adapter names modules as the model it was trained on did (`layouts_qwen2_5`: colpali-engine's
layouts moved with transformers' 4.52 refactor); the base is loaded as transformers'
`ColQwen2ForRetrieval` (`checkpoint_qwen2_5.load_colqwen2_5`), and `to_transformers_module`
renames the adapter's module paths to that model's. peft then targets exactly the renamed modules:
every tensor must land on a module of the base, or the load is refused.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

from colembed.errors import ModelFolderError

from .checkpoint import load_colqwen2_5
from .layouts import (
    ADAPTER_CONFIG,
    ADAPTER_TO_TRANSFORMERS,
    ADAPTER_WEIGHTS,
    LORA_MARKER,
    PEFT_PREFIX,
    is_adapter,
    to_transformers_module,
)

PEFT_NOTES = (
    "The PEFT config's `base_model_name_or_path` was renamed",
    "Input and output embeddings are no longer tied",
)
# Path pieces of peft's wrappers in saved keys (`q_proj.base_layer.bias`: a trained bias of a LoRA
# layer; `custom_text_proj.modules_to_save.weight`: the trained copy) and the untrained copy it
# also saves with bias="all" (measured with peft 0.21: tests/export/families/qwen2_5/test_models.py).
PEFT_WRAPPERS = (".base_layer.", ".modules_to_save.")
PEFT_COPY_OF_THE_BASE = ".original_module."
# Config keys whose patterns speak the training layout's module names and so cannot be renamed
# reliably; no published ColQwen2.5 adapter we know of uses them (docs/models-colqwen2_5.md).
UNSUPPORTED_CONFIG = ("rank_pattern", "alpha_pattern")


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
    for key in UNSUPPORTED_CONFIG:
        if config.get(key):
            raise ModelFolderError(
                f"{key} is not supported in a ColQwen2.5 adapter (got {config[key]!r})", path=path
            )
    return config


def adapter_base(folder: str | Path, base: str | Path | None = None) -> Path:
    """The base checkpoint folder: `base` when given, else the adapter's `base_model_name_or_path`
    (a local folder as is, a Hub repo id downloaded). Unreachable: an error naming it."""
    from colembed.errors import ExportError

    from ..checkpoint import resolve_checkpoint

    folder = Path(folder)
    if base is not None:
        if not Path(base).expanduser().is_dir():
            raise ModelFolderError(
                "the base model given for the adapter is not a folder", path=base
            )
        return Path(base).expanduser().resolve()
    name = adapter_config(folder).get("base_model_name_or_path")
    if not name:
        raise ModelFolderError(
            "the adapter names no base_model_name_or_path; pass the base "
            "checkpoint folder with --base PATH",
            path=folder / ADAPTER_CONFIG,
        )
    try:
        return resolve_checkpoint(name).folder
    except ExportError as e:
        raise ModelFolderError(
            f"the adapter's base model {name!r} (base_model_name_or_path) is not a local folder "
            f"and could not be downloaded ({e}); download it and pass it with --base PATH",
            path=folder / ADAPTER_CONFIG,
        ) from e


def adapter_weights(folder: str | Path) -> tuple[dict, dict]:
    """The adapter's tensors (fp32) under the base model's names: (LoRA tensors under peft's keys,
    saved whole tensors under `ColQwen2ForRetrieval` parameter names), each checked against the
    config: a whole tensor must belong to a `modules_to_save` module, or be a bias the config
    trained (`bias` "all"/"lora_only")."""
    import torch
    from safetensors.torch import load_file

    config = adapter_config(folder)
    path = Path(folder) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise ModelFolderError(f"no {ADAPTER_WEIGHTS} (the adapter's weights)", path=folder)
    saved_modules = config.get("modules_to_save") or []
    if isinstance(saved_modules, str):
        saved_modules = [saved_modules]
    trains_bias = config.get("bias", "none") != "none"
    lora, whole, unknown = {}, {}, []
    for key, value in load_file(str(path)).items():
        if PEFT_COPY_OF_THE_BASE in key:
            continue  # peft's untouched copy of a modules_to_save module (saved with bias="all")
        training_name = key.removeprefix(PEFT_PREFIX)
        for wrapper in PEFT_WRAPPERS:  # a LoRA layer's own bias, a saved module's trained copy
            training_name = training_name.replace(wrapper, ".")
        renamed = to_transformers_module(training_name)
        if not key.startswith(PEFT_PREFIX) or renamed is None:
            unknown.append(key)
        elif LORA_MARKER in key:
            lora[PEFT_PREFIX + renamed] = value.to(torch.float32)
        elif _saved_whole(training_name, saved_modules, trains_bias):
            whole[renamed] = value.to(torch.float32)
        else:
            unknown.append(key)
    if unknown:
        raise ModelFolderError(
            f"adapter weights for no ColQwen2.5 module, or not LoRA and not in "
            f"modules_to_save: {unknown[:5]}",
            path=path,
        )
    return lora, whole


def _saved_whole(name: str, saved_modules: list[str], trains_bias: bool) -> bool:
    """peft's rule for `modules_to_save` (the module path is the name or ends with `.name`), or a
    bias of a config that trains biases."""
    module = name.rsplit(".", 1)[0]
    if any(module == m or module.endswith("." + m) for m in saved_modules):
        return True
    return trains_bias and name.endswith(".bias")


def merge_adapter(folder: str | Path, *, base: str | Path | None = None):
    """The base `ColQwen2ForRetrieval` with the adapter merged into its weights (fp32, eval)."""
    import torch
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    folder = Path(folder)
    adapter_config(folder)  # refuses what cannot be merged before the base is loaded
    base_folder = adapter_base(folder, base)
    if is_adapter(base_folder):
        raise ModelFolderError(
            "the adapter's base is itself an adapter; merge it first", path=base_folder
        )
    lora, whole = adapter_weights(folder)
    model = load_colqwen2_5(base_folder)
    targets = sorted({key[len(PEFT_PREFIX) : key.index(LORA_MARKER)] for key in lora})
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    absent = [t for t in targets if t not in modules]
    if not targets or absent:
        raise ModelFolderError(
            f"adapter modules absent from the base model: {absent[:5] or 'all'}",
            path=folder / ADAPTER_WEIGHTS,
        )
    misfit = [
        f"{k} {tuple(v.shape)}"
        for k, v in whole.items()
        if k not in params or params[k].shape != v.shape
    ]
    if misfit:
        raise ModelFolderError(
            f"saved tensors that fit no parameter of the base: {misfit[:5]}",
            path=folder / ADAPTER_WEIGHTS,
        )
    config = LoraConfig.from_pretrained(str(folder))
    # Target exactly the modules the weights name (the saved regex speaks the training layout);
    # whole tensors are applied after the merge, not by peft's modules_to_save wrappers.
    config.target_modules, config.exclude_modules = set(targets), None
    config.layers_to_transform, config.layers_pattern = None, None
    config.modules_to_save, config.bias = None, "none"
    config.inference_mode = True
    with warnings.catch_warnings():  # peft's notes on renaming the base path and on untying
        for note in PEFT_NOTES:  # the embeddings (targets never include them)
            warnings.filterwarnings("ignore", message=re.escape(note), category=UserWarning)
        wrapped = get_peft_model(model, config)
        result = set_peft_model_state_dict(wrapped, lora)
        missing = [k for k in result.missing_keys if LORA_MARKER in k]
        if missing or result.unexpected_keys:
            raise ModelFolderError(
                f"adapter weights do not fit the base: missing {missing[:5]}, "
                f"unexpected {list(result.unexpected_keys)[:5]}",
                path=folder,
            )
        merged = wrapped.merge_and_unload(safe_merge=True).eval()
    merged_params = dict(merged.named_parameters())
    with torch.no_grad():
        for name, value in whole.items():
            merged_params[name].copy_(value)
    return merged


def adapter_source(source: str | Path, revision: str | None = None) -> Path | None:
    """The folder of `source` (local, or a Hub repo id downloaded) when it is an adapter."""
    from ..checkpoint import resolve_checkpoint

    folder = resolve_checkpoint(source, revision).folder
    return folder if is_adapter(folder) else None


def merge_to_folder(adapter: Path, out: Path, *, base: str | Path | None = None) -> Path:
    """The adapter merged into its base, written at `out` in transformers' layout, with the
    processor and tokenizer files of the adapter folder (the published adapter ships them), else
    of the base: a checkpoint the exporter reads like any other."""
    from ...constants import OPTIONAL_FILES, REQUIRED_FILES

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


def export_adapter(
    export: Callable[..., Any],
    source: str | Path,
    out_dir: str | Path,
    *,
    base: str | Path | None,
    revision: str | None,
    **options: Any,
) -> Any:
    """`export(checkpoint, out_dir, **options)` (the exporter's `export_model`) on the adapter
    merged into its base. The merged checkpoint lives in a marked work folder beside the
    destination and is removed afterwards, whatever happens; the manifest names the adapter."""
    from colembed import safe_fs

    options.pop("source_label", None)
    adapter = adapter_source(source, revision)
    if adapter is None:
        raise ModelFolderError(
            f"a base model was given, but this is not an adapter (no {ADAPTER_CONFIG})", path=source
        )
    out = Path(out_dir)
    work = safe_fs.make_work_folder(
        out.parent / f".{out.name}.merged-adapter",
        "colembed export: a LoRA adapter merged into its base",
    )
    try:
        merged = merge_to_folder(adapter, work / "checkpoint", base=base)
        label = (
            f"{source} (LoRA adapter{f' @ {revision}' if revision else ''}) merged into "
            f"{base or adapter_config(adapter).get('base_model_name_or_path')}"
        )
        return export(merged, out_dir, source_label=label, **options)
    finally:
        safe_fs.remove_tree(work, owner=safe_fs.is_work_folder)


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_TO_TRANSFORMERS",
    "ADAPTER_WEIGHTS",
    "adapter_base",
    "adapter_config",
    "adapter_source",
    "adapter_weights",
    "export_adapter",
    "is_adapter",
    "merge_adapter",
    "merge_to_folder",
]
