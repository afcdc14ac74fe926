"""colembed: ColQwen2 document retrieval on onnxruntime, torch-free.

`import colembed` must never import torch or transformers (a test enforces it); the exporter that
needs them lives in the separate `colembed_export` package (the `export` extra).
"""

from __future__ import annotations

from .errors import (
    ColembedError,
    ExportError,
    ImageError,
    InputError,
    InputTypeError,
    ManifestError,
    ModelFolderError,
    ProviderError,
    ScoringError,
)

__version__ = "0.1.0"

# Resolved on first use, so `import colembed` stays cheap (no onnxruntime session machinery).
_LAZY = {
    "load": ("colembed.model", "load"),
    "ColQwen2Model": ("colembed.model", "ColQwen2Model"),
    "score": ("colembed.scoring", "score"),
    "top_k": ("colembed.scoring", "top_k"),
    "Index": ("colembed.index", "Index"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'colembed' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))

__all__ = [
    "ColQwen2Model",
    "Index",
    "load",
    "score",
    "top_k",
    "ColembedError",
    "ExportError",
    "ImageError",
    "InputError",
    "InputTypeError",
    "ManifestError",
    "ModelFolderError",
    "ProviderError",
    "ScoringError",
    "__version__",
]


def _register_with_fastembed() -> None:
    """Make `LateInteractionMultimodalEmbedding("colqwen2")` work after `import colembed`.

    FastEmbed 0.9 has no plugin entry points: it finds models in a class-level list, so ColQwen2
    exists for it only once colembed has added itself, in this process. Does nothing when fastembed
    is not installed; an incompatible fastembed only costs the integration (with a warning).
    """
    import importlib.util

    try:
        if importlib.util.find_spec("fastembed") is None:
            return
    except (ImportError, ValueError):
        return
    try:
        from . import fastembed_plugin  # noqa: F401  (registers on import)
    except ImportError as e:
        import warnings

        warnings.warn(f"colembed: FastEmbed integration unavailable ({e})", RuntimeWarning,
                      stacklevel=2)


_register_with_fastembed()
