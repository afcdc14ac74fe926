"""Every path colembed reads from a model folder, and every folder it deletes, goes through here.

Three rules, each owned by one function so that no caller can get them wrong:

- `inside(folder, name)`: a file name that comes from a manifest, a registry entry or a user's
  model name is resolved against its folder (symlinks followed) and refused unless it stays inside
  it. Absolute names, `..` segments and links pointing out of the folder raise ModelFolderError
  without revealing anything about the target.
- `remove_tree(path, owner=...)`: colembed deletes only folders it made. A folder counts as ours
  when `owner(path)` says so: a staging folder carries `STAGING_MARKER`, a demo/work folder carries
  `WORK_MARKER`, an export folder is one whose manifest describes every file it holds
  (`is_export_folder` lives with the manifest). Anything else is refused with ColembedError, so a
  flag like `--overwrite` or `--out .` can never wipe a user's directory.

- `open_file(path, within=roots)`: a document colembed indexes or renders is opened so that the
  file read is the one at `path` at that moment and a regular file: with `within`, `path` must lie
  in one of those folders and is opened component by component from the folder, following no link
  (`O_NOFOLLOW` at every step), so a file or folder swapped for a link after it was checked is
  refused, not read. The caller hashes and decodes that one descriptor, never the name again.

`staging_folder(dest)` makes the marked sibling folder an operation assembles its output in, and
`commit_folder(staging, dest, replaceable=...)` moves it into place (replacing `dest` only when
`replaceable(dest)` vouches for it). Standard library only.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import time
from pathlib import Path
from typing import BinaryIO, Callable, Iterable

from .errors import ColembedError, ModelFolderError

STAGING_MARKER = ".colembed-staging"
REPLACED_PURPOSE = "replaced output"  # the marker's purpose on what commit_folder sets aside
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
        raise ModelFolderError(
            f"file name {raw!r} resolves outside the model folder (a link pointing elsewhere)"
        )
    return path


class UnsafePathError(ColembedError, PermissionError):
    """A file to read is not the one that was checked: a link in its path (swapped in after the
    check), outside the folders it must stay in, or not a regular file."""


# An open that meets a link where O_NOFOLLOW forbids one fails with ELOOP (Linux, macOS), EMLINK
# (FreeBSD) or, for a link where a folder was asked for, ENOTDIR.
_LINK_ERRNOS = frozenset({errno.ELOOP, errno.EMLINK, errno.ENOTDIR})
_WALKS_WITHOUT_LINKS = (
    hasattr(os, "O_NOFOLLOW") and hasattr(os, "O_DIRECTORY") and os.open in os.supports_dir_fd
)


def open_file(
    path: str | os.PathLike, *, within: Iterable[str | os.PathLike] | None = None
) -> BinaryIO:
    """`path` opened for reading as a binary file object, refusing (UnsafePathError) anything but
    a regular file (a FIFO would block the reader forever; it is opened non-blocking to find out).

    With `within` (folders, resolved here), `path` must be absolute and lie inside one of them, and
    the descriptor returned is that very file: each component under the folder is opened relative
    to the one before with `O_NOFOLLOW`, so no link is followed and nothing swapped in after a
    check is read. Where the platform has no `openat` (Windows), the opened file's identity
    (device, inode) must be that of the resolved path, which must lie inside the folder."""
    path = Path(path)
    if within is None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    else:
        fd = _open_within(path, [Path(r).resolve() for r in within])
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafePathError(f"{path}: not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        handle = os.fdopen(fd, "rb")
        handle.raw.name = str(path)  # not the bare descriptor number, in repr and messages
        return handle
    except BaseException:
        os.close(fd)
        raise


def _open_within(path: Path, roots: list[Path]) -> int:
    if not path.is_absolute():
        raise UnsafePathError(f"{path}: not an absolute path")
    root = next((r for r in roots if path == r or r in path.parents), None)
    if root is None or ".." in path.parts:
        raise UnsafePathError(f"{path}: outside the folders it may be read from")
    parts = path.relative_to(root).parts
    if not parts:
        raise UnsafePathError(f"{path}: not a regular file")
    if not _WALKS_WITHOUT_LINKS:
        return _open_checked_identity(path, root)
    folder = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = os.O_RDONLY | os.O_NOFOLLOW | (os.O_NONBLOCK if last else os.O_DIRECTORY)
            try:
                fd = os.open(part, flags, dir_fd=folder)
            except OSError as e:
                if e.errno in _LINK_ERRNOS and os.path.islink(os.path.join(root, *parts[: i + 1])):
                    raise UnsafePathError(
                        f"{path}: a link in its path "
                        f"({os.path.join(*parts[: i + 1])}) is not followed "
                        "here"
                    ) from None
                raise
            os.close(folder)
            folder = fd
        return folder
    except BaseException:
        os.close(folder)
        raise


def _open_checked_identity(path: Path, root: Path) -> int:
    """Without `openat`: open, then check the descriptor is the file the resolved path names."""
    real = path.resolve()
    if real != path or not (real == root or root in real.parents):
        raise UnsafePathError(f"{path}: a link in its path is not followed here")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    opened, named = os.fstat(fd), os.stat(real)
    if (opened.st_dev, opened.st_ino) != (named.st_dev, named.st_ino):
        os.close(fd)
        raise UnsafePathError(f"{path}: the file changed while it was opened")
    return fd


def _write_marker(folder: Path, marker: str, purpose: str) -> None:
    (folder / marker).write_text(
        json.dumps({"purpose": purpose, "pid": os.getpid(), "created": time.time()}) + "\n"
    )


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
                "or new folder"
            )
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
    if (
        resolved == Path(resolved.anchor)
        or resolved == Path.home().resolve()
        or resolved == Path.cwd().resolve()
        or resolved in Path.cwd().resolve().parents
    ):
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


def commit_folder(
    staging: str | os.PathLike, dest: str | os.PathLike, *, replaceable: Callable[[Path], bool]
) -> Path:
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
                    f"{dest}: exists and does not hold colembed's output; refusing to replace it"
                )
            os.rename(dest, old)
            _write_marker(old, STAGING_MARKER, REPLACED_PURPOSE)
            os.rename(staging, dest)
            (dest / STAGING_MARKER).unlink()
            discard_staging(old)
            return dest
    os.rename(staging, dest)
    (dest / STAGING_MARKER).unlink()
    return dest
