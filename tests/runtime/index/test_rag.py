"""What a retrieval-augmented generation builder reads from an index, end to end on the tiny
random-weight model (64 image tokens a page): metadata given at indexing and changed later,
`where=` filters through `Index.search` and the CLI, and each PDF page's text layer with its
hit (none for images and scans).

The random weights rank pages arbitrarily, so these tests check what comes back with a hit and
which pages a filter lets through, never which page ranks first.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import colembed
from colembed.cli import main
from colembed.index import Index
from colembed.index.metadata import MetadataError
from colembed.index.schema import MAX_TEXT_BYTES, TEXT_FIELD
from colembed.index.where import FilterError
from tests.fixtures.documents import page, write_pdf, write_text_pdf
from tests.fixtures.stores import make_index  # noqa: F401  (a fixture)

TOKENS = 64
PAGES = [
    ["Quarterly report 2024", "Revenue grew by twelve percent"],
    ["Invoice INV-2024-0042", "Total due 1,250.00 EUR"],
    ["Minutes of the board meeting", "(approved)"],
]


@pytest.fixture(scope="module")
def small_model(exported_tiny):
    return colembed.load(exported_tiny.folder, max_image_tokens=TOKENS)


@pytest.fixture
def docs(tmp_path) -> Path:
    folder = tmp_path / "docs"
    (folder / "finance").mkdir(parents=True)
    (folder / "hr").mkdir()
    write_text_pdf(folder / "finance" / "report.pdf", PAGES)
    write_pdf(folder / "hr" / "scan.pdf", ["scanned 1", "scanned 2"])  # pixels, no text layer
    page("photo").save(folder / "hr" / "photo.png")
    return folder


def _all(index: Index, **kwargs):
    return index.search("anything", k=50, mode="exact", **kwargs)


def test_metadata_round_trips_and_filters_select_by_it(docs, make_index):
    with make_index() as index:

        def meta_of(path: str):
            return {"team": Path(path).parent.name, "year": 2024 if "report" in path else 2019}

        result = index.add([docs], metadata=meta_of)
        assert result.ok and len(index) == 6
        hits = _all(index)
        assert len(hits) == 6
        assert {(Path(h.file).name, h.metadata["team"], h.metadata["year"]) for h in hits} == {
            ("report.pdf", "finance", 2024),
            ("scan.pdf", "hr", 2019),
            ("photo.png", "hr", 2019),
        }
        finance = _all(index, where={"team": "finance"})
        assert {(Path(h.file).name, h.page) for h in finance} == {
            ("report.pdf", n) for n in (1, 2, 3)
        }
        assert {h.page for h in _all(index, where=["team=finance", "page>=2"])} == {2, 3}
        assert {Path(h.file).name for h in _all(index, where={"year": {"lt": 2020}})} == {
            "scan.pdf",
            "photo.png",
        }
        assert {Path(h.file).name for h in _all(index, where={"path": "hr/*.pdf"})} == {"scan.pdf"}
        assert len(_all(index, where={"folder": docs / "hr"})) == 3
        assert len(_all(index, where={"file": str(docs / "hr" / "photo.png")})) == 1
        assert _all(index, where={"team": "legal"}) == []
        two = index.search("anything", k=2, where={"team": "hr"})  # two-stage, filtered
        assert len(two) == 2 and all(h.metadata["team"] == "hr" for h in two)

        # changed in place, nothing embedded: a later add of stored files merges, set_metadata
        # merges or replaces, and None removes a key
        again = index.add([docs / "hr"], metadata={"reviewed": "yes"})
        assert not again.added and len(again.skipped) == 2
        assert {h.metadata["reviewed"] for h in _all(index, where={"team": "hr"})} == {"yes"}
        assert index.set_metadata(docs / "finance", {"year": None, "quarter": 4}, pages=[2]) == 1
        by_page = {h.page: h.metadata for h in _all(index, where={"team": "finance"})}
        assert by_page[2] == {"team": "finance", "quarter": 4}
        assert by_page[1] == {"team": "finance", "year": 2024}
        assert index.set_metadata([docs / "hr" / "photo.png"], {"kind": "image"}, replace=True) == 1
        (photo,) = _all(index, where={"kind": "image"})
        assert photo.metadata == {"kind": "image"} and Path(photo.file).name == "photo.png"
        assert index.metadata(docs / "hr" / "photo.png") == {
            str(docs / "hr" / "photo.png"): {1: {"kind": "image"}}
        }


def test_bad_metadata_and_filters_are_refused_naming_them(docs, make_index):
    with make_index() as index:
        with pytest.raises(MetadataError, match="'page' is reserved"):
            index.add([docs], metadata={"page": 1})
        assert len(index) == 0  # refused before anything is stored

        def flaky(path: str):
            if path.endswith("photo.png"):
                return {"bad key": 1}
            if path.endswith("scan.pdf"):
                raise KeyError("no record for this file")
            return {"ok": 1}

        result = index.add([docs], metadata=flaky)
        failed = {Path(r.path).name: r.reason for r in result.failed}
        assert set(failed) == {"photo.png", "scan.pdf"}
        assert "photo.png: metadata key 'bad key' is not a name" in failed["photo.png"]
        assert "metadata function failed: KeyError" in failed["scan.pdf"]
        assert {Path(r.path).name for r in result.added} == {"report.pdf"}
        with pytest.raises(FilterError, match="operators"):
            index.search("x", where={"ok": {"about": 1}})


def test_each_pdf_page_keeps_its_text_and_images_have_none(docs, make_index, tmp_path):
    long = tmp_path / "long.pdf"
    lines = [f"line {n} " + "x" * 90 for n in range(500)]  # ~50 KB of text: over the bound
    write_text_pdf(long, [lines], size=(1200, 8100))
    with make_index() as index:
        assert index.add([docs, long]).ok
        hits = {(Path(h.file).name, h.page): h for h in _all(index)}
        for n, lines in enumerate(PAGES, 1):
            assert hits["report.pdf", n].text == "\n".join(lines)
        assert hits["scan.pdf", 1].text == ""  # a PDF page drawn as an image: no text layer
        assert hits["photo.png", 1].text is None  # an image file: no text to read
        assert TEXT_FIELD not in hits["photo.png", 1].payload
        assert not hits["report.pdf", 1].text_truncated
        # the stored form is compressed and bounded
        assert len(hits["report.pdf", 2].payload[TEXT_FIELD]) < 200
        cut = hits["long.pdf", 1]
        assert len(cut.text.encode()) <= MAX_TEXT_BYTES and cut.text_truncated
        # the catalog's listing leaves the text out (read on every add)
        assert all(TEXT_FIELD not in p for _, p in index.store.payloads())


def test_a_copy_at_another_path_gets_its_own_metadata_not_the_originals(tmp_path, small_model):
    """Metadata can say who may see a file: a copy elsewhere (its vectors reused, not embedded
    again) must not inherit the original's. A changed file keeps its own metadata."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    write_text_pdf(a / "doc.pdf", PAGES[:2])
    with Index(tmp_path / "db", model=small_model) as index:
        index.add([a], metadata={"tenant": "17"})
        (b / "doc.pdf").write_bytes((a / "doc.pdf").read_bytes())
        result = index.add([b])
        assert result.added[0].reused == 2
        copies = _all(index, where={"folder": b})
        assert len(copies) == 2 and all(h.metadata == {} for h in copies)
        assert all(h.text for h in copies)  # the text is the content's: it comes along
        write_text_pdf(a / "doc.pdf", [["changed"]])
        assert index.add([a]).added[0].reason == "replaced an older version"
        (changed,) = _all(index, where={"folder": a})
        assert changed.metadata == {"tenant": "17"} and changed.text == "changed"


def test_cli_meta_where_and_json(docs, exported_tiny, capsys):
    db = str(docs.parent / "db")
    common = ["--db", db, "--model", str(exported_tiny.folder), "--max-image-tokens", str(TOKENS)]
    assert (
        main(
            [
                "index",
                str(docs / "finance"),
                *common,
                "--quiet",
                "--meta",
                "team=finance",
                "--meta",
                "year=2024",
            ]
        )
        == 0
    )
    assert main(["index", str(docs / "hr"), *common, "--quiet", "--meta", "team=hr"]) == 0
    capsys.readouterr()
    assert (
        main(
            [
                "search",
                "invoice",
                "-k",
                "9",
                "--mode",
                "exact",
                "--db",
                db,
                "--json",
                "--where",
                "team=finance",
                "--where",
                "page=2..3",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    hits = out[0]["hits"]
    assert sorted(h["page"] for h in hits) == [2, 3]
    assert all(h["metadata"] == {"team": "finance", "year": 2024} for h in hits)
    assert {h["text"] for h in hits} == {"\n".join(PAGES[1]), "\n".join(PAGES[2])}
    assert (
        main(
            [
                "meta",
                str(docs / "hr"),
                "--db",
                db,
                "--set",
                "team=people",
                "--unset",
                "nothing",
                "--json",
            ]
        )
        == 0
    )
    changed = json.loads(capsys.readouterr().out)
    assert changed["changed_pages"] == 3
    assert {m["team"] for pages in changed["files"].values() for m in pages.values()} == {"people"}
    assert (
        main(["search", "x", "--db", db, "--where", "team=people", "-k", "9", "--mode", "exact"])
        == 0
    )
    assert capsys.readouterr().out.count("team=people") == 3
    assert main(["search", "x", "--db", db, "--where", "team"]) == 1
    assert "key=value" in capsys.readouterr().err
    assert main(["index", str(docs), *common, "--meta", "page=3"]) == 1
    assert "'page' is reserved" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- hybrid
FILLER = [
    "Quarterly report on revenue and margins",
    "Minutes of the board meeting",
    "Holiday schedule for the support team",
    "Safety instructions for the warehouse",
    "Product roadmap and release plan",
    "Travel expense policy",
    "Onboarding checklist",
    "Office seating plan",
    "Customer survey results",
    "Server maintenance window",
    "Training catalogue",
    "Parking regulations",
]


def _planted(folder: Path, target: int) -> list[Path]:
    """One text PDF per filler topic; page `target` also carries an invoice number."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i, topic in enumerate(FILLER):
        lines = [topic, "Prepared by the operations office"]
        if i == target:
            lines.append("Invoice number ZX-7781-QK payable within 30 days")
        out.append(write_text_pdf(folder / f"doc{i:02d}.pdf", [lines]))
    return out


@pytest.mark.parametrize("kind", ["edge", "client-local"])
def test_hybrid_finds_a_planted_identifier_maxsim_ranks_low(kind, tmp_path, small_model):
    """MaxSim with random weights cannot tell the page holding "ZX-7781-QK" from the others;
    BM25 over the pages' text gives it the only lexical match, and reciprocal rank fusion puts
    it first."""
    query = "invoice ZX-7781-QK"
    with Index(tmp_path / "db", model=small_model, local=kind == "client-local") as index:
        assert index.store.has_lexical
        files = _planted(tmp_path / "docs", target=5)
        assert index.add(files).ok
        dense = {
            Path(h.file).name: h.score for h in index.search(query, k=len(FILLER), mode="exact")
        }
        # MaxSim alone does not single it out: another page scores as high or higher (with
        # random weights the prompt rows carry the whole score, so pages tie)
        assert max(v for name, v in dense.items() if name != "doc05.pdf") >= dense["doc05.pdf"]
        hybrid = index.search(query, k=3, mode="hybrid")
        assert Path(hybrid[0].file).name == "doc05.pdf"
        assert hybrid[0].score > hybrid[1].score  # first in both lists' fusion, by a margin
        # filters hold in hybrid mode too
        assert index.search(query, k=3, mode="hybrid", where={"file": str(files[5])})[0].page == 1
        assert all(
            Path(h.file).name != "doc05.pdf"
            for h in index.search(query, k=5, mode="hybrid", where={"path": "doc1*.pdf"})
        )


def test_upgrade_adds_the_lexical_vector_to_a_folder_made_without_it(
    tmp_path, small_model, monkeypatch, capsys
):
    from colembed.index import edge

    files = _planted(tmp_path / "docs", target=2)
    with monkeypatch.context() as m:  # a folder as colembed made it before hybrid search
        real = edge.EdgeStore._create

        def without_lexical(self, dim):
            real(self, dim)
            self.shard.close()
            import shutil

            shutil.rmtree(self.folder / edge.SHARD_DIR)
            self.shard = edge.qe.EdgeShard.create(
                str(self.folder / edge.SHARD_DIR),
                edge.qe.EdgeConfig(
                    vectors={n: edge._vector_params(dim, n) for n in edge.SCHEMA_VECTORS[3]}
                ),
            )
            edge._write_meta(self.folder, {"schema": 3, "dim": dim, "store": "qdrant-edge"})
            self.has_lexical = False

        m.setattr(edge.EdgeStore, "_create", without_lexical)
        with Index(tmp_path / "db", model=small_model) as index:
            assert index.add(files).ok and not index.store.has_lexical
    with Index(tmp_path / "db", model=small_model) as index:
        with pytest.raises(colembed.index.StoreError, match="colembed upgrade --db"):
            index.search("ZX-7781-QK", mode="hybrid")
        before = {h.id: h.score for h in index.search("x", k=12, mode="exact")}
    assert main(["upgrade", "--db", str(tmp_path / "db"), "--quiet"]) == 0
    assert (
        "added the lexical (BM25) vector for hybrid search (12 page(s) with text)"
        in capsys.readouterr().out
    )
    with Index(tmp_path / "db", model=small_model) as index:
        assert index.store.has_lexical
        assert (
            Path(index.search("invoice ZX-7781-QK", k=1, mode="hybrid")[0].file).name == "doc02.pdf"
        )
        assert {h.id: h.score for h in index.search("x", k=12, mode="exact")} == before
