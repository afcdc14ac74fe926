"""colembed: ColQwen-family (ColQwen2, ColQwen2.5, ColQwen3) document retrieval on onnxruntime, torch-free.

`import colembed` imports only the standard library and colembed's errors (no torch, transformers,
onnxruntime or fastembed; tests/project/test_import_isolation.py enforces it), so the
`colembed` command starts fast. `load`, `score` and `top_k` are resolved on first use. The exporter
lives in the separate `colembed_export` package (the `export` extra); the FastEmbed integration is
`colembed.fastembed` (the `fastembed` extra), imported only by those who use it.
"""

from __future__ import annotations

from .errors import (
    ColembedError,
    DimensionError,
    ExportError,
    GraphOutputError,
    ImageError,
    InputError,
    InputTypeError,
    ManifestError,
    ModelFolderError,
    ProviderError,
    QueryTruncatedWarning,
    ScoringError,
)

__version__ = "0.1.0"

# Resolved on first use, so `import colembed` stays cheap (no onnxruntime session machinery).
_LAZY = {
    "load": ("colembed.model", "load"),
    "ColQwenModel": ("colembed.model", "ColQwenModel"),
    "ColQwen2Model": ("colembed.model", "ColQwen2Model"),  # old name, one release
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
    "ColQwenModel",
    "ColQwen2Model",
    "Index",
    "load",
    "score",
    "top_k",
    "ColembedError",
    "DimensionError",
    "ExportError",
    "GraphOutputError",
    "ImageError",
    "InputError",
    "InputTypeError",
    "ManifestError",
    "ModelFolderError",
    "ProviderError",
    "QueryTruncatedWarning",
    "ScoringError",
    "__version__",
]
