"""What the published ColQwen2.5 layouts call things on disk, and their names in the one model the
exporter loads (transformers' `ColQwen2ForRetrieval`).

The one home of these naming facts (docs/reference-colqwen2_5.md, docs/models-colqwen2_5.md):
`families/qwen2_5/checkpoint.py` reads full checkpoints with them, `adapter.py` renames a LoRA adapter's
module paths with them, `testing/tiny_qwen2_5.py` writes the test replicas with them. This module imports
nothing of theirs, so none of them imports another to learn a name.

Why several names for one module: colpali-engine built `ColQwen2_5` on
`Qwen2_5_VLForConditionalGeneration` until transformers 4.52 (language model at `model.`, tower at
`visual.`, an `lm_head` saved when the embeddings are untied: the layout of `vidore/colqwen2.5-base`
and `nomic-ai/colqwen2.5-7B-base`), then on `Qwen2_5_VLModel` (language model at
`language_model.`; 0.3.12). An adapter names modules as the model it was trained on did.
"""

from __future__ import annotations

from pathlib import Path

# A PEFT adapter folder: its config and weights (peft's file names).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # peft's key prefix in a saved adapter
LORA_MARKER = ".lora_"  # lora_A / lora_B / lora_embedding_* / lora_magnitude_vector

# A full checkpoint's weights: one file, or shards listed by an index (transformers' names).
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"

# colpali-engine key prefix -> transformers ColQwen2ForRetrieval key prefix (the mapping
# transformers' convert_colqwen2_weights_to_hf.py applies).
COLPALI_TO_TRANSFORMERS = (
    ("custom_text_proj.", "embedding_proj_layer."),
    ("model.", "vlm.model.language_model."),
    ("visual.", "vlm.model.visual."),
)
# Accepted on load only: the pre-4.52 layout saves an LM head when word embeddings are not tied
# (the 7B's are not); 0.3.12 writes none. Unused for embeddings either way.
LEGACY_HEAD = ("lm_head.", "vlm.lm_head.")

# Adapter module-path prefix -> ColQwen2ForRetrieval module-path prefix; the first match wins.
ADAPTER_TO_TRANSFORMERS = (
    # trained on transformers >= 4.52's Qwen2_5_VLForConditionalGeneration layout
    ("model.language_model.", "vlm.model.language_model."),
    ("model.visual.", "vlm.model.visual."),
    # colpali-engine 0.3.12 (ColQwen2_5 is a Qwen2_5_VLModel)
    ("language_model.", "vlm.model.language_model."),
    # colpali-engine before it (on Qwen2_5_VLForConditionalGeneration: text model at `model.`):
    # the published bases' own key names
    *COLPALI_TO_TRANSFORMERS,
    # trained on transformers' ColQwen2ForRetrieval itself
    ("vlm.", "vlm."),
    ("embedding_proj_layer.", "embedding_proj_layer."),
)


def is_adapter(folder: str | Path) -> bool:
    """A PEFT adapter folder (it has an adapter_config.json), not a full checkpoint."""
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def to_transformers_key(key: str, *, with_head: bool = True) -> str | None:
    """A full colpali-layout checkpoint's tensor name in `ColQwen2ForRetrieval` (None: unknown)."""
    pairs = (*COLPALI_TO_TRANSFORMERS, LEGACY_HEAD) if with_head else COLPALI_TO_TRANSFORMERS
    return next((new + key[len(old) :] for old, new in pairs if key.startswith(old)), None)


def to_transformers_module(path: str) -> str | None:
    """An adapter's module path in `ColQwen2ForRetrieval`'s names (None: not a ColQwen2.5 module)."""
    for old, new in ADAPTER_TO_TRANSFORMERS:
        if path.startswith(old):
            return new + path[len(old) :]
    return None


def to_colpali_key(key: str) -> str | None:
    """A `ColQwen2ForRetrieval` tensor name in the published colpali-engine layout (the LM head
    as `lm_head.`, which only the pre-4.52 layout stores; None: no counterpart)."""
    for theirs, ours in COLPALI_TO_TRANSFORMERS:
        if key.startswith(ours):
            return theirs + key[len(ours) :]
    head_theirs, head_ours = LEGACY_HEAD
    return head_theirs + key[len(head_ours) :] if key.startswith(head_ours) else None


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_TO_TRANSFORMERS",
    "ADAPTER_WEIGHTS",
    "COLPALI_TO_TRANSFORMERS",
    "LEGACY_HEAD",
    "LORA_MARKER",
    "PEFT_PREFIX",
    "WEIGHTS_FILE",
    "WEIGHTS_INDEX",
    "is_adapter",
    "to_colpali_key",
    "to_transformers_key",
    "to_transformers_module",
]
