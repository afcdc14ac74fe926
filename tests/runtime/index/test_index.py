"""`colembed.Index` end to end on the tiny random-weight model: layout API, ingestion of good and
bad files, resumability, replacement, pruning, search, model identity, CLI.

Pages are embedded at 64 image tokens (`max_image_tokens=64`) to keep the suite fast; the
pipeline is the same at 768. The server adapter is covered through qdrant-client's local mode
(no Qdrant server can run here; see test_index_store.py).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import colembed
from colembed.cli import main
from colembed.index import Index, ModelMismatchError
from colembed.index.schema import make_point
from colembed.index.sources import Document, render_scale
from colembed.preprocess.images import resized_grid
from tests.fixtures.documents import bad_folder, good_folder, page, write_pdf
from tests.fixtures.stores import make_index  # noqa: F401  (a fixture)

TOKENS = 64


@pytest.fixture(scope="module")
def small_model(exported_tiny):
    return colembed.load(exported_tiny.folder, max_image_tokens=TOKENS)


def test_add_embedded_sizes_a_page_by_the_manifest_of_its_model_folder(exported_tiny, tmp_path):
    """No size, no token_px, no model loaded: the page's model folder (the identity's
    model_source) declares its patch x merge; a ColQwen3-like manifest (16 px patches) makes
    tokens of 32 px, not ColQwen2's 28."""
    from colembed.index.backends import open_store
    from colembed.index.embedded import EmbeddedPage

    folder = tmp_path / "model"
    folder.mkdir()
    manifest = json.loads((exported_tiny.folder / "colembed_manifest.json").read_text())
    manifest["preprocess"]["patch_size"] = 16
    (folder / "colembed_manifest.json").write_text(json.dumps(manifest))
    identity = {
        "model": "m",
        "variant": "fp32",
        "manifest_sha256": "h",
        "model_source": str(folder),
    }
    vectors = np.random.default_rng(0).standard_normal((2 + 3 * 4, 8))
    vectors = (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)
    open_store(tmp_path / "db", dim=8).close()
    with Index(tmp_path / "db") as index:
        index.add_embedded(
            [EmbeddedPage("/docs/a.pdf", 1, vectors, (3, 4), 2, sha256="a" * 64)], identity=identity
        )
        ((_, stored),) = index.store.payloads()
    assert (stored["width"], stored["height"]) == (4 * 32, 3 * 32)


# ------------------------------------------------------------------------------ the layout API
@pytest.mark.parametrize("size", [(420, 560), (900, 300), (200, 200)])
def test_page_layout_matches_the_preprocessing(tiny_model, size):
    image = page("layout", size=size)
    ((vectors, layout),) = tiny_model.embed_pages([image])
    _, gh, gw = resized_grid(size[1], size[0], tiny_model.config)
    m = tiny_model.config.merge_size
    assert (layout.grid_rows, layout.grid_cols) == (gh // m, gw // m)
    ids = tiny_model.text_encoder.page_prompt_ids(layout.num_image_tokens)
    image_rows = np.flatnonzero(ids == tiny_model.config.image_token_id)
    assert layout.num_tokens == len(ids) == len(vectors)
    assert list(range(layout.image_rows.start, layout.image_rows.stop)) == list(image_rows)
    assert layout.resized_size == (
        gw * tiny_model.config.patch_size,
        gh * tiny_model.config.patch_size,
    )
    np.testing.assert_array_equal(vectors, tiny_model.embed_images([image])[0])


def test_token_boxes_tile_the_page_exactly(tiny_model):
    ((_, layout),) = tiny_model.embed_pages([page("boxes", size=(431, 577))])
    size = (431, 577)
    assert layout.token_box(0, 0, size)[:2] == (0.0, 0.0)
    right, bottom = layout.token_box(layout.grid_rows - 1, layout.grid_cols - 1, size)[2:]
    assert (right, bottom) == pytest.approx(size)
    for r in range(layout.grid_rows):
        for c in range(layout.grid_cols - 1):
            assert layout.token_box(r, c, size)[2] == layout.token_box(r, c + 1, size)[0]


def test_pdf_pages_render_at_the_models_pixel_budget(tmp_path, small_model):
    pdf = write_pdf(tmp_path / "a.pdf", ["budget"])
    with Document(pdf, max_pixels=small_model.config.max_pixels) as doc:
        image = doc.render(1)
    budget = small_model.config.max_pixels
    assert 0.97 * budget <= image.width * image.height <= 1.03 * budget
    with Document(pdf, max_pixels=budget, dpi=144) as doc:
        assert doc.render(1).size == (840, 1120)  # the 420x560 pt page at 2x
    assert render_scale(612, 792, max_pixels=budget, dpi=72) == 1.0


# ------------------------------------------------------------------------------------ indexing
def test_add_search_skip_remove(tmp_path, make_index):
    docs = good_folder(tmp_path / "docs")
    index = make_index()
    result = index.add([tmp_path / "docs"])
    assert {os.path.basename(r.path): r.pages for r in result.added} == docs
    assert result.ok and len(index) == sum(docs.values())
    again = index.add([tmp_path / "docs"])
    assert not again.added and {r.reason for r in again.skipped} == {"already indexed"}
    hits = index.search("what does the report say?", k=3)
    assert len(hits) == 3 and all(h.page >= 1 and os.path.isfile(h.file) for h in hits)
    assert hits[0].score >= hits[1].score >= hits[2].score
    exact = index.search(["one", "two"], k=len(index), mode="exact")
    assert [len(r) for r in exact] == [len(index)] * 2
    assert index.remove([tmp_path / "docs" / "report.pdf"]) == 3 and len(index) == 4
    index.close()


def test_changed_file_replaces_its_pages_and_prune_drops_vanished(tmp_path, make_index):
    good_folder(tmp_path / "docs")
    index = make_index()
    index.add([tmp_path / "docs"])
    write_pdf(tmp_path / "docs" / "report.pdf", ["new 1", "new 2"])  # 3 pages -> 2
    (tmp_path / "docs" / "memo.pdf").unlink()
    result = index.add([tmp_path / "docs"], prune=True)
    assert [(os.path.basename(r.path), r.pages) for r in result.added] == [("report.pdf", 2)]
    assert [os.path.basename(r.path) for r in result.removed] == ["memo.pdf"]
    pages = sorted((os.path.basename(p["path"]), p["page"]) for _, p in index.store.payloads())
    assert pages == [
        ("photo.png", 1),
        ("report.pdf", 1),
        ("report.pdf", 2),
        ("scan.tiff", 1),
        ("scan.tiff", 2),
    ]
    index.close()


def test_bad_files_are_reported_and_the_rest_indexed(tmp_path, make_index):
    good_folder(tmp_path / "docs")
    expected = bad_folder(tmp_path / "docs" / "bad")
    (tmp_path / "empty").mkdir()
    index = make_index()
    result = index.add([tmp_path / "docs", tmp_path / "empty", tmp_path / "nowhere.pdf"])
    failed = {os.path.basename(r.path): r.reason for r in result.failed}
    skipped = {os.path.basename(r.path): r.reason for r in result.skipped}
    assert failed.pop("nowhere.pdf") == "no such file or folder"
    assert skipped.pop("empty") == "folder holds no PDFs or images"
    for name, word in expected.items():
        assert word in (failed.get(name) or skipped.get(name)), (name, failed, skipped)
    assert len(index) == 7 and not result.ok
    index.close()


def test_an_index_refuses_another_models_vectors(tmp_path, small_model):
    index = Index(tmp_path / "db", model=small_model)
    vectors, layout = small_model.embed_pages([page("x")])[0]
    foreign = dict(
        index.identity,
        manifest_sha256="0" * 64,
        path="/x.pdf",
        page=1,
        pages=1,
        sha256="1" * 64,
        width=1,
        height=1,
    )
    index.store.upsert([make_point(vectors, layout, foreign)])
    index.close()
    with pytest.raises(ModelMismatchError, match="manifest_sha256"):
        Index(tmp_path / "db", model=small_model)


def test_reopen_without_a_model_uses_the_recorded_one(tmp_path, small_model):
    with Index(tmp_path / "db", model=small_model) as index:
        index.add([write_pdf(tmp_path / "a.pdf", ["a", "b"])])
    with Index(tmp_path / "db", max_image_tokens=TOKENS) as reopened:
        assert len(reopened) == 2
        assert reopened.search("a", k=1)[0].file == str(tmp_path / "a.pdf")


# ---------------------------------------------------------------------------------------- CLI
def test_cli_index_and_search(tmp_path, exported_tiny, capsys):
    good_folder(tmp_path / "docs")
    (tmp_path / "docs" / "empty.pdf").write_bytes(b"")
    common = ["--db", str(tmp_path / "db"), "--max-image-tokens", str(TOKENS), "--quiet"]
    code = main(["index", str(tmp_path / "docs"), "--model", str(exported_tiny.folder), *common])
    out, err = capsys.readouterr()
    assert code == 1 and "empty.pdf: empty file" in err and "added 7 page(s) from 4 file(s)" in out
    assert main(["search", "the memo", "-k", "2", *common, "--maps", str(tmp_path / "maps")]) == 0
    out, _ = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == "query: the memo" and lines[1].split() == ["rank", "score", "page", "file"]
    assert lines[2].split()[0] == "1" and len(list((tmp_path / "maps").glob("*.png"))) == 2
    assert main(["search", "the memo", "-k", "1", "--json", *common]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer[0]["hits"][0]["rank"] == 1 and answer[0]["hits"][0]["page"] >= 1
