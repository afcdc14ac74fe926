"""Ready points from outside (`Index.add_embedded`, `colembed index --from-parquet`, a Ray job's
Parquet parts) are checked whole before anything is written, and a store that already holds a
bad point (written by hand, or by something else) is still searched and indexed: the point is
skipped and named once.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

import colembed
from colembed.cli import main
from colembed.errors import InputError
from colembed.index import Index, ModelMismatchError, open_store
from colembed.index.embedded import EmbeddedPage
from colembed.index.schema import make_point, point_id
from colembed.model import PageLayout
from tests.fixtures.documents import write_pdf
from tests.fixtures.stores import IDENTITY

DIM, ROWS, COLS, START = 16, 3, 4, 2
TOKENS = 64
LAYOUT = PageLayout(
    grid_rows=ROWS, grid_cols=COLS, image_start=START, num_tokens=START + ROWS * COLS, token_px=28
)


def unit_rows(seed: int, n: int = START + ROWS * COLS) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, DIM))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def ready_point(seed: int = 0, **changes):
    """A ready point (as a Parquet row is read) with payload fields replaced by `changes`; its id
    is the one its (possibly bad) path, page and sha256 make."""
    payload = dict(
        IDENTITY,
        path=f"/docs/{seed}.pdf",
        page=1,
        pages=1,
        sha256=f"{seed:064x}",
        width=112,
        height=84,
    )
    point = make_point(unit_rows(seed), LAYOUT, payload)
    payload = dict(point.payload, **changes)
    pid = point_id(payload.get("sha256"), payload.get("page"), payload.get("path"))
    return type(point)(pid, point.vectors, payload)


@pytest.fixture
def empty_index(tmp_path):
    open_store(tmp_path / "db", dim=DIM).close()
    with Index(tmp_path / "db") as index:
        yield index


# ------------------------------------------------------------------ the whole payload, first
BAD_PAYLOADS = {
    "page not an int": ({"page": "abc"}, "page: must be an int >= 1, got 'abc'"),
    "page 0": ({"page": 0}, "page: must be an int >= 1"),
    "page -3": ({"page": -3}, "page: must be an int >= 1"),
    "page 5 of 1": ({"page": 5}, "pages: must be an int >= page (5), got 1"),
    "pages null": ({"pages": None}, "pages: must be an int >= page, got None"),
    "page a bool": ({"page": True}, "page: must be an int >= 1, got True"),
    "page a float": ({"page": 1.0}, "page: must be an int >= 1, got 1.0"),
    "path not a str": ({"path": 5}, "path: must be a non-empty str"),
    "sha256 not hex": ({"sha256": "z" * 64}, "sha256: must be 64 lower-case hex digits"),
    "width a str": ({"width": "112"}, "width: must be an int >= 1"),
    "grid of strs": ({"grid": ["3", "4"]}, "grid: must be [rows, cols]"),
    "model not a str": ({"model": ["m"]}, "model: must be a str"),
    "an unknown field": ({"secret": 1}, "unknown field(s) ['secret']"),
    "pool_factor 0": ({"pool_factor": 0}, "pool_factor: must be an int >= 1"),
    "metadata a list": ({"meta": ["a"]}, "meta: must be an object with str keys"),
    "text not a str": ({"text_z": 5}, "text_z: must be a str"),
    "text_truncated a str": ({"text_truncated": "yes"}, "text_truncated: must be a bool"),
}


def test_a_ready_point_with_metadata_and_text_is_accepted(empty_index):
    """The fields an index itself writes (the user's metadata, the page text) pass the check."""
    from colembed.index.schema import encode_text, payload_problems

    stored, cut = encode_text("Invoice INV-2024-00317")
    point = ready_point(
        7, meta={"team": "finance", "year": 2024}, text_z=stored, text_truncated=cut
    )
    assert payload_problems(point.payload) == []


@pytest.mark.parametrize("case", list(BAD_PAYLOADS))
def test_a_ready_point_with_a_bad_payload_is_refused_before_anything_is_written(empty_index, case):
    changes, words = BAD_PAYLOADS[case]
    good = [ready_point(1), ready_point(2)]
    with pytest.raises(InputError) as info:
        empty_index.add_embedded([*good, ready_point(3, **changes)], identity=IDENTITY)
    assert words in str(info.value)
    assert "page" in str(info.value).split(":")[0]  # names the page (path page N)
    assert len(empty_index) == 0


@pytest.mark.parametrize("page,pages", [("abc", 1), (0, 1), (-3, 1), (5, 1), (1, None)])
def test_an_embedded_page_with_bad_numbers_is_refused_with_the_schema_words(
    empty_index, page, pages
):
    item = EmbeddedPage(
        "/docs/a.pdf",
        page,
        unit_rows(0),
        (ROWS, COLS),
        START,
        pages=pages,
        sha256="a" * 64,
        token_px=28,
    )
    with pytest.raises(InputError, match=r"/docs/a\.pdf page .*: (page|pages): must be"):
        empty_index.add_embedded([item], identity=IDENTITY)
    assert len(empty_index) == 0


def test_the_model_mismatch_names_the_index_and_the_pages_the_right_way_round(empty_index):
    empty_index.add_embedded([ready_point(1)], identity=IDENTITY)
    other = ready_point(2, model="other-model")
    with pytest.raises(
        ModelMismatchError, match="model: the index has 'm', these pages 'other-model'"
    ):
        empty_index.add_embedded([other])


# ----------------------------------------------------------------------------------- vectors
def test_vectors_beyond_float16_are_refused(empty_index):
    big = EmbeddedPage(
        "/docs/a.pdf", 1, unit_rows(0) * 1e6, (ROWS, COLS), START, sha256="a" * 64, token_px=28
    )
    with pytest.raises(
        InputError, match="beyond float16's range .* the precision the index stores"
    ):
        empty_index.add_embedded([big], identity=IDENTITY)
    assert len(empty_index) == 0


@pytest.mark.parametrize("scale", [1000.0, 1.5, 0.5])
def test_rows_that_are_not_unit_length_are_refused_naming_the_row(empty_index, scale):
    vectors = unit_rows(0)
    vectors[5] *= scale
    page = EmbeddedPage(
        "/docs/a.pdf", 1, vectors, (ROWS, COLS), START, sha256="a" * 64, token_px=28
    )
    with pytest.raises(InputError, match=r"/docs/a\.pdf page 1: row 5 has norm .*unit length"):
        empty_index.add_embedded([page], identity=IDENTITY)
    assert len(empty_index) == 0


def test_unit_rows_zero_rows_and_float16_rounding_are_accepted(empty_index):
    vectors = unit_rows(0)
    vectors[-1] = 0.0  # a masked row
    vectors = vectors.astype(np.float16).astype(np.float32) * 1.004  # a trip through float16
    page = EmbeddedPage(
        "/docs/a.pdf", 1, vectors, (ROWS, COLS), START, sha256="a" * 64, token_px=28
    )
    assert empty_index.add_embedded([page], identity=IDENTITY) == 1


# ------------------------------------------------------------ a bad point already in a store
@pytest.fixture(scope="module")
def small_model(exported_tiny):
    return colembed.load(exported_tiny.folder, max_image_tokens=TOKENS)


def test_one_bad_stored_point_never_stops_search_or_index(tmp_path, small_model, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    write_pdf(docs / "a.pdf", ["alpha", "beta"])
    db = tmp_path / "db"
    with Index(db, model=small_model) as index:
        index.add([docs], progress=False)
        ((pid, payload),) = [(i, p) for i, p in index.store.payloads() if p["page"] == 1]
        point = index.store.points([pid])[pid]
        bad = type(point)(
            "0" * 8 + "-0000-5000-8000-" + "0" * 12, point.vectors, dict(payload, page="abc")
        )
        index.store.upsert([bad])  # written with the store's own API, as something else would
        index.store.flush()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Index(db) as index:
            hits = index.search("alpha", k=10)
            assert {(h.file, h.page) for h in hits} == {
                (str(docs / "a.pdf"), 1),
                (str(docs / "a.pdf"), 2),
            }
            write_pdf(docs / "c.pdf", ["gamma"])
            result = index.add([docs], progress=False)
            assert result.ok and [r.path for r in result.added] == [str(docs / "c.pdf")]
    named = [w for w in seen if bad.id in str(w.message)]
    assert named and "page: must be an int >= 1, got 'abc'" in str(named[0].message)
    assert len({str(w.message) for w in named}) == 1  # once per open store, not per read
    assert main(["search", "alpha", "--db", str(db)]) == 0
    assert "Traceback" not in capsys.readouterr().err


# ------------------------------------------------------------------- malformed Parquet files
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _write_part(folder, columns: dict, name: str = "part-0.parquet"):
    folder.mkdir(exist_ok=True)
    pq.write_table(pa.table(columns), folder / name)
    return folder / name


def _good_columns(n: int = 2) -> dict:
    points = [ready_point(i) for i in range(n)]
    vectors = lambda key: pa.array(  # noqa: E731
        [p.vectors[key].tolist() for p in points],
        type=pa.list_(pa.list_(pa.float32(), DIM)),
    )
    return {
        "path": [p.payload["path"] for p in points],
        "id": [p.id for p in points],
        "page_vectors": vectors("page"),
        "rows_vectors": vectors("rows"),
        "cols_vectors": vectors("cols"),
        "payload": [json.dumps(p.payload) for p in points],
    }


def test_a_well_formed_part_is_read(tmp_path):
    from colembed.distributed.targets import read_points

    _write_part(tmp_path / "pq", _good_columns())
    points = read_points(str(tmp_path / "pq"))
    assert len(points) == 2
    assert all(p.origin.endswith(("row 0", "row 1")) for p in points.values())


@pytest.mark.parametrize("column", ["payload", "rows_vectors", "id"])
def test_a_part_missing_a_column_is_named(tmp_path, column):
    from colembed.distributed.targets import read_points

    columns = _good_columns()
    del columns[column]
    part = _write_part(tmp_path / "pq", columns)
    with pytest.raises(InputError, match=f"{part}: no column {column}"):
        read_points(str(tmp_path / "pq"))


def test_ragged_inner_lists_are_named_by_row_and_column(tmp_path):
    from colembed.distributed.targets import read_points

    columns = _good_columns(3)
    rows = [p.tolist() for p in (unit_rows(0), unit_rows(1), unit_rows(2))]
    rows[2][4] = rows[2][4][:-1]  # one vector of row 2 is one number short
    columns["page_vectors"] = pa.array(rows, type=pa.list_(pa.list_(pa.float32())))
    part = _write_part(tmp_path / "pq", columns)
    with pytest.raises(
        InputError, match=f"{part} row 2, column page_vectors: vectors of different widths"
    ):
        read_points(str(tmp_path / "pq"))


def test_equal_width_variable_lists_are_read(tmp_path):
    from colembed.distributed.targets import read_points

    columns = _good_columns(2)
    columns["page_vectors"] = pa.array(
        [unit_rows(0).tolist(), unit_rows(1).tolist()], type=pa.list_(pa.list_(pa.float32()))
    )
    _write_part(tmp_path / "pq", columns)
    assert {p.vectors["page"].shape for p in read_points(str(tmp_path / "pq")).values()} == {
        (START + ROWS * COLS, DIM)
    }


def test_a_payload_that_is_not_json_is_named(tmp_path):
    from colembed.distributed.targets import read_points

    columns = _good_columns(2)
    columns["payload"] = [columns["payload"][0], "{not json"]
    part = _write_part(tmp_path / "pq", columns)
    with pytest.raises(InputError, match=f"{part} row 1, column payload: not JSON"):
        read_points(str(tmp_path / "pq"))


def test_from_parquet_names_the_file_and_row_of_a_bad_payload_and_stores_nothing(tmp_path, capsys):
    columns = _good_columns(2)
    bad = json.loads(columns["payload"][1])
    bad["page"] = "abc"
    columns["payload"] = [columns["payload"][0], json.dumps(bad)]
    part = _write_part(tmp_path / "pq", columns)
    code = main(["index", "--from-parquet", str(tmp_path / "pq"), "--db", str(tmp_path / "db")])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert f"{part} row 1: /docs/1.pdf page abc" in err and "page: must be an int" in err
    store = open_store(tmp_path / "db", create=False)
    try:
        assert store.count() == 0
    finally:
        store.close()
