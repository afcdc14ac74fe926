"""`where=`: which pages a search may return, in a small grammar both stores translate to Qdrant.

Python form, a dict whose conditions all hold (AND):

    {"folder": "reports/2024"}              pages of files under this folder
    {"file": "a.pdf"} / {"file": [...]}     pages of this file / of any of these
    {"path": "*/invoices/*.pdf"}            pages of files whose path matches this glob (a
                                            relative pattern matches the end of the path)
    {"page": 1} / {"page": {"gte": 2, "lte": 5}}   page numbers (1-based)
    {"lang": "en"}                          metadata equal (a page whose value is a list:
                                            any element equal)
    {"lang": {"in": ["en", "fr"]}}          metadata equal to any of these
    {"lang": {"not_in": ["de"]}}            metadata equal to none of these (or absent)
    {"year": {"gte": 2020, "lt": 2025}}     metadata in a range (numbers; gt, gte, lt, lte)

Command-line form (`colembed search --where`, repeatable, all hold; the search page and
`/v1/search` take either form): `lang=en`, `lang!=de`, `year>=2020`, `year<2025`,
`lang in en,fr`, `page=2..5`, `folder=reports/2024`, `path=*.pdf`.

`parse` checks a filter and turns it into `Condition`s on payload keys (`path`, `page`,
`meta.<key>`); `to_qdrant` turns those into a Qdrant `Filter` with the constructors of the store's
client (`QdrantTerms`: edge.py and server.py each declare theirs); a bad filter is
a `FilterError` naming the key. File and folder names are resolved against the current folder as
`Index.add` stores them; a glob is matched against the stored paths (`Condition.kind == "glob"`:
the store lists its paths once per write and turns the glob into the matching ones).
Standard library only.
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..errors import InputError
from .errors import StoreError
from .metadata import FILTER_NAMES, KEY_PATTERN, MAX_LIST_ITEMS, parse_value
from .schema import META_FIELD

RANGE_OPS = ("gt", "gte", "lt", "lte")
MATCH_OPS = ("in", "not_in")
MAX_CONDITIONS = 32
MAX_CLI_VALUES = MAX_LIST_ITEMS


class FilterError(InputError):
    """A `where=` filter that cannot mean anything: names the key and why."""


@dataclass(frozen=True)
class Condition:
    """One condition on a payload key. `kind`: "eq" (value equal, or for a list payload any
    element equal), "any" (equal to one of `value`), "none" (equal to none of `value`), "range"
    (`value`: a dict of RANGE_OPS), "prefix" (a string starting with `value`), "glob" (a path
    matching the pattern `value`; resolved by the store into "any")."""

    key: str
    kind: str
    value: Any


@dataclass(frozen=True)
class Where:
    """A checked filter: every condition holds. Hashable (a store caches per filter)."""

    conditions: tuple[Condition, ...]

    def __bool__(self) -> bool:
        return bool(self.conditions)

    def cache_key(self) -> str:
        return repr(self.conditions)

    def matches_nothing(self) -> bool:
        """A condition no page can meet (a glob that matched no stored path)."""
        return any(c.kind == "any" and not c.value for c in self.conditions)

    def resolved(self, paths: Sequence[str]) -> Where:
        """This filter with each `path` glob replaced by the stored `paths` it matches."""
        return Where(
            tuple(
                Condition(c.key, "any", tuple(sorted(p for p in paths if glob_matches(c.value, p))))
                if c.kind == "glob"
                else c
                for c in self.conditions
            )
        )

    def has_glob(self) -> bool:
        return any(c.kind == "glob" for c in self.conditions)


@dataclass(frozen=True)
class QdrantTerms:
    """One Qdrant client's filter constructors, for `to_qdrant`: Qdrant Edge's (edge.py) and
    qdrant-client's (server.py) build the same filter from differently spelled classes."""

    equal: Callable[[str, Any], Any]  # (key, value): a MatchValue condition
    one_of: Callable[[str, list[Any]], Any]  # (key, values): a MatchAny condition
    within: Callable[[str, dict[str, float]], Any]  # (key, RANGE_OPS bounds): a range condition
    prefix: Callable[[str, str], Any]  # (key, text): a MatchPrefix condition
    combine: Callable[..., Any]  # Filter(must=, must_not=, should=)


def to_qdrant(where: Where | None, terms: QdrantTerms) -> Any:
    """A checked filter as a Qdrant `Filter` built with `terms`; None for no filter. The store
    resolves globs first (`Where.resolved`): one left is a StoreError."""
    if not where:
        return None
    must: list[Any] = []
    must_not: list[Any] = []
    for c in where.conditions:
        if c.kind == "eq":
            must.append(terms.equal(c.key, c.value))
        elif c.kind in ("any", "none"):
            (must if c.kind == "any" else must_not).append(_any_of(terms, c.key, c.value))
        elif c.kind == "range":
            must.append(terms.within(c.key, c.value))
        elif c.kind == "prefix":
            must.append(terms.prefix(c.key, c.value))
        else:
            raise StoreError(f"filter condition {c.kind!r} on {c.key!r} was not resolved")
    return terms.combine(must=must or None, must_not=must_not or None)


def _any_of(terms: QdrantTerms, key: str, values: Sequence[Any]) -> Any:
    """Equal to any of `values`: one MatchAny when they are all strings or all ints (what it
    takes), else one MatchValue each, any of which may hold."""
    if all(isinstance(v, str) for v in values) or all(isinstance(v, int) for v in values):
        return terms.one_of(key, list(values))
    return terms.combine(should=[terms.equal(key, v) for v in values])


def parse(where: Mapping[str, Any] | Sequence[str] | str | Where | None) -> Where | None:
    """A filter in either form (a dict, or command-line strings) as `Where`; None for none."""
    if where is None or isinstance(where, Where):
        return where or None
    if isinstance(where, str):
        where = [where]
    if not isinstance(where, Mapping):
        if not isinstance(where, (list, tuple)) or not all(isinstance(w, str) for w in where):
            raise FilterError(
                "a filter is a dict (key -> value or {op: value}) or a list of 'key=value' strings"
            )
        where = from_strings(where)
    if len(where) > MAX_CONDITIONS:
        raise FilterError(f"{len(where)} filter keys, over the limit of {MAX_CONDITIONS}")
    conditions: list[Condition] = []
    for key, value in where.items():
        conditions.extend(_conditions(key, value))
    return Where(tuple(conditions)) if conditions else None


def _conditions(key: Any, value: Any) -> list[Condition]:
    if not isinstance(key, str):
        raise FilterError(f"filter key {key!r} is not a string")
    if key == "file":
        files = value if isinstance(value, (list, tuple)) else [value]
        paths = [_resolved(f, key) for f in _bounded(files, key)]
        return [Condition("path", "any", tuple(paths))]
    if key == "folder":
        if isinstance(value, (list, tuple)):
            raise FilterError(
                "filter 'folder': give one folder (several: one search each, or a `path` glob)"
            )
        return [Condition("path", "prefix", _resolved(value, key).rstrip(os.sep) + os.sep)]
    if key == "path":
        if not isinstance(value, str) or not value:
            raise FilterError("filter 'path': give one glob pattern as a string")
        return [Condition("path", "glob", value)]
    if key == "page":
        if isinstance(value, Mapping):
            return [Condition("page", "range", _range(value, key))]
        return [Condition("page", "eq", _number(value, key, whole=True))]
    if key in FILTER_NAMES:
        raise FilterError(
            f"filter key {key!r} is not supported (the built-in keys are "
            "file, folder, path and page; anything else is metadata)"
        )
    if not KEY_PATTERN.fullmatch(key):
        raise FilterError(f"filter key {key!r} is not a metadata name")
    field = f"{META_FIELD}.{key}"
    if isinstance(value, Mapping):
        ops = set(value)
        if ops <= set(RANGE_OPS) and ops:
            return [Condition(field, "range", _range(value, key))]
        if len(ops) == 1 and ops <= set(MATCH_OPS):
            op, items = next(iter(value.items()))
            if not isinstance(items, (list, tuple)) or not items:
                raise FilterError(f"filter {key!r}: {op} takes a non-empty list")
            items = tuple(_match_value(v, key) for v in _bounded(items, key))
            return [Condition(field, "any" if op == "in" else "none", items)]
        raise FilterError(
            f"filter {key!r}: operators are {', '.join(MATCH_OPS)} (alone) or "
            f"{', '.join(RANGE_OPS)}, got {sorted(map(str, ops))}"
        )
    if isinstance(value, float):
        return [Condition(field, "range", {"gte": value, "lte": value})]
    return [Condition(field, "eq", _match_value(value, key))]


def _bounded(items: Sequence[Any], key: str) -> Sequence[Any]:
    if len(items) > MAX_LIST_ITEMS:
        raise FilterError(
            f"filter {key!r}: {len(items)} values, over the limit of {MAX_LIST_ITEMS}"
        )
    return items


def _resolved(value: Any, key: str) -> str:
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise FilterError(f"filter {key!r}: give a path, got {value!r}")
    return str(Path(value).expanduser().resolve())


def _match_value(value: Any, key: str) -> str | int:
    """What Qdrant matches exactly: a string or an int (metadata holds no bools:
    metadata.py says why)."""
    if isinstance(value, str) or (
        isinstance(value, int) and not isinstance(value, bool) and abs(value) < 1 << 63
    ):
        return value
    raise FilterError(
        f"filter {key!r}: {value!r} cannot be matched (strings and ints can; a "
        "float is matched with a range)"
    )


def _number(value: Any, key: str, whole: bool = False) -> float | int:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and not math.isfinite(value))
    ):
        raise FilterError(f"filter {key!r}: {value!r} is not a number")
    if whole and not float(value).is_integer():
        raise FilterError(f"filter {key!r}: {value!r} is not a whole number")
    return int(value) if whole else value


def _range(value: Mapping[str, Any], key: str) -> dict[str, float]:
    bad = set(value) - set(RANGE_OPS)
    if bad or not value:
        raise FilterError(
            f"filter {key!r}: a range takes {', '.join(RANGE_OPS)}, got {sorted(map(str, value))}"
        )
    return {op: _number(v, key) for op, v in value.items()}


# ---------------------------------------------------------------------------- command line
_CLI = re.compile(
    r"\s*(?P<key>[A-Za-z_][A-Za-z0-9_\-]*)\s*(?:(?P<op>!=|>=|<=|=|>|<)|\s+(?P<in>in)\s+)"
    r"(?P<value>.*)$",
    re.S,
)
_OPS = {">=": "gte", "<=": "lte", ">": "gt", "<": "lt"}


def from_strings(items: Sequence[str]) -> dict[str, Any]:
    """Command-line conditions (`key=value`, `key!=value`, `key>=n`, `key in a,b`,
    `page=2..5`) as the dict form; two ranges on one key are combined."""
    out: dict[str, Any] = {}
    for text in items:
        m = _CLI.match(text)
        if m is None:
            raise FilterError(
                f"{text!r}: write a condition as key=value, key!=value, key>=n, "
                "key<n, key in a,b or page=2..5"
            )
        key, op, raw = m["key"], m["op"] or "in", m["value"].strip()
        if op in _OPS:
            bound = out.setdefault(key, {})
            if not isinstance(bound, dict) or set(bound) - set(RANGE_OPS):
                raise FilterError(f"{text!r}: {key} is already given another way")
            bound[_OPS[op]] = parse_value(raw)
        elif op in ("in", "!="):
            values = [parse_value(v) for v in raw.split(",")] if op == "in" else [parse_value(raw)]
            _once(out, key, text)
            out[key] = {"in" if op == "in" else "not_in": values}
        else:
            _once(out, key, text)
            low, dots, high = raw.partition("..")
            if dots and key not in ("file", "folder", "path"):
                out[key] = {"gte": parse_value(low), "lte": parse_value(high)}
            else:
                out[key] = raw if key in ("file", "folder", "path") else parse_value(raw)
    return out


def _once(out: dict[str, Any], key: str, text: str) -> None:
    if key in out:
        raise FilterError(f"{text!r}: {key} is given twice")


def glob_matches(pattern: str, path: str) -> bool:
    """A stored path matches a `path` glob: an absolute pattern the whole path, a relative one
    its end (at a folder boundary). `*` crosses folders."""
    if os.path.isabs(pattern):
        return fnmatch.fnmatchcase(path, pattern)
    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, "*/" + pattern)
