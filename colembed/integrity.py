"""Is a model folder what its manifest says? Sizes, hashes, and the files a graph reads.

- `verify_files(folder, manifest, names, check_hashes=...)`: each named file is listed in the
  manifest, lies inside the folder (`safe_fs.inside`: no absolute names, `..` or links out; a file
  outside is refused before anything about it is read), has the listed size and, unless
  `check_hashes` is False, the listed sha256.
- `check_hashes=True` skips re-hashing a file whose stat (size, mtime, ctime, inode, device) is
  exactly what it was the last time it hashed to the manifest's sha256. ctime cannot be set from
  user space (utime sets atime/mtime only) and changes on every write, so an in-place edit with its
  mtime put back is still re-hashed. `"full"` always hashes.
- `external_data_files(graph)`: the external-data locations an ONNX graph's tensors point at, read
  from the protobuf without loading any weight and without the `onnx` package (a small reader for
  the few message fields that can hold tensors). `check_graph_files` refuses a graph that reads any
  file other than the data file its manifest entry lists.

Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from .errors import ModelFolderError
from .safe_fs import inside

if TYPE_CHECKING:
    from .manifest import GraphEntry, Manifest

_HASH_CHUNK = 1 << 22


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def describe_file(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": sha256_of(path)}


# ------------------------------------------------------------------------------------ stamps
def user_cache_root() -> Path:
    """colembed's own cache (hash stamps, measured provider choices):
    COLEMBED_CACHE_DIR, else the user cache."""
    return Path(
        os.environ.get("COLEMBED_CACHE_DIR")
        or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
            "colembed",
        )
    )


def _stamp_store() -> Path:
    """Where hashes already checked are remembered."""
    return user_cache_root() / "verified-files.json"


def _stamp(path: Path, sha256: str) -> dict[str, Any]:
    st = path.stat()
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
        "device": st.st_dev,
        "sha256": sha256,
    }


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


def verify_files(
    folder: Path, manifest: Manifest, names: list[str], *, check_hashes: bool | str
) -> None:
    """Every named file is in the manifest, inside the folder, of the listed size and (unless
    `check_hashes` is False) sha256. See the module docstring for what True skips."""
    folder = Path(folder)
    stamps = _read_stamps() if check_hashes is True else {}
    stamps_changed = False
    for name in names:
        expected = manifest.files.get(name)
        if expected is None:
            raise ModelFolderError(f"the manifest does not describe {name}", path=folder / name)
        path = inside(folder, name)  # before any stat: nothing about an outside file is revealed
        if not path.is_file():
            raise ModelFolderError("missing file listed in the manifest", path=path)
        size = path.stat().st_size
        if size != expected.size:
            raise ModelFolderError(
                f"size {size} bytes != {expected.size} in the manifest "
                "(truncated or replaced; re-download or re-export)",
                path=path,
            )
        if not check_hashes:
            continue
        key = str(path)
        if check_hashes is True and stamps.get(key) == _stamp(path, expected.sha256):
            continue
        if sha256_of(path) != expected.sha256:
            raise ModelFolderError(
                "sha256 does not match the manifest (the file was modified; re-export, or load "
                "with verify=False if you changed it on purpose)",
                path=path,
            )
        stamps[key] = _stamp(path, expected.sha256)
        stamps_changed = True
    if stamps_changed and check_hashes is True:
        _write_stamps(stamps)


# ------------------------------------------------------------------- ONNX external references
# Protobuf field numbers (onnx.proto3) of every message that can hold a TensorProto.
_MODEL_GRAPH, _MODEL_FUNCTIONS = 7, 25
_FUNCTION_NODES = 7
_GRAPH_NODES, _GRAPH_INITIALIZERS, _GRAPH_SPARSE_INITIALIZERS = 1, 5, 15
_NODE_ATTRIBUTES = 5
_ATTR_TENSOR, _ATTR_GRAPH, _ATTR_TENSORS, _ATTR_GRAPHS = 5, 6, 10, 11
_ATTR_SPARSE, _ATTR_SPARSES = 22, 23
_SPARSE_VALUES, _SPARSE_INDICES = 1, 2
_TENSOR_EXTERNAL_DATA = 13
_ENTRY_KEY, _ENTRY_VALUE = 1, 2
_MAX_DEPTH = 64  # graphs nest in If/Loop bodies; deeper than this is not a real model


def _varint(buf, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(field number, start, end) of each length-delimited field in buf[start:end]; others
    skipped."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(buf, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            length, pos = _varint(buf, pos)
            if pos + length > end:
                raise ValueError("field runs past its message")
            yield number, pos, pos + length
            pos += length
        else:
            raise ValueError(f"unsupported wire type {wire}")
    if pos != end:
        raise ValueError("message runs past its end")


# message kind -> {field number: message kind of that field}
_SCHEMA: dict[str, dict[int, str]] = {
    "model": {_MODEL_GRAPH: "graph", _MODEL_FUNCTIONS: "function"},
    "function": {_FUNCTION_NODES: "node"},
    "graph": {
        _GRAPH_NODES: "node",
        _GRAPH_INITIALIZERS: "tensor",
        _GRAPH_SPARSE_INITIALIZERS: "sparse",
    },
    "node": {_NODE_ATTRIBUTES: "attribute"},
    "attribute": {
        _ATTR_TENSOR: "tensor",
        _ATTR_GRAPH: "graph",
        _ATTR_TENSORS: "tensor",
        _ATTR_GRAPHS: "graph",
        _ATTR_SPARSE: "sparse",
        _ATTR_SPARSES: "sparse",
    },
    "sparse": {_SPARSE_VALUES: "tensor", _SPARSE_INDICES: "tensor"},
    "tensor": {_TENSOR_EXTERNAL_DATA: "entry"},
}


def _locations(buf, kind: str, start: int, end: int, depth: int, found: set[str]) -> None:
    if depth > _MAX_DEPTH:
        raise ValueError("graphs nested too deeply")
    if kind == "entry":
        entry = {number: bytes(buf[lo:hi]) for number, lo, hi in _fields(buf, start, end)}
        if entry.get(_ENTRY_KEY) == b"location":
            found.add(entry.get(_ENTRY_VALUE, b"").decode("utf-8"))
        return
    children = _SCHEMA[kind]
    for number, lo, hi in _fields(buf, start, end):
        if number in children:
            _locations(buf, children[number], lo, hi, depth + 1, found)


def external_data_files(graph: Path) -> set[str]:
    """Every external-data `location` the tensors of an ONNX file name (weights are not read)."""
    found: set[str] = set()
    try:
        with open(graph, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise ValueError("empty file")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                _locations(buf, "model", 0, len(buf), 0, found)
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelFolderError(f"not a readable ONNX model ({e})", path=graph) from e
    return found


def check_graph_files(folder: Path, entry: GraphEntry) -> None:
    """The graph reads no file but the data file its manifest entry lists (which must be inside
    the folder), so that every byte a session loads has been size- and hash-checked."""
    graph = inside(folder, entry.file)  # resolved: the path onnxruntime is given
    listed = inside(folder, entry.data_file) if entry.data_file else None
    root = Path(folder).resolve()
    for location in sorted(external_data_files(graph)):
        # onnxruntime reads a location relative to the graph file's own folder
        beside = os.path.relpath(graph.parent / location, root) if location else ""
        if not location or inside(folder, beside) != listed:
            raise ModelFolderError(
                f"the graph reads external data from {location!r:.80}, which its manifest entry "
                f"does not list (it lists {entry.data_file!r}); re-export the model",
                path=graph,
            )
