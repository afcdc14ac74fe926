"""A metadata file (`MetadataTable`, `colembed index --meta-file`): Hugging Face datasets'
image-folder layout (`metadata.jsonl` / `metadata.csv`, rows naming their file in `file_name`)
read, checked whole and refused naming the line; then stored with each file's pages by a real
`colembed index` run on the tiny random-weight model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colembed.cli import main
from colembed.index import Index
from colembed.index.metadata import MAX_KEYS, MetadataError, MetadataTable
from tests.fixtures.documents import page, write_text_pdf

TOKENS = 64


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_jsonl_rows_name_their_files_relative_to_the_metadata_file(tmp_path):
    table = MetadataTable.read(
        _write(
            tmp_path / "metadata.jsonl",
            '{"file_name": "a.pdf", "team": "finance", "year": 2024}\n'
            "\n"
            '{"file_name": "sub/b.png", "tags": ["x", "y"], "score": 0.5}\n',
        )
    )
    assert table(str(tmp_path / "a.pdf")) == {"team": "finance", "year": 2024}
    assert table(str(tmp_path / "sub" / "b.png")) == {"tags": ["x", "y"], "score": 0.5}
    assert table(str(tmp_path / "other.pdf")) is None
    assert table.unused() == []


def test_csv_reads_values_as_the_command_line_does_and_skips_empty_cells(tmp_path):
    table = MetadataTable.read(
        _write(
            tmp_path / "metadata.csv",
            '\ufefffile_name,year,zip,note\na.pdf,2024,02139,"one, two"\nb.pdf,,"",x\n',
        )
    )
    assert table(str(tmp_path / "a.pdf")) == {"year": 2024, "zip": "02139", "note": "one, two"}
    assert table(str(tmp_path / "b.pdf")) == {"note": "x"}


def test_a_path_reached_through_a_link_finds_its_row(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    table = MetadataTable.read(
        _write(tmp_path / "real" / "metadata.jsonl", '{"file_name": "a.pdf", "k": 1}\n')
    )
    assert table(str(tmp_path / "link" / "a.pdf")) == {"k": 1}


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("m.jsonl", '{"file_name": "a.pdf"}\n[1]\n', "line 2: a row is a JSON object"),
        ("m.jsonl", '{"file_name": "a.pdf"}\n{"file_name": "a.pdf"}\n', "named again"),
        ("m.jsonl", '{"team": "x"}\n', "line 1: no 'file_name'"),
        ("m.jsonl", '{"file_name": "../secret.pdf", "k": 1}\n', "inside the metadata"),
        ("m.jsonl", '{"file_name": "/etc/passwd.pdf"}\n', "inside the metadata"),
        ("m.jsonl", '{"file_name": "a.pdf", "page": 3}\n', "line 1: metadata key 'page'"),
        ("m.jsonl", '{"file_name": "a.pdf", "ok": true}\n', "line 1: metadata 'ok': a bool"),
        ("m.jsonl", '{"file_name": "a.pdf",\n', "line 1: not JSON"),
        ("m.jsonl", "[" * 100_000 + "\n", "line 1: not JSON"),
        ("m.csv", "name,team\na.pdf,x\n", "'file_name' among them"),
        ("m.csv", "file_name,k,k\na.pdf,1,2\n", "named twice"),
        ("m.csv", "file_name,k\na.pdf,1,2\n", "line 2: 3 cells"),
        ("m.csv", 'file_name,k\na.pdf,"x\n', "not CSV"),
        ("m.txt", "file_name\n", "not '.txt'"),
    ],
)
def test_a_bad_metadata_file_is_refused_naming_the_line(tmp_path, name, text, message):
    with pytest.raises(MetadataError, match=message.replace("(", r"\(")) as e:
        MetadataTable.read(_write(tmp_path / name, text))
    assert name in str(e.value)


def test_not_utf8_and_too_many_keys_are_refused(tmp_path):
    bad = tmp_path / "m.jsonl"
    bad.write_bytes(b'{"file_name": "a.pdf", "k": "\xff"}\n')
    with pytest.raises(MetadataError, match="not UTF-8"):
        MetadataTable.read(bad)
    row = {"file_name": "a.pdf", **{f"k{i}": i for i in range(MAX_KEYS + 1)}}
    with pytest.raises(MetadataError, match="over the limit"):
        MetadataTable.read(_write(tmp_path / "n.jsonl", json.dumps(row)))
    with pytest.raises(MetadataError, match="cannot read"):
        MetadataTable.read(tmp_path / "absent.csv")


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=400), kind=st.sampled_from([".jsonl", ".csv"]))
def test_any_bytes_read_or_are_refused_cleanly(tmp_path, data, kind):
    path = tmp_path / f"metadata{kind}"
    path.write_bytes(data)
    try:
        table = MetadataTable.read(path)
    except MetadataError as e:
        assert str(path) in str(e)
        return
    for key, meta in table.rows.items():
        assert Path(key).is_relative_to(tmp_path.resolve())
        assert isinstance(meta, dict)


@given(
    rows=st.lists(
        st.fixed_dictionaries(
            {"file_name": st.from_regex(r"[a-z0-9 ]{1,8}(/[a-z0-9]{1,8})?\.pdf", fullmatch=True)},
            optional={
                "team": st.text(max_size=30),
                "year": st.integers(-(2**63), 2**63 - 1),
                "tags": st.lists(st.text(max_size=5), max_size=4),
            },
        ),
        max_size=8,
        unique_by=lambda r: r["file_name"],
    )
)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_jsonl_round_trips_what_metadata_accepts(tmp_path, rows):
    path = tmp_path / "metadata.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    table = MetadataTable.read(path)
    for row in rows:
        expected = {k: v for k, v in row.items() if k != "file_name"}
        assert table(str(tmp_path / row["file_name"])) == expected


def test_colembed_index_meta_file_stores_each_files_row_over_meta(tmp_path, exported_tiny, capsys):
    docs = tmp_path / "docs"
    (docs / "hr").mkdir(parents=True)
    write_text_pdf(docs / "report.pdf", [["Quarterly report 2024"], ["Invoice INV-0042"]])
    page("photo").save(docs / "hr" / "photo.png")
    page("other").save(docs / "hr" / "other.png")
    _write(
        docs / "metadata.csv",
        "file_name,team,year\nreport.pdf,finance,2024\nhr/photo.png,hr,\ngone.pdf,x,1\n",
    )
    db = tmp_path / "db"
    args = ["--db", str(db), "--model", str(exported_tiny.folder)]
    args += ["--max-image-tokens", str(TOKENS), "--quiet"]
    assert main(["index", str(docs), *args, "--meta-file", str(docs / "metadata.csv"),
                 "--meta", "origin=scan", "--meta", "team=unknown"]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "1 row(s)" in err and "gone.pdf" in err
    with Index(db) as index:
        stored = index.metadata([docs])
    assert stored[str(docs / "report.pdf")] == {
        1: {"origin": "scan", "team": "finance", "year": 2024},
        2: {"origin": "scan", "team": "finance", "year": 2024},
    }
    assert stored[str(docs / "hr" / "photo.png")] == {1: {"origin": "scan", "team": "hr"}}
    assert stored[str(docs / "hr" / "other.png")] == {1: {"origin": "scan", "team": "unknown"}}

    _write(docs / "bad.jsonl", '{"file_name": "report.pdf", "page": 1}\n')
    assert main(["index", str(docs), *args, "--meta-file", str(docs / "bad.jsonl")]) == 1
    assert "bad.jsonl line 1: metadata key 'page' is reserved" in capsys.readouterr().err
    assert main(["index", "--ray", "2", "--meta-file", str(docs / "metadata.csv"), *args]) == 2
    assert "--meta-file apply to" in capsys.readouterr().err
