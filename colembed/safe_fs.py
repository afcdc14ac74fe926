"""Every path colembed reads from a model folder, and every folder it deletes, goes through here.

Two rules, each owned by one function so that no caller can get them wrong:

- `inside(folder, name)`: a file name that comes from a manifest, a registry entry or a user's
  model name is resolved against its folder (symlinks followed) and refused unless it stays inside
  it. Absolute names, `..` segments and links pointing out of the folder raise ModelFolderError
  without revealing anything about the target.
- `remove_tree(path, owner=...)`: colembed deletes only folders it made. A folder counts as ours
  when `owner(path)` says so: a staging folder carries `STAGING_MARKER`, a demo/work folder carries
  `WORK_MARKER`, an export folder is one whose manifest describes every file it holds
  (`is_export_folder` lives with the manifest). Anything else is refused with ColembedError, so a
  flag like `--overwrite` or `--out .` can never wipe a user's directory.

`staging_folder(dest)` makes the marked sibling folder an operation assembles its output in, and
`commit_folder(staging, dest, replaceable=...)` moves it into place (replacing `dest` only when
`replaceable(dest)` vouches for it). Standard library only.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from .errors import ColembedError, ModelFolderError

STAGING_MARKER = ".colembed-staging"
WORK_MARKER = ".colembed-workdir"


class UnsafeDeletionError(ColembedError, PermissionError):
    """colembed was asked to delete or replace something it did not create."""


def inside(folder: str | os.PathLike, name: str | os.PathLike) -> Path:
    """`folder / name`, resolved, guaranteed to lie inside `folder` (after resolving links)."""
    raw = str(name)
    if not raw or os.path.isabs(raw) or raw.startswith(("/", "\\")) or ":" in Path(raw).parts[0]:
        raise ModelFolderError(f"file name {raw!r} is not a relative name inside the model folder")
    if any(part == ".." for part in Path(raw.replace("\\", "/")).parts):
        raise ModelFolderError(f"file name {raw!r} leaves the model folder")
    root = Path(folder).resolve()
    path = (root / raw).resolve()
    if path != root and root not in path.parents:
        raise ModelFolderError(f"file name {raw!r} resolves outside the model folder "
                               "(a link pointing elsewhere)")
    return path


def _write_marker(folder: Path, marker: str, purpose: str) -> None:
    (folder / marker).write_text(json.dumps({"purpose": purpose, "pid": os.getpid(),
                                             "created": time.time()}) + "\n")


def has_marker(folder: str | os.PathLike, marker: str) -> bool:
    path = Path(folder) / marker
    return path.is_file() and not path.is_symlink()


def make_work_folder(path: str | os.PathLike, purpose: str) -> Path:
    """A folder colembed may later clear: created (with its marker) if absent, reused if it carries
    our marker, refused if it exists with content we did not put there."""
    folder = Path(path)
    if folder.exists():
        if not folder.is_dir():
            raise UnsafeDeletionError(f"{folder}: exists and is not a folder")
        if has_marker(folder, WORK_MARKER):
            return folder
        if any(folder.iterdir()):
            raise UnsafeDeletionError(
                f"{folder}: folder is not empty and was not created by colembed; choose an empty "
                "or new folder")
    folder.mkdir(parents=True, exist_ok=True)
    _write_marker(folder, WORK_MARKER, purpose)
    return folder


def staging_folder(dest: str | os.PathLike, purpose: str) -> Path:
    """A fresh, marked sibling of `dest` to assemble output in (same filesystem: the final move is
    one rename)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = dest.parent / f".{dest.name}.staging-{os.getpid()}-{time.monotonic_ns()}"
    staging.mkdir()
    _write_marker(staging, STAGING_MARKER, purpose)
    return staging


def is_staging_folder(path: str | os.PathLike) -> bool:
    return has_marker(path, STAGING_MARKER)


def is_work_folder(path: str | os.PathLike) -> bool:
    return has_marker(path, WORK_MARKER)


def remove_tree(path: str | os.PathLike, *, owner: Callable[[Path], bool]) -> None:
    """Delete `path` (a folder) only if `owner(path)` vouches that colembed made it."""
    path = Path(path)
    if not path.exists():
        return
    if path.is_symlink() or not path.is_dir():
        raise UnsafeDeletionError(f"{path}: refusing to delete: not a folder colembed created")
    resolved = path.resolve()
    if resolved == Path(resolved.anchor) or resolved == Path.home().resolve() \
            or resolved == Path.cwd().resolve() or resolved in Path.cwd().resolve().parents:
        raise UnsafeDeletionError(f"{path}: refusing to delete the root, home or working folder")
    if not owner(path):
        raise UnsafeDeletionError(f"{path}: refusing to delete: not a folder colembed created")
    shutil.rmtree(path)


def discard_staging(staging: str | os.PathLike) -> None:
    """Remove a staging folder made by `staging_folder` (best effort: used on the error path)."""
    try:
        remove_tree(staging, owner=is_staging_folder)
    except (OSError, UnsafeDeletionError):
        pass


def commit_folder(staging: str | os.PathLike, dest: str | os.PathLike, *,
                  replaceable: Callable[[Path], bool]) -> Path:
    """Move a finished staging folder to `dest`. An existing `dest` is replaced only when it is
    empty or `replaceable(dest)` says it holds colembed's own output; otherwise refused."""
    staging, dest = Path(staging), Path(dest)
    if not is_staging_folder(staging):
        raise UnsafeDeletionError(f"{staging}: not a colembed staging folder")
    if dest.exists() or dest.is_symlink():
        if dest.is_dir() and not dest.is_symlink() and not any(dest.iterdir()):
            dest.rmdir()
        else:
            old = dest.parent / f".{dest.name}.replaced-{os.getpid()}-{time.monotonic_ns()}"
            if dest.is_symlink() or not dest.is_dir() or not replaceable(dest):
                raise UnsafeDeletionError(
                    f"{dest}: exists and does not hold colembed's output; refusing to replace it")
            os.rename(dest, old)
            _write_marker(old, STAGING_MARKER, "replaced output")
            os.rename(staging, dest)
            (dest / STAGING_MARKER).unlink()
            discard_staging(old)
            return dest
    os.rename(staging, dest)
    (dest / STAGING_MARKER).unlink()
    return dest
