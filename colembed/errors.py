"""colembed's exceptions: one base class, typed leaves that also subclass the builtin a caller expects.

Every error about user input names the offending item (its index in the batch) and the reason;
every error about a model folder names the file.
"""

from __future__ import annotations

from typing import Any


class ColembedError(Exception):
    """Base class of every error colembed raises on purpose."""


class InputError(ColembedError, ValueError):
    """An item of a batch cannot be processed. `index` is its position in the input (or None)."""

    def __init__(self, reason: str, *, index: int | None = None, item: Any = None) -> None:
        self.reason = reason
        self.index = index
        self.item = item
        where = f"item {index}: " if index is not None else ""
        super().__init__(f"{where}{reason}")


class InputTypeError(InputError, TypeError):
    """An item is of a type colembed does not accept (for example an int where text was expected)."""


class ImageError(InputError):
    """An image cannot be decoded or falls outside what ColQwen2's preprocessing allows."""


class ModelFolderError(ColembedError, ValueError):
    """A model folder is incomplete, tampered with, or does not match its manifest. Names the file."""

    def __init__(self, reason: str, *, path: Any = None) -> None:
        self.reason = reason
        self.path = path
        where = f"{path}: " if path is not None else ""
        super().__init__(f"{where}{reason}")


class ManifestError(ModelFolderError):
    """The manifest itself is missing, unreadable, or disagrees with a file it describes."""


class DimensionError(ColembedError, ValueError):
    """A vector width (`dim=`) a model cannot give: not an int from 1 to the model's own width."""


class ProviderError(ColembedError, RuntimeError):
    """An execution provider was asked for and cannot be had (no silent CPU fallback)."""


class GraphOutputError(ColembedError, RuntimeError):
    """A graph returned what the model folder's own numbers rule out (the image graph's feature rows
    against the image tokens its preprocessing put in the page prompt): the folder's graphs and
    manifest disagree. Names the folder."""

    def __init__(self, reason: str, *, path: Any = None) -> None:
        self.reason = reason
        self.path = path
        where = f"{path}: " if path is not None else ""
        super().__init__(f"{where}{reason}")


class ExportError(ColembedError, RuntimeError):
    """The exporter refused a checkpoint, an output folder, or graphs that failed their check."""


class ScoringError(ColembedError, ValueError):
    """Embeddings handed to the scorer are malformed (wrong dims, dtype, NaN/inf, empty)."""


class QueryTruncatedWarning(UserWarning):
    """A query longer than the model's bound was cut (its first tokens and its augmentation tokens
    are kept). `index` is its position in the input."""

    def __init__(self, message: str, *, index: int | None = None) -> None:
        self.index = index
        super().__init__(message)
