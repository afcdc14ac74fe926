"""The manifest: one JSON file that fully describes an exported model folder.

Written by the exporter, read and verified by the runtime. It lists every file with its size and
sha256, each graph's contract per variant, the preprocessing constants, the architecture numbers
the host needs (rotary, merge size, widths), the export check's figures and the versions used.
Nothing the runtime needs is read from anywhere else in the folder except the tokenizer itself.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .contracts import GraphContract
from .errors import ManifestError, ModelFolderError
from .layout import MANIFEST_NAME
FORMAT = "colembed-model"
FORMAT_VERSION = 1
_HASH_CHUNK = 1 << 22


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def describe_file(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": sha256_of(path)}


@dataclass(frozen=True)
class GraphEntry:
    """One graph of one variant: its file, its external-data file (if any) and its contract."""

    file: str
    contract: GraphContract
    data_file: str | None = None
    opset: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "data_file": self.data_file, "opset": self.opset,
                "contract": self.contract.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GraphEntry":
        return cls(file=d["file"], data_file=d.get("data_file"), opset=d.get("opset"),
                   contract=GraphContract.from_dict(d["contract"]))


@dataclass(frozen=True)
class Manifest:
    model: dict[str, Any]  # name, source, revision, architecture, random_weights
    embedding_dim: int
    preprocess: dict[str, Any]  # PreprocessConfig.to_dict()
    architecture: dict[str, Any]  # text_hidden, vision_head_dim, ...
    variants: dict[str, dict[str, GraphEntry]]  # variant -> role -> graph
    files: dict[str, dict[str, Any]]  # relative name -> {size, sha256}
    scorer: GraphEntry | None = None
    checks: dict[str, Any] = field(default_factory=dict)  # variant -> figures of its export check
    versions: dict[str, str] = field(default_factory=dict)
    created: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "model": self.model,
            "embedding_dim": self.embedding_dim,
            "preprocess": self.preprocess,
            "architecture": self.architecture,
            "variants": {v: {r: g.to_dict() for r, g in graphs.items()}
                         for v, graphs in self.variants.items()},
            "scorer": self.scorer.to_dict() if self.scorer else None,
            "files": self.files,
            "checks": self.checks,
            "versions": self.versions,
            "created": self.created,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Manifest":
        return cls(
            model=d["model"],
            embedding_dim=int(d["embedding_dim"]),
            preprocess=d["preprocess"],
            architecture=d["architecture"],
            variants={v: {r: GraphEntry.from_dict(g) for r, g in graphs.items()}
                      for v, graphs in d["variants"].items()},
            scorer=GraphEntry.from_dict(d["scorer"]) if d.get("scorer") else None,
            files=d["files"],
            checks=d.get("checks", {}),
            versions=d.get("versions", {}),
            created=d.get("created", ""),
        )

    def write(self, folder: Path) -> Path:
        path = Path(folder) / MANIFEST_NAME
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n")
        return path

    def graph(self, variant: str, role: str) -> GraphEntry:
        if variant not in self.variants:
            raise ModelFolderError(
                f"variant {variant!r} is not in this folder; it has {sorted(self.variants)}"
                + (" (write it with `colembed export ... --variant " + variant + "`)"
                   if variant != "fp32" else ""),
                path=MANIFEST_NAME,
            )
        try:
            return self.variants[variant][role]
        except KeyError:
            raise ModelFolderError(f"variant {variant!r} has no {role!r} graph", path=MANIFEST_NAME)


def read_manifest(folder: Path) -> Manifest:
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(
            "no manifest; this is not a colembed model folder (make one with `colembed export`)",
            path=path,
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"unreadable manifest ({e})", path=path) from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ManifestError(f"not a {FORMAT} manifest", path=path)
    if data.get("format_version") != FORMAT_VERSION:
        raise ManifestError(
            f"format_version {data.get('format_version')} is not {FORMAT_VERSION}; "
            "re-export the model with this colembed version", path=path)
    try:
        return Manifest.from_dict(data)
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"malformed manifest ({type(e).__name__}: {e})", path=path) from e


def _stamp_store() -> Path:
    """Where hashes already checked are remembered (COLEMBED_CACHE_DIR, else the user cache)."""
    root = os.environ.get("COLEMBED_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "colembed")
    return Path(root) / "verified-files.json"


def _stamp(path: Path, sha256: str) -> dict[str, Any]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino, "sha256": sha256}


def _read_stamps() -> dict[str, Any]:
    try:
        data = json.loads(_stamp_store().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_stamps(stamps: dict[str, Any]) -> None:
    """Best effort: a read-only home only costs the next load a re-hash."""
    store = _stamp_store()
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        tmp = store.with_name(f"{store.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stamps))
        os.replace(tmp, store)
    except OSError:
        pass


def verify_files(folder: Path, manifest: Manifest, names: list[str], *,
                 check_hashes: bool | str) -> None:
    """Every named file exists with the manifest's size, and (unless `check_hashes` is False) its
    sha256.

    Hashing a 9 GB model takes tens of seconds, so `check_hashes=True` skips a file whose size,
    mtime and inode are those recorded the last time it hashed to the manifest's very sha256;
    a changed file or a changed manifest entry is hashed again. `check_hashes="full"` always
    hashes.
    """
    folder = Path(folder)
    stamps = _read_stamps() if check_hashes is True else {}
    stamps_changed = False
    for name in names:
        expected = manifest.files.get(name)
        path = folder / name
        if expected is None:
            raise ManifestError(f"the manifest does not describe {name}", path=path)
        if not path.is_file():
            raise ModelFolderError("missing file listed in the manifest", path=path)
        size = path.stat().st_size
        if size != expected["size"]:
            raise ModelFolderError(
                f"size {size} bytes != {expected['size']} in the manifest "
                "(truncated or replaced; re-download or re-export)", path=path)
        if not check_hashes:
            continue
        key = str(path.resolve())
        if check_hashes is True and stamps.get(key) == _stamp(path, expected["sha256"]):
            continue
        if sha256_of(path) != expected["sha256"]:
            raise ModelFolderError(
                "sha256 does not match the manifest (the file was modified; re-export, or load "
                "with verify=False if you changed it on purpose)", path=path)
        stamps[key] = _stamp(path, expected["sha256"])
        stamps_changed = True
    if stamps_changed and check_hashes is True:
        _write_stamps(stamps)
