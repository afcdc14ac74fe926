"""User metadata of indexed files: what is accepted, and how a command line spells it.

A page's metadata is a flat JSON object stored in its payload under `schema.META_FIELD`
(`Index.add(paths, metadata=...)`, `Index.set_metadata`, `colembed index --meta key=value`,
`colembed meta`), returned with each hit and filtered on by `where=` (where.py). Everything a
user hands in is checked here before anything is stored, and refused with `MetadataError` naming
the file and the key:

- keys: `KEY_PATTERN` (letters, digits, `_`, `-`; no `.`, which Qdrant reads as a nested path),
  not one of `RESERVED` (the names `where=` gives a meaning of its own, and the payload's fields);
- values: a string (at most MAX_STRING_CHARS), an int within int64, a finite float, or a list of
  at most MAX_LIST_ITEMS strings / ints (a filter matches any element); `None` in an update
  removes the key. Not a bool: qdrant-edge-py 0.9 reads a bool in a filter as the int 1 / 0,
  so a stored `true` could never be matched there (store "yes" / "no", or 1 / 0);
- at most MAX_KEYS keys and MAX_JSON_BYTES of JSON a page (the payload of every hit carries it).

A metadata file (`MetadataTable`, `colembed index --meta-file`) follows the layout of Hugging Face
`datasets`' image folders: `metadata.jsonl` (one JSON object a line) or `metadata.csv` (a header
row), each row naming its file in `file_name`, relative to the metadata file's folder; the other
columns are that file's metadata. It is read only when named: a file found in a corpus could
otherwise give itself the metadata a filter grants access by.

Standard library only.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
from pathlib import Path, PurePath
from typing import Any, Callable, Mapping

from ..errors import InputError
from .schema import META_FIELD, PAYLOAD_FIELDS, TEXT_FIELD, TEXT_TRUNCATED_FIELD

KEY_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]{0,63}")
MAX_KEYS = 64
MAX_STRING_CHARS = 1024
MAX_LIST_ITEMS = 64
MAX_JSON_BYTES = 8 << 10
MAX_TABLE_BYTES = 256 << 20  # a metadata file: ~1M rows of a few keys
FILE_NAME = "file_name"  # the column naming a row's file (Hugging Face datasets' name)
INT64 = 1 << 63
# `where=`'s own names (where.py) and every field colembed writes in a payload: a metadata key of
# one of these names would read as the built-in one in a filter, so it is refused.
FILTER_NAMES = ("file", "folder", "path", "page", "id", "text")
RESERVED = frozenset(
    {
        *FILTER_NAMES,
        *PAYLOAD_FIELDS,
        META_FIELD,
        TEXT_FIELD,
        TEXT_TRUNCATED_FIELD,
        "source",
        "model_source",
        "max_image_tokens",
        "render",
        "pool_factor",
        "dim",
        "token_clusters",
    }
)


class MetadataError(InputError):
    """Metadata that cannot be stored: names the file (when known), the key and why."""


def check_metadata(metadata: Any, where: str = "", *, removals: bool = False) -> dict[str, Any]:
    """`metadata` as stored (a new dict), or MetadataError. `removals`: a value None is allowed
    (an update that removes the key)."""
    at = f"{where}: " if where else ""
    if not isinstance(metadata, Mapping):
        raise MetadataError(
            f"{at}metadata must be a dict of key -> value, got {type(metadata).__name__}"
        )
    if len(metadata) > MAX_KEYS:
        raise MetadataError(f"{at}{len(metadata)} metadata keys, over the limit of {MAX_KEYS}")
    out: dict[str, Any] = {}
    for key, value in metadata.items():
        if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
            raise MetadataError(
                f"{at}metadata key {key!r} is not a name (letters, digits, _ "
                "and -, starting with a letter or _, at most 64 characters)"
            )
        if key in RESERVED:
            raise MetadataError(
                f"{at}metadata key {key!r} is reserved (a filter or payload "
                f"field of colembed's: {', '.join(sorted(FILTER_NAMES))} and "
                "the payload's own fields): choose another name"
            )
        if value is None and removals:
            out[key] = None
            continue
        out[key] = _value(value, f"{at}metadata {key!r}")
    size = len(json.dumps(out, ensure_ascii=False).encode("utf-8"))
    if size > MAX_JSON_BYTES:
        raise MetadataError(
            f"{at}metadata takes {size} bytes of JSON, over the limit of {MAX_JSON_BYTES}"
        )
    return out


def _value(value: Any, where: str) -> Any:
    if isinstance(value, (list, tuple)):
        if len(value) > MAX_LIST_ITEMS:
            raise MetadataError(
                f"{where}: a list of {len(value)} items, over the limit of {MAX_LIST_ITEMS}"
            )
        items = [_scalar(v, where) for v in value]
        if any(isinstance(v, float) for v in items):
            raise MetadataError(
                f"{where}: a list may hold strings and ints, not floats "
                "(Qdrant matches list elements exactly)"
            )
        return items
    return _scalar(value, where)


def _scalar(value: Any, where: str) -> Any:
    if isinstance(value, bool):
        raise MetadataError(
            f"{where}: a bool cannot be filtered on in Qdrant Edge (it reads "
            'it as 1 / 0): store "yes" / "no" or 1 / 0 instead'
        )
    if isinstance(value, int):
        if not -INT64 <= value < INT64:
            raise MetadataError(f"{where}: {value} is outside the 64-bit integers Qdrant stores")
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise MetadataError(f"{where}: {value} is not a finite number")
        return float(value)
    if isinstance(value, str):
        if len(value) > MAX_STRING_CHARS:
            raise MetadataError(
                f"{where}: a string of {len(value)} characters, over the limit "
                f"of {MAX_STRING_CHARS}"
            )
        return value
    raise MetadataError(
        f"{where}: a {type(value).__name__} cannot be stored (strings, numbers "
        "and lists of them can)"
    )


def merged(
    stored: Mapping[str, Any] | None, update: Mapping[str, Any], replace: bool = False
) -> dict[str, Any]:
    """A page's metadata after `update` (checked, None values remove keys): merged into what is
    stored, or replacing it."""
    out = {} if replace else dict(stored or {})
    for key, value in update.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def metadata_for(
    metadata: Mapping[str, Any] | Callable[[str], Any] | None,
) -> Callable[[str], dict[str, Any] | None]:
    """`Index.add`'s `metadata=` as a function of a file's path: a dict is every file's, a
    callable is asked per file (its answer checked there, naming the file)."""
    if metadata is None:
        return lambda path: None
    if callable(metadata):

        def ask(path: str) -> dict[str, Any] | None:
            answer = metadata(path)
            return None if answer is None else check_metadata(answer, path)

        return ask
    fixed = check_metadata(metadata)
    return lambda path: dict(fixed)


def parse_assignment(text: str) -> tuple[str, Any]:
    """`key=value` of the command line (`--meta`, `colembed meta --set`): the value is a JSON
    number, true / false, or else the text as a string (quote it in JSON, "\\"2024\\"", to keep
    digits a string)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise MetadataError(f"{text!r}: give metadata as key=value")
    return key, parse_value(raw)


def parse_value(raw: str) -> Any:
    """A command-line value: JSON when it parses as a number, bool or quoted string, else text."""
    raw = raw.strip()
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    if value is None or isinstance(value, (dict, list)):
        return raw
    return value


class MetadataTable:
    """A metadata file's rows as `Index.add`'s `metadata=` function: the metadata of a file's
    path (str) or None. `read(path)` checks every row before anything is stored and raises
    MetadataError naming the file and line; `unused()` lists the rows no file asked for."""

    def __init__(self, source: Path, rows: dict[str, dict[str, Any]]):
        self.source = source
        self.rows = rows  # absolute path (the metadata file's folder, resolved, + file_name)
        self._asked: set[str] = set()

    @classmethod
    def read(cls, path: str | os.PathLike) -> "MetadataTable":
        source = Path(path).expanduser()
        kind = source.suffix.lower()
        if kind not in (".jsonl", ".csv"):
            raise MetadataError(
                f"{source}: a metadata file is .jsonl (a JSON object a line) or .csv "
                f"(a header row with a {FILE_NAME!r} column), not {kind or 'no suffix'!r}"
            )
        try:
            with open(source, "rb") as f:
                data = f.read(MAX_TABLE_BYTES + 1)
        except OSError as e:
            raise MetadataError(f"{source}: cannot read the metadata file: {e}") from None
        if len(data) > MAX_TABLE_BYTES:
            raise MetadataError(
                f"{source}: over the limit of {MAX_TABLE_BYTES >> 20} MiB for a metadata file"
            )
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise MetadataError(f"{source}: not UTF-8 text (byte {e.start})") from None
        folder = source.resolve().parent
        parsed = _jsonl_rows(text, source) if kind == ".jsonl" else _csv_rows(text, source)
        rows: dict[str, dict[str, Any]] = {}
        first_line: dict[str, int] = {}
        for line, row in parsed:
            at = f"{source} line {line}"
            name = row.pop(FILE_NAME, None)
            target = folder / _relative_name(name, at)
            key = str(target)
            if key in rows:
                raise MetadataError(
                    f"{at}: {name!r} is named again (first on line {first_line[key]})"
                )
            rows[key] = check_metadata(row, at)
            first_line[key] = line
        return cls(source, rows)

    def __call__(self, path: str) -> dict[str, Any] | None:
        for key in (path, str(Path(path).resolve())):
            if key in self.rows:
                self._asked.add(key)
                return dict(self.rows[key])
        return None

    def unused(self) -> list[str]:
        """The rows' files that no `__call__` asked for (not found, or not under the paths
        indexed), in the file's order."""
        return [key for key in self.rows if key not in self._asked]


def _relative_name(name: Any, at: str) -> PurePath:
    if not isinstance(name, str) or not name.strip():
        raise MetadataError(f"{at}: no {FILE_NAME!r} (the file this row is about)")
    rel = PurePath(name)  # this system's own separators; "/" everywhere
    if rel.anchor or ".." in rel.parts or "\0" in name:
        raise MetadataError(
            f"{at}: {FILE_NAME} {name!r} must be a path inside the metadata file's folder"
        )
    return rel


def _jsonl_rows(text: str, source: Path):
    for line, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise MetadataError(f"{source} line {line}: not JSON: {e}") from None
        if not isinstance(row, dict):
            raise MetadataError(
                f"{source} line {line}: a row is a JSON object, got {type(row).__name__}"
            )
        yield line, row


def _csv_rows(text: str, source: Path):
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        header = next(reader, None)
        if header is None or FILE_NAME not in header:
            raise MetadataError(
                f"{source}: the first row names the columns, {FILE_NAME!r} among them"
            )
        if len(set(header)) != len(header):
            raise MetadataError(f"{source}: a column is named twice in the header")
        for row in reader:
            line = reader.line_num
            if not any(cell.strip() for cell in row):
                continue
            if len(row) != len(header):
                raise MetadataError(
                    f"{source} line {line}: {len(row)} cells, the header has {len(header)}"
                )
            # An empty cell is a key the file does not have; a value reads as `--meta`'s does.
            yield (
                line,
                {
                    key: cell if key == FILE_NAME else parse_value(cell)
                    for key, cell in zip(header, row)
                    if cell.strip() or key == FILE_NAME
                },
            )
    except csv.Error as e:
        raise MetadataError(f"{source} line {reader.line_num}: not CSV: {e}") from None
