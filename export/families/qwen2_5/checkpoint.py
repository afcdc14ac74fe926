"""Loading a full ColQwen2.5 checkpoint in either published layout as one torch model.

ColQwen2.5 ships in two layouts (docs/reference-colqwen2_5.md): colpali-engine's (the official
`vidore/colqwen2.5-base`, base of the `vidore/colqwen2.5-v0.2` adapter: a bare `qwen2_5_vl`
config, keys `model.*`, `visual.*`, `custom_text_proj.*`, sometimes `lm_head.*`, in one file or in
shards) and transformers' retrieval layout (`ColQwen2ForRetrieval`: a `colqwen2` config nesting
`vlm_config`, keys under `vlm.` and `embedding_proj_layer.*`). Both load here into a transformers
`ColQwen2ForRetrieval`, the class the exporter's graphs wrap and the tests use as oracle, with every
embedding weight accounted for.

The key names are `layouts_qwen2_5`'s. A PEFT LoRA adapter folder (the published
`vidore/colqwen2.5-v0.2` is one) is not a checkpoint: `adapter.py` loads its base here and merges
into it (this module knows nothing of adapters, so the two never import each other).
"""

from __future__ import annotations

import json
from pathlib import Path

from colembed.errors import ModelFolderError
from colembed.safe_fs import inside

from .layouts import WEIGHTS_FILE, WEIGHTS_INDEX, is_adapter, to_transformers_key


def checkpoint_layout(folder: str | Path) -> str:
    """ "transformers" or "colpali", from config.json; ModelFolderError for anything else."""
    config = _config(Path(folder))
    nested = config.get("vlm_config") if isinstance(config.get("vlm_config"), dict) else {}
    if config.get("model_type") == "colqwen2" and nested.get("model_type") == "qwen2_5_vl":
        return "transformers"
    if config.get("model_type") == "qwen2_5_vl":
        return "colpali"
    raise ModelFolderError(
        f"not a ColQwen2.5 checkpoint: model_type {config.get('model_type')!r} (expected a qwen2_5_vl "
        "config from colpali-engine, or a colqwen2 config whose vlm_config is qwen2_5_vl)",
        path=Path(folder) / "config.json",
    )


def load_colqwen2_5(folder: str | Path):
    """A `ColQwen2ForRetrieval` (fp32, eval) from a full ColQwen2.5 checkpoint in either layout.
    An adapter folder is refused by name: `adapter.merge_adapter` merges it into its base."""
    import torch
    from transformers import ColQwen2ForRetrieval

    folder = Path(folder)
    if is_adapter(folder):
        raise ModelFolderError(
            "a PEFT adapter, not a full checkpoint: merge it into its base "
            "(colembed_export.families.qwen2_5.adapter.merge_adapter, or `colembed export` it)",
            path=folder,
        )
    if checkpoint_layout(folder) == "transformers":
        return ColQwen2ForRetrieval.from_pretrained(folder, dtype=torch.float32).eval()
    return _load_colpali_layout(folder)


def to_transformers_names(state_dict: dict) -> dict:
    """colpali-engine key names -> `ColQwen2ForRetrieval` key names; unknown keys are refused."""
    out, unknown = {}, []
    for key, value in state_dict.items():
        new = to_transformers_key(key)
        if new is None:
            unknown.append(key)
        else:
            out[new] = value
    if unknown:
        raise ModelFolderError(
            f"unexpected weights for a colpali-engine ColQwen2.5 checkpoint: {unknown[:5]}"
        )
    return out


def _load_colpali_layout(folder: Path):
    """Tensor by tensor into an uninitialised fp32 model, so that the peak is about one fp32 copy
    of the weights (reading every tensor first and then loading them into a randomly initialised
    model held two or three: 30-37 GB for a 3B base, more than a 24 GB machine has)."""
    import torch
    from safetensors import safe_open

    where = colpali_tensor_locations(folder)
    model = build_colpali_layout(folder, where, empty=False)
    params = model.state_dict()  # shares storage with the model's parameters
    head, table = model.vlm.lm_head.weight, model.vlm.get_input_embeddings().weight
    tied = head.data_ptr() == table.data_ptr()
    if tied:  # a stored head of tied embeddings would overwrite the table it shares
        where = {k: v for k, v in where.items() if not k.startswith("vlm.lm_head.")}
    # 0.3.12 checkpoints are headless; the LM head is unused for embeddings (tied or not).
    missing = [k for k in params if k not in where and not k.startswith("vlm.lm_head.")]
    unexpected = [k for k in where if k not in params]
    misfit = []
    if not missing and not unexpected:
        with torch.no_grad():
            for name, (file, key) in where.items():
                # one tensor per opening: the file's pages leave the process when it is closed
                # (a shard kept open stays mapped, a second copy of the weights in RSS)
                with safe_open(str(file), "pt") as f:
                    tensor = f.get_tensor(key)
                if tuple(tensor.shape) != tuple(params[name].shape):
                    misfit.append(f"{key} {tuple(tensor.shape)}")
                else:
                    params[name].copy_(tensor)
                del tensor
    if missing or unexpected or misfit:
        raise ModelFolderError(
            f"weights do not fit the config: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}, wrong shapes {misfit[:5]}",
            path=folder,
        )
    if not tied and "vlm.lm_head.weight" not in where:
        with torch.no_grad():
            head.zero_()  # never initialised (headless 0.3.12 layout); unused for embeddings
    model.tie_weights()
    return model.eval()


def build_colpali_layout(folder: Path, where: dict[str, tuple[Path, str]], *, empty: bool):
    """The fp32 `ColQwen2ForRetrieval` of a colpali-layout checkpoint (`where`:
    `colpali_tensor_locations`), its weights not initialised; with `empty` its parameters are on
    the meta device (no memory: the streamed export's stand-in), else allocated for the loader to
    fill. The projection's width is the stored projection's."""
    import contextlib

    import torch
    from safetensors import safe_open
    from transformers import ColQwen2Config, ColQwen2ForRetrieval, Qwen2_5_VLConfig
    from transformers.integrations.accelerate import init_empty_weights
    from transformers.modeling_utils import no_init_weights

    projection = where.get("embedding_proj_layer.weight")
    if projection is None:
        raise ModelFolderError(
            "no custom_text_proj weights: a Qwen2.5-VL model, not ColQwen2.5", path=folder
        )
    with safe_open(str(projection[0]), "pt") as f:
        embedding_dim = int(f.get_slice(projection[1]).get_shape()[0])
    vlm_config = Qwen2_5_VLConfig.from_dict(_config(folder))
    config = ColQwen2Config(vlm_config=vlm_config, embedding_dim=embedding_dim)
    context = init_empty_weights(include_buffers=False) if empty else contextlib.nullcontext()
    with context, no_init_weights():  # every tensor is overwritten or refused as missing
        return ColQwen2ForRetrieval(config).to(torch.float32)


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a single-file or sharded (index.json) checkpoint."""
    if (folder / WEIGHTS_FILE).is_file():
        return [folder / WEIGHTS_FILE]
    index = folder / WEIGHTS_INDEX
    if not index.is_file():
        raise ModelFolderError(f"no {WEIGHTS_FILE} or {WEIGHTS_INDEX}", path=folder)
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, json.JSONDecodeError, KeyError, AttributeError, TypeError) as e:
        raise ModelFolderError(f"unreadable weight index: {e}", path=index) from e
    return [inside(folder, shard) for shard in shards]


def colpali_tensor_locations(folder: Path) -> dict[str, tuple[Path, str]]:
    """`ColQwen2ForRetrieval` name -> (file, colpali-engine key) of every tensor; unknown keys are
    refused (`to_transformers_key`), no tensor is read."""
    from safetensors import safe_open

    where, unknown = {}, []
    for file in _weight_files(folder):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                name = to_transformers_key(key)
                if name is None:
                    unknown.append(key)
                else:
                    where[name] = (file, key)
    if unknown:
        raise ModelFolderError(
            f"unexpected weights for a colpali-engine ColQwen2.5 checkpoint: {unknown[:5]}",
            path=folder,
        )
    return where


def _config(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFolderError(f"unreadable config.json: {e}", path=path) from e


__all__ = [
    "build_colpali_layout",
    "checkpoint_layout",
    "colpali_tensor_locations",
    "load_colqwen2_5",
    "to_transformers_names",
]
