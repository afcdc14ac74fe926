"""The README's first command: `colembed demo` runs the main job offline, end to end, says its
weights are random, and never deletes a folder it did not create."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from colembed.cli import main
from colembed.safe_fs import is_work_folder
from colembed_export.pipeline.demo import DOCUMENTS, QUERIES, run_demo

pytestmark = pytest.mark.heavy("demo")


@pytest.mark.slow  # runs the exporter
def test_demo_indexes_searches_and_maps(tmp_path, capsys):
    result = run_demo(tmp_path / "demo", progress=lambda message: None)
    printed = capsys.readouterr().out
    assert "RANDOM WEIGHTS" in printed and "random_weights=True" in printed
    assert result["pages"] == sum(len(pages) for pages in DOCUMENTS.values())
    assert [len(hits) for hits in result["hits"]] == [3] * len(QUERIES)
    for hits, maps in zip(result["hits"], result["maps"]):
        for (file, page, score), png in zip(hits, maps):
            assert Path(file).name in DOCUMENTS and page >= 1 and score == score
            assert Image.open(png).size[0] > 0 and png in printed
    assert is_work_folder(tmp_path / "demo")  # marked: the next run may replace it, nothing else


def test_demo_refuses_a_folder_it_did_not_create(tmp_path, capsys):
    mine = tmp_path / "my-work"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    (mine / "data").mkdir()
    (mine / "data" / "results.csv").write_text("1,2,3")
    assert main(["demo", "--out", str(mine)]) == 1  # a runtime refusal (2 is for usage errors)
    assert "not created by colembed" in capsys.readouterr().err
    assert (mine / "thesis.tex").read_text() == "years of work"
    assert (mine / "data" / "results.csv").read_text() == "1,2,3"
    assert sorted(p.name for p in mine.iterdir()) == ["data", "thesis.tex"]
