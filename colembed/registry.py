"""The models colembed knows by name (`models.json`), and where each one's exported folder is.

`models.json` (the one copy sits at the repository's top level; the wheel ships it as
`colembed/models.json`, copied there by setup.py's build step) describes each named model: FastEmbed's fields
(model, dim, description, license, size_in_GB) plus its `family` (`colembed.families`: a folder of
another family is refused) and where it comes from (`checkpoint`, what `colembed export` reads; for
a PEFT adapter such as `vidore/colqwen2.5-v0.2`, `base_checkpoint` records the base its
`adapter_config.json` names; `export_repo`, a Hugging Face repo holding a published colembed
export, or null while there is none; `aliases`, other names of the same model: a family's
plain name for the checkpoint its reference library targets, e.g. "colqwen3" for TomoroAI's 4B,
docs/models-colqwen3.md. An alias resolves to its entry, cache folder and export command
included, so one export serves every name of the model). It names no files: which files a folder
needs comes from the folder's own manifest (`layout.required_files`), so an export with inline
weights (no `.onnx_data`), or one holding only some variants, is complete when it holds what its
manifest lists for the variant asked for.

Resolution of a name to a folder (`resolve_model_folder`), first hit wins:
  1. `specific_model_path`: an exported folder given by the caller (never falls through);
  2. the cache: `<cache_dir>/colembed-<name>`, where cache_dir is the caller's, else
     `FASTEMBED_CACHE_PATH`, else `<tmp>/fastembed_cache` (FastEmbed's own convention);
  3. a download of `export_repo` into that same cache folder (huggingface_hub.snapshot_download
     with `local_dir`, so the folder holds real files: onnxruntime refuses external data that
     resolves outside the model folder, as the hub cache's symlinks do): the manifest first, then
     the files it lists for the variant;
  4. otherwise ModelFolderError with the `colembed export` command that makes the folder.
Offline (`local_files_only=True` or `HF_HUB_OFFLINE=1`) step 3 is skipped: nothing touches the
network, and the error lists what is missing where.

The default cache lives under a world-writable folder, so on POSIX a cached folder is used only
when it (and every file it must hold) belongs to this user and is writable by nobody else; any
other user could otherwise plant a model there (`check_private`). A `specific_model_path` is the
caller's own choice and is not checked for ownership.

Imports only the standard library and colembed (huggingface_hub lazily, to download); never
fastembed, torch or transformers.
"""

from __future__ import annotations

import functools
import json
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .contracts import ARCHITECTURE
from .errors import ColembedError, ModelFolderError
from .families import FAMILIES
from .layout import BASE_VARIANT, MANIFEST_NAME, required_files
from .safe_fs import inside

MODELS_JSON = "models.json"
FORMAT = "colembed-models"
FORMAT_VERSION = 1
CACHE_ENV = "FASTEMBED_CACHE_PATH"
OFFLINE_ENV = "HF_HUB_OFFLINE"
CACHE_PREFIX = "colembed-"

_TRUE = {"1", "on", "yes", "true"}
# A model name becomes a folder name in the cache: one or two plain segments ("org/name"), so that
# no entry can point outside the cache. Names users pass are only matched against these entries.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


class UnknownModelError(ColembedError, ValueError):
    """A model name that `models.json` does not list."""


@dataclass(frozen=True)
class ModelEntry:
    """One model of `models.json`."""

    model: str
    family: str
    dim: int
    description: str
    license: str
    size_in_GB: float
    checkpoint: str
    checkpoint_revision: str | None = None
    base_checkpoint: str | None = None
    export_repo: str | None = None
    export_revision: str | None = None
    aliases: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """The entry's name, then its aliases."""
        return (self.model, *self.aliases)

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: Path) -> "ModelEntry":
        def get(key: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
            value = d.get(key)
            if value is None and optional:
                return None
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ColembedError(
                    f"{source}: model {d.get('model')!r} needs {key!r} of type "
                    f"{kind}, got {value!r}"
                )
            return value

        name = get("model", str)
        if not _NAME.fullmatch(name) or ".." in name:
            raise ColembedError(
                f"{source}: model name {name!r} is not a plain name (letters, "
                "digits, . _ -, at most one /)"
            )
        aliases = d.get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
            raise ColembedError(
                f"{source}: model {name!r}: 'aliases' must be a list of names, got {aliases!r:.60}"
            )
        for alias in aliases:
            if not _NAME.fullmatch(alias) or ".." in alias:
                raise ColembedError(
                    f"{source}: model {name!r}: alias {alias!r} is not a plain "
                    "name (letters, digits, . _ -, at most one /)"
                )
        family = get("family", str)
        if family not in FAMILIES:
            raise ColembedError(
                f"{source}: model {name!r} has family {family!r}, not one of {sorted(FAMILIES)}"
            )
        return cls(
            model=name,
            family=family,
            dim=get("dim", int),
            description=get("description", str),
            license=get("license", str),
            size_in_GB=float(get("size_in_GB", (int, float))),
            checkpoint=get("checkpoint", str),
            checkpoint_revision=get("checkpoint_revision", str, optional=True),
            base_checkpoint=get("base_checkpoint", str, optional=True),
            export_repo=get("export_repo", str, optional=True),
            export_revision=get("export_revision", str, optional=True),
            aliases=tuple(aliases),
        )

    @property
    def cache_folder_name(self) -> str:
        return CACHE_PREFIX + self.model.lower().replace("/", "--")

    def export_command(self, out: Path | str) -> str:
        revision = f" --revision {self.checkpoint_revision}" if self.checkpoint_revision else ""
        return f"colembed export {self.checkpoint}{revision} --out {out}"


def models_json_path() -> Path:
    """The `models.json` this colembed reads: the wheel's `colembed/models.json`, and in a source
    checkout (an editable install, which has no build step) the top-level file it is built from.

    The source tree never holds `colembed/models.json` (tests/project/test_packaging.py), so the two
    places are one file seen from an installed wheel and from a checkout."""
    packaged = Path(__file__).with_name(MODELS_JSON)
    return packaged if packaged.is_file() else Path(__file__).resolve().parents[1] / MODELS_JSON


@functools.lru_cache(maxsize=8)
def _read_entries(path: str) -> tuple[ModelEntry, ...]:
    source = Path(path)
    try:
        data = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ColembedError(f"{source}: unreadable model list ({e}); reinstall colembed") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ColembedError(f"{source}: not a {FORMAT} file")
    if data.get("format_version") != FORMAT_VERSION:
        raise ColembedError(
            f"{source}: format_version {data.get('format_version')!r} is not {FORMAT_VERSION}"
        )
    entries = tuple(ModelEntry.from_dict(d, source=source) for d in data.get("models", []))
    names = [n.lower() for e in entries for n in e.names]
    if len(set(names)) != len(names):
        raise ColembedError(
            f"{source}: model names and aliases must be unique (case-insensitively): {names}"
        )
    return entries


def known_models(path: str | Path | None = None) -> tuple[ModelEntry, ...]:
    """Every entry of `models.json` (or of the file at `path`)."""
    return _read_entries(str(Path(path) if path is not None else models_json_path()))


def known_names(path: str | Path | None = None) -> tuple[str, ...]:
    """Every name `get_model` takes: each entry's name, then its aliases."""
    return tuple(n for entry in known_models(path) for n in entry.names)


def get_model(name: str, path: str | Path | None = None) -> ModelEntry:
    """The entry named `name` (its name or one of its aliases), case-insensitively."""
    entries = known_models(path)
    for entry in entries:
        if str(name).lower() in (n.lower() for n in entry.names):
            return entry
    raise UnknownModelError(
        f"colembed knows no model named {name!r}; it knows {list(known_names(path))}"
    )


def default_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The caller's cache dir, else FASTEMBED_CACHE_PATH, else <tmp>/fastembed_cache."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    default = Path(tempfile.gettempdir()) / "fastembed_cache"
    return Path(os.environ.get(CACHE_ENV, default)).expanduser()


def is_offline(local_files_only: bool = False) -> bool:
    return bool(local_files_only) or os.environ.get(OFFLINE_ENV, "").strip().lower() in _TRUE


def missing_files(folder: Path, variant: str = BASE_VARIANT) -> list[str]:
    """What `folder` lacks to serve `variant`, by its own manifest ([manifest name] without one)."""
    from .manifest import read_manifest

    if not inside(folder, MANIFEST_NAME).is_file():
        return [MANIFEST_NAME]
    manifest = read_manifest(folder)
    return [
        name for name in required_files(manifest, variant) if not inside(folder, name).is_file()
    ]


def check_private(folder: Path, names: list[str] | tuple[str, ...] = ()) -> None:
    """`folder` and its files `names` belong to this user and only this user may write them.

    Applied to cached folders (the default cache sits in the world-writable temp folder). As
    OpenSSH does for its files, a group-writable file passes only when its group is the user's
    private group (the umask-002 default of many Linux distributions). POSIX only: where
    `os.getuid` does not exist (Windows) ownership is left to the ACLs.
    """
    getuid = getattr(os, "getuid", None)
    if getuid is None:
        return
    uid = getuid()
    for path in [Path(folder)] + [inside(folder, name) for name in names]:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        if st.st_uid != uid:
            raise ModelFolderError(
                f"owned by user id {st.st_uid}, not by you ({uid}); another user could have put "
                "this model in the shared cache. Refusing to load it: export the model yourself, "
                "use another cache_dir, or pass specific_model_path",
                path=path,
            )
        others = st.st_mode & stat.S_IWOTH or (
            st.st_mode & stat.S_IWGRP and not _private_group(st.st_gid, uid)
        )
        if others:
            raise ModelFolderError(
                f"writable by other users (mode {stat.filemode(st.st_mode)}); refusing to load a "
                "cached model anyone could replace (chmod go-w it, or use another cache_dir)",
                path=path,
            )


def _private_group(gid: int, uid: int) -> bool:
    """The group is `uid`'s own: its primary group, named after it, with no other members."""
    try:
        import grp
        import pwd

        user, group = pwd.getpwuid(uid), grp.getgrgid(gid)
    except (ImportError, KeyError):
        return False
    return (
        user.pw_gid == gid and group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}
    )


def check_model_folder(entry: ModelEntry, folder: Path, variant: str = BASE_VARIANT) -> Path:
    """`folder` holds every file its manifest lists for `variant` and describes the same model."""
    from .manifest import read_manifest

    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFolderError(
            f"not a folder (expected a colembed export of {entry.model})", path=folder
        )
    missing = missing_files(folder, variant)
    if missing:
        raise ModelFolderError(
            f"incomplete export of {entry.model}: missing {missing}", path=folder
        )
    manifest = read_manifest(folder)
    architecture = manifest.model.architecture
    if (architecture, manifest.family, manifest.embedding_dim) != (
        ARCHITECTURE,
        entry.family,
        entry.dim,
    ):
        raise ModelFolderError(
            f"this folder holds a {manifest.family} {architecture} with "
            f"{manifest.embedding_dim}-dim vectors, not {entry.model} ({entry.family} "
            f"{ARCHITECTURE}, {entry.dim}-dim)",
            path=folder,
        )
    return folder


def _check_cached(entry: ModelEntry, folder: Path, variant: str) -> Path:
    check_private(folder, [MANIFEST_NAME])
    check_model_folder(entry, folder, variant)
    from .manifest import read_manifest

    check_private(folder, required_files(read_manifest(folder), variant))
    return folder


def resolve_model_folder(
    model: str | ModelEntry,
    *,
    specific_model_path: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
    variant: str = BASE_VARIANT,
) -> Path:
    """The exported folder of `model`; see the module docstring for the order."""
    entry = model if isinstance(model, ModelEntry) else get_model(model)
    if specific_model_path:
        return check_model_folder(entry, Path(specific_model_path).expanduser(), variant)

    cached = default_cache_dir(cache_dir) / entry.cache_folder_name
    if cached.is_dir():
        check_private(cached, [MANIFEST_NAME])
        missing = missing_files(cached, variant)
        if not missing:
            return _check_cached(entry, cached, variant)
    else:
        missing = []

    offline = is_offline(local_files_only)
    if entry.export_repo and not offline:
        _download(entry, cached, variant)
        return _check_cached(entry, cached, variant)

    found = (
        f"{cached} is incomplete: missing {missing}"
        if cached.is_dir()
        else f"{cached} does not exist"
    )
    if entry.export_repo:
        why = (
            f"offline ({OFFLINE_ENV}=1 or local_files_only=True), so the published export "
            f"{entry.export_repo} was not downloaded"
        )
    else:
        why = "no published export of it exists yet"
    raise ModelFolderError(
        f"no exported {entry.model} model: {found}; {why}. Export it from the checkpoint "
        f"{entry.checkpoint} with `{entry.export_command(cached)}` (pip install "
        "'colembed[export]'), or pass specific_model_path=<an exported folder>"
    )


def _download(entry: ModelEntry, folder: Path, variant: str) -> None:
    """The export's manifest, then the files it lists for `variant`, from the hub straight into
    `folder` (resumes a partial folder)."""
    import huggingface_hub

    from .manifest import read_manifest

    folder.parent.mkdir(parents=True, exist_ok=True)

    def fetch(names: list[str]) -> None:
        try:
            huggingface_hub.snapshot_download(
                entry.export_repo,
                revision=entry.export_revision,
                local_dir=folder,
                allow_patterns=names,
                library_name="colembed",
            )
        except (OSError, ValueError) as e:  # hub HTTP, connection and not-found errors are these
            raise ModelFolderError(
                f"could not download {entry.export_repo} ({type(e).__name__}: {e}); export the "
                f"model yourself with `{entry.export_command(folder)}`",
                path=folder,
            ) from e

    fetch([MANIFEST_NAME])
    if not inside(folder, MANIFEST_NAME).is_file():
        raise ModelFolderError(
            f"{entry.export_repo} holds no {MANIFEST_NAME}; it is not a "
            f"colembed export of {entry.model}",
            path=folder,
        )
    fetch(required_files(read_manifest(folder), variant))
    missing = missing_files(folder, variant)
    if missing:
        raise ModelFolderError(
            f"{entry.export_repo} does not hold {missing}; it is not a complete "
            f"colembed export of {entry.model}",
            path=folder,
        )
