"""The models colembed knows by name (`models.json`), and where each one's exported folder is.

`models.json` is the one place a named model is described: FastEmbed's fields (model, dim,
description, license, size_in_GB, model_file, additional_files) plus where it comes from
(`checkpoint`, the transformers checkpoint `colembed export` reads; `export_repo`, a Hugging Face
repo holding a published colembed export, or null while there is none). The FastEmbed plugin builds
its model descriptions from these entries and nothing else.

Where `models.json` is read from at run time (`models_json_path`):
  1. a source checkout (editable installs, CI): the repository root, i.e. the folder above this
     package when it holds `pyproject.toml` and `models.json`;
  2. an installed wheel: `colembed/models.json`, a symlink to the root file in the repository that
     setuptools ships as package data (the link is followed when the wheel is built).
The root file is the source of truth; the packaged one is never edited by hand.

Resolution of a name to a folder (`resolve_model_folder`), first hit wins:
  1. `specific_model_path`: an exported folder given by the caller (never falls through);
  2. the cache: `<cache_dir>/colembed-<name>`, where cache_dir is the caller's, else
     `FASTEMBED_CACHE_PATH`, else `<tmp>/fastembed_cache` (FastEmbed's own convention);
  3. a download of `export_repo` into that same cache folder (huggingface_hub.snapshot_download
     with `local_dir`, so the folder holds real files: onnxruntime refuses external data that
     resolves outside the model folder, as the hub cache's symlinks do);
  4. otherwise ModelFolderError with the `colembed export` command that makes the folder.
Offline (`local_files_only=True` or `HF_HUB_OFFLINE=1`) step 3 is skipped: nothing touches the
network, and the error lists what is missing where.

Imports only the standard library and colembed (huggingface_hub lazily, to download); never
fastembed, torch or transformers.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ColembedError, ModelFolderError

MODELS_JSON = "models.json"
FORMAT = "colembed-models"
FORMAT_VERSION = 1
CACHE_ENV = "FASTEMBED_CACHE_PATH"
OFFLINE_ENV = "HF_HUB_OFFLINE"
CACHE_PREFIX = "colembed-"
ARCHITECTURE = "ColQwen2ForRetrieval"

_TRUE = {"1", "on", "yes", "true"}


class UnknownModelError(ColembedError, ValueError):
    """A model name that `models.json` does not list."""


@dataclass(frozen=True)
class ModelEntry:
    """One model of `models.json`."""

    model: str
    dim: int
    description: str
    license: str
    size_in_GB: float
    checkpoint: str
    model_file: str
    additional_files: tuple[str, ...]
    checkpoint_revision: str | None = None
    export_repo: str | None = None
    export_revision: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: Path) -> "ModelEntry":
        def get(key: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
            value = d.get(key)
            if value is None and optional:
                return None
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ColembedError(f"{source}: model {d.get('model')!r} needs {key!r} of type "
                                    f"{kind}, got {value!r}")
            return value

        files = get("additional_files", list)
        if not all(isinstance(f, str) and f for f in files):
            raise ColembedError(f"{source}: additional_files must be file names, got {files!r}")
        return cls(
            model=get("model", str),
            dim=get("dim", int),
            description=get("description", str),
            license=get("license", str),
            size_in_GB=float(get("size_in_GB", (int, float))),
            checkpoint=get("checkpoint", str),
            model_file=get("model_file", str),
            additional_files=tuple(files),
            checkpoint_revision=get("checkpoint_revision", str, optional=True),
            export_repo=get("export_repo", str, optional=True),
            export_revision=get("export_revision", str, optional=True),
        )

    @property
    def files(self) -> tuple[str, ...]:
        """Every file an exported folder of this model must hold."""
        return (self.model_file, *self.additional_files)

    @property
    def cache_folder_name(self) -> str:
        return CACHE_PREFIX + self.model.lower().replace("/", "--")

    def missing_files(self, folder: Path) -> list[str]:
        return [name for name in self.files if not (folder / name).is_file()]

    def export_command(self, out: Path | str) -> str:
        revision = f" --revision {self.checkpoint_revision}" if self.checkpoint_revision else ""
        return f"colembed export {self.checkpoint}{revision} --out {out}"


def models_json_path() -> Path:
    """The `models.json` this colembed reads (see the module docstring for the order)."""
    package = Path(__file__).resolve().parent
    root = package.parent
    if (root / "pyproject.toml").is_file() and (root / MODELS_JSON).is_file():
        return root / MODELS_JSON
    packaged = Path(__file__).with_name(MODELS_JSON)
    if packaged.is_file():
        return packaged
    raise ColembedError(
        f"colembed's model list is missing: neither {packaged} (package data of an installed "
        f"colembed) nor {root / MODELS_JSON} (a source checkout) exists; reinstall colembed")


@functools.lru_cache(maxsize=8)
def _read_entries(path: str) -> tuple[ModelEntry, ...]:
    source = Path(path)
    try:
        data = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ColembedError(f"{source}: unreadable model list ({e})") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ColembedError(f"{source}: not a {FORMAT} file")
    if data.get("format_version") != FORMAT_VERSION:
        raise ColembedError(f"{source}: format_version {data.get('format_version')!r} is not "
                            f"{FORMAT_VERSION}")
    entries = tuple(ModelEntry.from_dict(d, source=source) for d in data.get("models", []))
    names = [e.model.lower() for e in entries]
    if len(set(names)) != len(names):
        raise ColembedError(f"{source}: model names must be unique (case-insensitively): {names}")
    return entries


def known_models(path: str | Path | None = None) -> tuple[ModelEntry, ...]:
    """Every entry of `models.json` (or of the file at `path`)."""
    return _read_entries(str(Path(path) if path is not None else models_json_path()))


def get_model(name: str, path: str | Path | None = None) -> ModelEntry:
    """The entry named `name`, case-insensitively."""
    entries = known_models(path)
    for entry in entries:
        if entry.model.lower() == str(name).lower():
            return entry
    raise UnknownModelError(f"colembed knows no model named {name!r}; it knows "
                            f"{[e.model for e in entries]}")


def default_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The caller's cache dir, else FASTEMBED_CACHE_PATH, else <tmp>/fastembed_cache."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    default = Path(tempfile.gettempdir()) / "fastembed_cache"
    return Path(os.environ.get(CACHE_ENV, default)).expanduser()


def is_offline(local_files_only: bool = False) -> bool:
    return bool(local_files_only) or os.environ.get(OFFLINE_ENV, "").strip().lower() in _TRUE


def check_model_folder(entry: ModelEntry, folder: Path) -> Path:
    """`folder` holds every file of `entry` and its manifest describes the same model."""
    from .manifest import read_manifest

    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFolderError(f"not a folder (expected a colembed export of {entry.model})",
                               path=folder)
    missing = entry.missing_files(folder)
    if missing:
        raise ModelFolderError(f"incomplete export of {entry.model}: missing {missing}",
                               path=folder)
    manifest = read_manifest(folder)
    architecture = manifest.model.architecture
    if architecture != ARCHITECTURE or manifest.embedding_dim != entry.dim:
        raise ModelFolderError(
            f"this folder holds a {architecture} with {manifest.embedding_dim}-dim vectors, not "
            f"{entry.model} ({ARCHITECTURE}, {entry.dim}-dim)", path=folder)
    return folder


def resolve_model_folder(
    model: str | ModelEntry,
    *,
    specific_model_path: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
) -> Path:
    """The exported folder of `model`; see the module docstring for the order."""
    entry = model if isinstance(model, ModelEntry) else get_model(model)
    if specific_model_path:
        return check_model_folder(entry, Path(specific_model_path).expanduser())

    cached = default_cache_dir(cache_dir) / entry.cache_folder_name
    if cached.is_dir() and not entry.missing_files(cached):
        return check_model_folder(entry, cached)

    offline = is_offline(local_files_only)
    if entry.export_repo and not offline:
        _download(entry, cached)
        return check_model_folder(entry, cached)

    if cached.is_dir():
        found = f"{cached} is incomplete: missing {entry.missing_files(cached)}"
    else:
        found = f"{cached} does not exist"
    if entry.export_repo:
        why = (f"offline ({OFFLINE_ENV}=1 or local_files_only=True), so the published export "
               f"{entry.export_repo} was not downloaded")
    else:
        why = "no published export of it exists yet"
    raise ModelFolderError(
        f"no exported {entry.model} model: {found}; {why}. Export it from the checkpoint "
        f"{entry.checkpoint} with `{entry.export_command(cached)}` (pip install "
        "'colembed[export]'), or pass specific_model_path=<an exported folder>")


def _download(entry: ModelEntry, folder: Path) -> None:
    """The export's files from the hub, straight into `folder` (resumes a partial folder)."""
    import huggingface_hub

    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        huggingface_hub.snapshot_download(
            entry.export_repo,
            revision=entry.export_revision,
            local_dir=folder,
            allow_patterns=list(entry.files),
            library_name="colembed",
        )
    except (OSError, ValueError) as e:  # hub HTTP, connection and not-found errors are among these
        raise ModelFolderError(
            f"could not download {entry.export_repo} ({type(e).__name__}: {e}); export the model "
            f"yourself with `{entry.export_command(folder)}`", path=folder) from e
    missing = entry.missing_files(folder)
    if missing:
        raise ModelFolderError(f"{entry.export_repo} does not hold {missing}; it is not a complete "
                               f"colembed export of {entry.model}", path=folder)
