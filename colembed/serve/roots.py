"""The folders an index job may read (`--allow-root`), and how stored paths are shown.

A client names files as `{"root": NAME, "path": "sub/dir/file.pdf"}`: a path relative to one of
the roots the server was started with. Refused, naming the path: absolute paths, any `..`
component, a path that resolves (symlinks followed) outside its root, a root not configured.
Walking a folder follows no symlinked folder, and a symlinked file is taken only if its target
is inside the same root; every file is handed to the index by its resolved path, so the stored
path is the real one and is inside a root.

Stored paths are shown as `NAME/relative/path` when a root holds them; a page stored from
elsewhere (indexed by `colembed index` before) is shown by its file name only, so a response
never reveals the server's folder layout. A server started without roots shows stored paths as
they are (it is the user's own machine: `colembed serve` binds 127.0.0.1 by default).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

from ..errors import ColembedError
from ..index.sources import kind_of  # what counts as a document (one home: sources.py)


class PathRefused(ColembedError, ValueError):
    """A path a client gave is not allowed (says which and why): 403."""


class PathMissing(PathRefused):
    """A path inside a root that does not exist: 404."""


@dataclass(frozen=True)
class Root:
    name: str
    folder: Path  # resolved


def parse_roots(specs: list[str]) -> list[Root]:
    """`--allow-root` values: `DIR` (named after its last component) or `NAME=DIR`."""
    roots: list[Root] = []
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep:
            name, folder = "", spec
        path = Path(folder).expanduser().resolve()
        if not path.is_dir():
            raise ColembedError(f"--allow-root {spec}: not a folder")
        name = name or path.name or "root"
        if "/" in name or name in (".", ".."):
            raise ColembedError(f"--allow-root {spec}: a root's name may not contain '/'")
        if any(r.name == name for r in roots):
            raise ColembedError(f"--allow-root {spec}: two roots named {name!r} (use NAME=DIR)")
        roots.append(Root(name, path))
    return roots


class Roots:
    def __init__(self, roots: list[Root]) -> None:
        self.roots = list(roots)

    def __bool__(self) -> bool:
        return bool(self.roots)

    def names(self) -> list[str]:
        return [r.name for r in self.roots]

    def resolve(self, root_name: str | None, path: str) -> tuple[Root, Path]:
        """The root and resolved path a client's (root, relative path) names, or PathRefused."""
        if not self.roots:
            raise PathRefused(
                "indexing over HTTP is off: the server was started without --allow-root"
            )
        if root_name is None:
            if len(self.roots) > 1:
                raise PathRefused(f"{path!r}: name its root (one of {self.names()})")
            root = self.roots[0]
        else:
            root = next((r for r in self.roots if r.name == root_name), None)
            if root is None:
                raise PathRefused(f"root {root_name!r} is not one of {self.names()}")
        if "\x00" in path:
            raise PathRefused(f"{path!r}: NUL in path")
        if (
            PurePosixPath(path).is_absolute()
            or PureWindowsPath(path).is_absolute()
            or PureWindowsPath(path).drive
            or path.startswith("~")
        ):
            raise PathRefused(
                f"{path!r}: absolute paths are refused; give a path relative to root {root.name!r}"
            )
        if ".." in PurePosixPath(path.replace("\\", "/")).parts:
            raise PathRefused(f"{path!r}: '..' is refused in paths")
        target = (root.folder / path).resolve()
        if not _inside(target, root.folder):
            raise PathRefused(f"{path!r}: leads outside root {root.name!r} (a symlink)")
        if not target.exists():
            raise PathMissing(f"{path!r}: no such file or folder in root {root.name!r}")
        return root, target

    def files(
        self, root: Root, target: Path, exclude: tuple[Path, ...] = ()
    ) -> tuple[list[Path], list[tuple[Path, str]]]:
        """Documents under `target` (resolved, inside `root`) and what was left out, with why;
        folders in `exclude` (the index's own, when it sits inside a root) are not walked."""
        excluded = {Path(p).resolve() for p in exclude}
        if target.is_file():
            if kind_of(target) is None:
                return [], [(target, "not a PDF or image")]
            return [target], []
        found: list[Path] = []
        left: list[tuple[Path, str]] = []
        for folder, dirs, names in os.walk(target, followlinks=False):
            here = Path(folder)
            for d in list(dirs):
                if (here / d).is_symlink():
                    left.append((here / d, "symlinked folder (not followed)"))
            dirs[:] = sorted(
                d
                for d in dirs
                if not d.startswith(".")
                and not (here / d).is_symlink()
                and here / d not in excluded
            )
            for name in sorted(names):
                if name.startswith("."):
                    continue
                path = here / name
                real = path.resolve()
                if not _inside(real, root.folder):
                    left.append((path, "symlink leads outside the root"))
                elif not real.is_file() or kind_of(real) is None:
                    left.append((path, "not a PDF or image"))
                else:
                    found.append(real)
        return list(dict.fromkeys(found)), left

    def display(self, path: str | os.PathLike) -> str:
        """A stored path as clients see it: `root/relative` or the bare file name (with no
        root configured: the stored path itself)."""
        p = Path(path)
        if not self.roots:
            return str(p)
        for root in self.roots:
            if _inside(p, root.folder):
                return str(PurePosixPath(root.name, *p.relative_to(root.folder).parts))
        return p.name


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents
