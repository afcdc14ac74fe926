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

Standard library only.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable, Mapping

from ..errors import InputError
from .schema import META_FIELD, PAYLOAD_FIELDS, TEXT_FIELD, TEXT_TRUNCATED_FIELD

KEY_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]{0,63}")
MAX_KEYS = 64
MAX_STRING_CHARS = 1024
MAX_LIST_ITEMS = 64
MAX_JSON_BYTES = 8 << 10
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
