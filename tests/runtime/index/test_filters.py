"""Metadata and `where=` filters on both stores (Qdrant Edge, and qdrant-client's local mode as
the server store): the grammar, what the stores return against a reference evaluation, and a
selective filter in two-stage mode, whose every stage must see only the allowed pages.

Store-level tests use synthetic unit vectors (as test_index_plan.py); the plan's limits are
shrunk so 400 pages feel what 100,000 do.
"""

from __future__ import annotations

import fnmatch
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from colembed.index import open_store
from colembed.index.metadata import (
    MAX_JSON_BYTES,
    RESERVED,
    MetadataError,
    check_metadata,
    merged,
    parse_assignment,
)
from colembed.index.schema import META_FIELD, PAGE_VECTOR, make_point
from colembed.index.where import FilterError, from_strings, parse
from colembed.model import PageLayout
from tests.fixtures.stores import DIM, STORES, set_plan_limits, unit_page


def _meta(i: int) -> dict:
    return {
        "group": "keep" if i % 100 == 7 else f"g{i % 13}",
        "year": 2000 + i % 25,
        "tags": ["even" if i % 2 == 0 else "odd", f"t{i % 3}"],
        "ok": int(i % 5 == 0),
    }


def _points(n: int):
    return [
        make_point(
            *unit_page(i),
            {
                "path": f"/docs/{'a' if i % 4 else 'b'}/{i // 3}.pdf",
                "page": i % 3 + 1,
                "pages": 3,
                "sha256": f"{i:064x}",
                "width": 112,
                "height": 84,
                "model": "m",
                "variant": "fp32",
                "manifest_sha256": "h",
                "schema": 2,
                "model_source": "/m",
                META_FIELD: _meta(i),
            },
        )
        for i in range(n)
    ]


@pytest.fixture
def small_plan(monkeypatch):
    """Limits 400 pages can feel: each stage sends 3 pages to the rerank."""
    set_plan_limits(
        monkeypatch,
        TOKEN_CANDIDATES=3,
        TOKEN_MEAN_CANDIDATES=3,
        MEAN_CANDIDATES=3,
        MEAN_POOL=8,
        POOLED_CANDIDATES=2,
    )


@pytest.fixture(scope="module", params=STORES)
def filled(request, tmp_path_factory):
    store = open_store(
        tmp_path_factory.mktemp("db") / "db", dim=DIM, local=request.param == "client-local"
    )
    points = _points(400)
    store.upsert(points)
    store.flush()
    yield store, points
    store.close()


def _maxsim(q: np.ndarray, page: np.ndarray) -> float:
    return float((q @ page.T).max(axis=1).sum())


def _query(points, target: int, noise: float = 0.3) -> np.ndarray:
    rng = np.random.default_rng(target)
    tokens = points[target].vectors[PAGE_VECTOR][2 + rng.choice(12, 6, replace=False)]
    return tokens + noise * rng.standard_normal(tokens.shape).astype(np.float32)


# -------------------------------------------------------------------------- the grammar
def test_the_two_forms_of_a_filter_mean_the_same():
    strings = [
        "lang=en",
        "year>=2020",
        "year<2025",
        "tag in a,b",
        "page=2..5",
        "kind!=draft",
        "folder=/data/reports",
        "path=*.pdf",
        "n=3",
    ]
    cli = from_strings(strings)
    assert cli == {
        "lang": "en",
        "year": {"gte": 2020, "lt": 2025},
        "tag": {"in": ["a", "b"]},
        "page": {"gte": 2, "lte": 5},
        "kind": {"not_in": ["draft"]},
        "folder": "/data/reports",
        "path": "*.pdf",
        "n": 3,
    }
    assert parse(cli) == parse(strings)
    where = parse({"folder": "rel/dir", "file": ["x.pdf"], "page": 3, "score": 0.5})
    kinds = {(c.key, c.kind) for c in where.conditions}
    assert kinds == {("path", "prefix"), ("path", "any"), ("page", "eq"), ("meta.score", "range")}
    prefix = next(c.value for c in where.conditions if c.kind == "prefix")
    assert prefix == os.path.join(os.getcwd(), "rel", "dir") + os.sep
    assert parse(None) is None and parse({}) is None


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"page": "two"}, "not a number"),
        ({"page": 1.5}, "whole"),
        ({"lang": {"near": 3}}, "operators"),
        ({"lang": {"in": []}}, "non-empty"),
        ({"a.b": 1}, "metadata name"),
        ({"text": "x"}, "not supported"),
        ({"lang": [1, 2]}, "cannot be matched"),
        ({"public": True}, "cannot be matched"),
        ({"year": {"gte": "x"}}, "not a number"),
        (["lang"], "key=value"),
        (["page=1", "page=2"], "twice"),
        (3, "dict"),
    ],
)
def test_a_bad_filter_is_refused_naming_the_key(bad, words):
    with pytest.raises(FilterError, match=words):
        parse(bad)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=30), max_size=4))
def test_any_command_line_text_parses_or_is_a_filter_error(items):
    try:
        parse(items)
    except FilterError:
        pass


_json_scalar = st.one_of(
    st.text(max_size=20),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(
        st.text(max_size=12),
        st.one_of(
            _json_scalar,
            st.lists(st.one_of(st.text(max_size=8), st.integers(-5, 5)), max_size=4),
            st.none(),
            st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
        ),
        max_size=6,
    )
)
@example({"height": ""})  # a payload field's name: reserved, refused
def test_metadata_is_stored_only_when_it_is_json_safe_and_named(meta):
    try:
        out = check_metadata(meta)
    except MetadataError:
        named = all(
            isinstance(k, str)
            and k
            and k[0].isalpha()
            and k.isascii()
            and k.replace("_", "").replace("-", "").isalnum()
            for k in meta
        )
        ok_values = all(v is not None and not isinstance(v, dict) for v in meta.values())
        assert not (
            named
            and ok_values
            and len(meta) < 10
            and not RESERVED & set(meta)
            and all(not isinstance(v, str) or len(v) < 100 for v in meta.values())
        ), meta
        return
    assert out == meta


def test_metadata_refusals_name_the_key_and_limit():
    with pytest.raises(MetadataError, match="'page' is reserved"):
        check_metadata({"page": 3})
    with pytest.raises(MetadataError, match="report.pdf: metadata 'n'.*finite"):
        check_metadata({"n": float("nan")}, "report.pdf")
    with pytest.raises(MetadataError, match="'public'.*bool.*\"yes\""):
        check_metadata({"public": True})
    with pytest.raises(MetadataError, match="over the limit"):
        check_metadata({f"k{i}": "x" * 1000 for i in range(20)})
    assert MAX_JSON_BYTES >= 4096
    assert merged({"a": 1, "b": 2}, {"b": None, "c": 3}) == {"a": 1, "c": 3}
    assert merged({"a": 1}, {"c": 3}, replace=True) == {"c": 3}
    assert parse_assignment("year=2024") == ("year", 2024)
    assert parse_assignment('id="0042"') == ("id", "0042")
    assert parse_assignment("team=fin ance") == ("team", "fin ance")


# --------------------------------------------------------------------- the stores' answers
def _allowed(point, where: dict) -> bool:
    """A reference evaluation of a filter's dict form over one page's payload."""
    p, meta = point.payload, point.payload[META_FIELD]
    for key, want in where.items():
        if key == "folder":
            if not p["path"].startswith(want.rstrip("/") + "/"):
                return False
        elif key == "path":
            if not (
                fnmatch.fnmatchcase(p["path"], want) or fnmatch.fnmatchcase(p["path"], "*/" + want)
            ):
                return False
        elif key == "page":
            if isinstance(want, dict):
                if not _in_range(p["page"], want):
                    return False
            elif p["page"] != want:
                return False
        else:
            have = meta.get(key)
            values = have if isinstance(have, list) else [have]
            if isinstance(want, dict) and "in" in want:
                if not any(
                    v in want["in"] and type(v) is type(w)
                    for v in values
                    for w in want["in"]
                    if v == w
                ):
                    return False
            elif isinstance(want, dict) and "not_in" in want:
                if any(v == w and type(v) is type(w) for v in values for w in want["not_in"]):
                    return False
            elif isinstance(want, dict):
                if have is None or isinstance(have, (list, str)) or not _in_range(have, want):
                    return False
            elif isinstance(want, float):  # a float is a number: compared as numbers
                if not isinstance(have, (int, float)) or have != want:
                    return False
            elif not any(v == want and type(v) is type(want) for v in values):
                return False
    return True


def _in_range(value, bounds: dict) -> bool:
    ops = {
        "gt": value > bounds.get("gt", -np.inf),
        "gte": value >= bounds.get("gte", -np.inf),
        "lt": value < bounds.get("lt", np.inf),
        "lte": value <= bounds.get("lte", np.inf),
    }
    return all(ops.values())


FILTERS = [
    {"group": "keep"},
    {"group": {"in": ["g1", "g2"]}},
    {"group": {"not_in": ["g1"]}},
    {"year": {"gte": 2010, "lt": 2012}},
    {"tags": "even"},
    {"tags": {"in": ["t1"]}},
    {"ok": 1},
    {"page": 2},
    {"page": {"gte": 2}},
    {"folder": "/docs/b"},
    {"path": "b/1*.pdf"},
    {"path": "/docs/a/9.pdf"},
    {"folder": "/docs/b", "ok": 1, "page": {"lte": 2}},
    {"path": "nothing-*.pdf"},
    {"year": 2003.0},
]


@pytest.mark.parametrize("where", FILTERS, ids=[str(f) for f in FILTERS])
def test_exact_search_returns_exactly_the_pages_a_filter_allows(filled, where):
    store, points = filled
    expected = {p.id for p in points if _allowed(p, where)}
    (hits,) = store.search([_query(points, 5)], len(points), "exact", parse(where))
    assert {h.id for h in hits} == expected
    stored = store.page_vectors([h.id for h in hits[:5]])
    q = _query(points, 5)
    np.testing.assert_allclose(
        [h.score for h in hits[:5]], [_maxsim(q, stored[h.id]) for h in hits[:5]], rtol=2e-4
    )


@pytest.mark.parametrize("kind", STORES)
def test_a_filter_keeping_one_percent_still_returns_k_pages_in_two_stage(
    kind, tmp_path, small_plan
):
    """4 pages of 400 are in group "keep". The shrunk plan sends 3 candidates per stage: a
    filter applied at the rerank only would return at most the few "keep" pages the
    unfiltered stages happened to rank; applied in every stage, all 4 come back, scored
    exactly and ordered as exact search over the allowed pages orders them."""
    store = open_store(tmp_path / "db", dim=DIM, local=kind == "client-local")
    points = _points(400)
    store.upsert(points)
    keep = {p.id for p in points if p.payload[META_FIELD]["group"] == "keep"}
    assert len(keep) == 4
    where = parse({"group": "keep"})
    for target in (11, 150, 333):  # queries aimed at pages outside the filter
        q = _query(points, target)
        (hits,) = store.search([q], 4, "two-stage", where)
        (exact,) = store.search([q], 4, "exact", where)
        assert len(hits) == 4 and {h.id for h in hits} == keep
        assert [h.id for h in hits] == [h.id for h in exact]
        np.testing.assert_allclose([h.score for h in hits], [h.score for h in exact], rtol=1e-5)
    store.close()


@pytest.mark.parametrize("kind", STORES)
def test_metadata_is_updated_in_place_and_filters_follow(kind, tmp_path):
    store = open_store(tmp_path / "db", dim=DIM, local=kind == "client-local")
    points = _points(12)
    store.upsert(points)
    before = store.points([points[0].id])[points[0].id]
    store.set_payload([points[0].id, points[1].id], {META_FIELD: {"group": "moved"}})
    after = store.points([points[0].id])[points[0].id]
    np.testing.assert_array_equal(after.vectors[PAGE_VECTOR], before.vectors[PAGE_VECTOR])
    assert after.payload[META_FIELD] == {"group": "moved"}
    assert {k: v for k, v in after.payload.items() if k != META_FIELD} == {
        k: v for k, v in before.payload.items() if k != META_FIELD
    }
    (hits,) = store.search([_query(points, 3)], 12, "two-stage", parse({"group": "moved"}))
    assert {h.id for h in hits} == {points[0].id, points[1].id}
    store.close()


def _local_answer_points(n: int):
    """Pages whose answer is 3 of their 24 image tokens; the other 21 are the page's own
    background (a direction of its own, a little noise), which dominates its `mean` vector while
    its centroids keep the answer apart. Ten pages in a row (one of each tenant) carry the same
    answer, each with noise of its own."""
    out = []
    for i in range(n):
        rng = np.random.default_rng(i)
        layout = PageLayout(grid_rows=4, grid_cols=6, image_start=2, num_tokens=29, token_px=28)
        style = rng.standard_normal(DIM)
        v = np.tile(style / np.linalg.norm(style), (29, 1)) + 0.05 * rng.standard_normal((29, DIM))
        answer = np.random.default_rng(20_000 + i // 10).standard_normal((3, DIM))
        v[2:5] = answer + 0.2 * rng.standard_normal((3, DIM))
        v = (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)
        out.append(
            make_point(
                v,
                layout,
                {
                    "path": f"/docs/{i}.pdf",
                    "page": 1,
                    "pages": 1,
                    "sha256": f"{i:064x}",
                    "width": 168,
                    "height": 112,
                    "model": "m",
                    "variant": "fp32",
                    "manifest_sha256": "h",
                    "schema": 3,
                    "model_source": "/m",
                    META_FIELD: {"tenant": i % 10},
                },
            )
        )
    return out


def test_the_centroid_scan_ranks_only_the_pages_a_filter_allows(tmp_path, small_plan):
    """Edge's token stage is numpy beside the shard, outside Qdrant's filter: it must scan the
    allowed pages only. 40 of 400 local-answer pages are allowed (tenant 3); each query is the
    answer its group of ten shares (one page of each tenant): unfiltered, the centroid scan's 3
    candidates are mostly pages of other tenants, and the `mean` stage (3 candidates among the
    allowed) mostly misses the page: the two-stage search finds it for every query only when the
    scan ranks the allowed pages alone."""
    store = open_store(tmp_path / "db", dim=DIM)
    points = _local_answer_points(400)
    store.upsert(points)
    where = parse({"tenant": 3})
    ids = store.allowed_ids(where)
    allowed = [i for i in range(400) if i % 10 == 3]
    assert ids == {points[i].id for i in allowed}
    rng = np.random.default_rng(1)
    queries = {
        i: np.random.default_rng(20_000 + i // 10).standard_normal((3, DIM))
        + 0.05 * rng.standard_normal((3, DIM))
        for i in allowed
    }
    scan = store.tokens.top_many(list(queries.values()), 3, ids)
    assert all(set(row) <= ids and len(row) == 3 for row in scan)
    found = 0
    for target, q in queries.items():
        q = q.astype(np.float32)
        (hits,) = store.search([q], 3, "two-stage", where)
        (exact,) = store.search([q], 3, "exact", where)
        assert exact[0].id == points[target].id and len(hits) == 3
        found += hits[0].id == points[target].id
    assert found == len(allowed)
    store.close()


def test_a_filter_used_again_after_writes_follows_them(tmp_path):
    """A filter's page listing (and the id filter and scan positions made from it) is kept for
    the next search with the same filter until a write: pages moved out of it or added to it
    since must be left out and found, in two-stage search, as in a fresh store."""
    store = open_store(tmp_path / "db", dim=DIM)
    points = _local_answer_points(110)
    store.upsert(points[:100])
    where = parse({"tenant": 3})
    query = points[3].vectors[PAGE_VECTOR][2:5]
    (hits,) = store.search([query], 20, "two-stage", where)
    assert {h.id for h in hits} == {points[i].id for i in range(3, 100, 10)}
    store.set_payload([points[3].id], {META_FIELD: {"tenant": 4}})
    store.upsert(points[100:])
    (hits,) = store.search([query], 20, "two-stage", where)
    assert {h.id for h in hits} == {points[i].id for i in range(13, 110, 10)}
    store.close()
