"""Where an export may be written, and what it may replace.

An export replaces a folder only when that folder is itself a colembed export: its manifest reads
and describes every file in it, and nothing else is there (`is_export_folder`). Everything else is
refused before any work starts, `overwrite` or not: a user's folder, the source checkpoint itself,
a destination inside the source or containing it, the root, home and working folders. The final
move goes through `colembed.safe_fs.commit_folder(replaceable=is_export_folder)`, which checks
again at the moment of replacing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from colembed.errors import ColembedError, ExportError
from colembed.manifest import MANIFEST_NAME, read_manifest


def _described(folder: Path) -> set[str] | None:
    """The file names the folder's manifest describes, or None when it has no readable manifest."""
    try:
        listed = read_manifest(folder).files
    except (ColembedError, OSError):
        return None
    return set(listed)


def foreign_entries(path: str | os.PathLike) -> list[str]:
    """Entries of `path` its manifest does not describe (all of them without a manifest)."""
    folder = Path(path)
    listed = _described(folder)
    foreign = []
    for entry in sorted(folder.iterdir()):
        if listed is not None and entry.name == MANIFEST_NAME:
            continue
        if entry.is_symlink() or not entry.is_file() or entry.name not in (listed or ()):
            foreign.append(entry.name)
    return foreign


def is_export_folder(path: str | os.PathLike) -> bool:
    """A real folder whose manifest reads and describes every file it holds (no foreign files)."""
    folder = Path(path)
    return (
        folder.is_dir()
        and not folder.is_symlink()
        and _described(folder) is not None
        and not foreign_entries(folder)
    )


def _protected_reason(out: Path, source: Path) -> str | None:
    real, src = out.resolve(), source.resolve()
    home, cwd = Path.home().resolve(), Path.cwd().resolve()
    if real == src:
        return "is the source checkpoint"
    if src in real.parents:
        return "lies inside the source checkpoint"
    if real in src.parents:
        return "contains the source checkpoint"
    if (
        real == Path(real.anchor)
        or real in (home, cwd)
        or real in home.parents
        or real in cwd.parents
    ):
        return "is the root, home or working folder (or one of their parents)"
    return None


def _fingerprint_of(folder: Path) -> str | None:
    """The checkpoint fingerprint an existing export records (read raw: any manifest version)."""
    try:
        return json.loads((folder / MANIFEST_NAME).read_text())["model"]["checkpoint_sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_destination(
    out_dir: str | os.PathLike, source: Path, fingerprint: str, overwrite: bool
) -> Path:
    """The absolute destination, or ExportError saying why it may not be written.

    The last path component is not resolved: a link at `out_dir` is refused, never followed.
    An export of the same checkpoint may be replaced; another model's only with `overwrite`.
    """
    out = Path(os.path.abspath(Path(out_dir).expanduser()))
    reason = _protected_reason(out, source)
    if reason:
        raise ExportError(f"{out}: refusing to export here: it {reason}; choose another --out")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ExportError(f"{out}: exists and is not a folder; choose another --out")
    if not out.exists() or not any(out.iterdir()):
        return out
    foreign = foreign_entries(out)
    if foreign:
        shown = ", ".join(foreign[:5]) + (
            f" (+{len(foreign) - 5} more)" if len(foreign) > 5 else ""
        )
        raise ExportError(
            f"{out}: is not a colembed model folder (it holds {shown}); colembed replaces only its "
            "own exports, even with --overwrite; choose another --out"
        )
    existing = _fingerprint_of(out)
    if existing != fingerprint and not overwrite:
        raise ExportError(
            f"{out}: already holds a different model (checkpoint fingerprint "
            f"{str(existing)[:12]} != {fingerprint[:12]}); pass overwrite=True (--overwrite) "
            "to replace it"
        )
    return out
