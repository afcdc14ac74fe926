"""The index under the cases users hit: a second process on the folder, moved and duplicated files
(embedded once), a file with one bad page, and pdfium's fast path giving the same pixels."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pypdfium2 as pdfium
import pytest

import colembed
from colembed.cli import main
from colembed.index import Index, IndexBusyError
from colembed.index.sources import Document, render_scale
from tests.fixtures.documents import tiff_with_a_bad_page as _tiff_with_a_bad_page, write_pdf

TOKENS = 64

HOLDER = textwrap.dedent("""
    import sys
    from colembed.index.backends import open_store

    store = open_store(sys.argv[1])
    print("open", flush=True)
    sys.stdin.read()
""")


@pytest.fixture(scope="module")
def small_model(exported_tiny):
    return colembed.load(exported_tiny.folder, max_image_tokens=TOKENS)


@pytest.fixture
def embedded(small_model, monkeypatch):
    """Pages the model embeds during the test (the real model, counted)."""
    counts = []
    real = small_model.embed_pages

    def counting(images, *args, **kwargs):
        images = list(images)
        counts.append(len(images))
        return real(images, *args, **kwargs)

    monkeypatch.setattr(small_model, "embed_pages", counting)
    return counts


def _store(index):
    payloads = dict(index.store.payloads())
    return payloads, index.store.points(list(payloads))


# --------------------------------------------------------------------- one process per folder
@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_a_second_process_is_refused_naming_the_folder_and_holder(tmp_path, small_model, capsys):
    db = tmp_path / "db"
    with Index(db, model=small_model) as index:
        index.add([write_pdf(tmp_path / "a.pdf", ["a", "b"])], progress=False)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(db)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(IndexBusyError) as refused:
            Index(db, model=small_model)
        message = str(refused.value)
        assert str(db) in message and f"pid {holder.pid}" in message and "-c" in message
        assert (
            main(["search", "a", "--db", str(db), "--max-image-tokens", str(TOKENS)]) == 1
        )  # runtime, not usage
        assert f"pid {holder.pid}" in capsys.readouterr().err
    finally:
        holder.send_signal(signal.SIGKILL)  # no clean-up: the OS drops the lock
        holder.wait(timeout=30)
    with Index(db, model=small_model) as index:
        assert len(index) == 2 and index.search("a", k=1)[0].file == str(tmp_path / "a.pdf")


# ------------------------------------------------------------- content embedded once, any path
def test_moved_and_duplicated_files_reuse_the_stored_vectors(tmp_path, small_model, embedded):
    docs = tmp_path / "docs"
    docs.mkdir()
    write_pdf(docs / "a.pdf", ["alpha 1", "alpha 2", "alpha 3"])
    shutil.copy(docs / "a.pdf", docs / "copy.pdf")
    with Index(tmp_path / "db", model=small_model) as index:
        first = index.add([docs], progress=False)
        assert sum(embedded) == 3  # two identical files: embedded once
        reports = {r.path.rsplit("/", 1)[-1]: r for r in first.added}
        assert (reports["a.pdf"].pages, reports["a.pdf"].reused) == (3, 0)
        assert (reports["copy.pdf"].pages, reports["copy.pdf"].reused) == (3, 3)
        assert "same content as" in reports["copy.pdf"].reason
        (docs / "moved").mkdir()
        (docs / "a.pdf").rename(docs / "moved" / "b.pdf")
        second = index.add([docs], prune=True, progress=False)
        assert sum(embedded) == 3  # the moved file is not embedded again
        assert [(r.path, r.pages, r.reused) for r in second.added] == [
            (str(docs / "moved" / "b.pdf"), 3, 3)
        ]
        assert [(r.path, r.pages) for r in second.removed] == [(str(docs / "a.pdf"), 3)]
        payloads, points = _store(index)
    with Index(tmp_path / "clean", model=small_model) as clean:  # the same folder from scratch
        clean.add([docs], progress=False)
        clean_payloads, clean_points = _store(clean)
    assert payloads == clean_payloads and len(payloads) == 6
    by_path = {(p["path"], p["page"]): pid for pid, p in payloads.items()}
    for n in (1, 2, 3):  # copies hold exactly the vectors of the pages they were copied from
        moved = by_path[(str(docs / "moved" / "b.pdf"), n)]
        copy = by_path[(str(docs / "copy.pdf"), n)]
        for name, vectors in points[copy].vectors.items():
            np.testing.assert_array_equal(points[moved].vectors[name], vectors)
            np.testing.assert_allclose(clean_points[moved].vectors[name], vectors, atol=2e-3)


# ------------------------------------------------------------------------- a file with a bad page
def test_a_bad_page_fails_its_file_keeps_the_rest_and_a_rerun_changes_nothing(
    tmp_path, small_model, embedded
):
    docs = tmp_path / "docs"
    docs.mkdir()
    scan = _tiff_with_a_bad_page(docs / "scan.tiff", 5, bad=3)
    write_pdf(docs / "memo.pdf", ["memo"])
    with Index(tmp_path / "db", model=small_model) as index:
        first = index.add([docs], progress=False)
        assert [(r.path, r.pages) for r in first.added] == [(str(docs / "memo.pdf"), 1)]
        (failed,) = first.failed
        assert failed.path == str(scan) and failed.pages == 4
        assert failed.reason.startswith("page 3 of 5: cannot decode image")
        assert sorted(p["page"] for _, p in index.store.payloads() if p["path"] == str(scan)) == [
            1,
            2,
            4,
            5,
        ]
        before = _store(index)[0]
        embedded.clear()
        again = index.add([docs], progress=False)
        assert sum(embedded) == 0 and [r.reason for r in again.failed] == [failed.reason]
        assert again.failed[0].pages == 0 and _store(index)[0] == before


# ------------------------------------------------------------------------------------- rendering
def test_pdf_fast_path_gives_pdfiums_default_pixels(tmp_path):
    pdf = write_pdf(tmp_path / "a.pdf", ["pixels", "again"])
    budget = 200_000
    with Document(pdf, max_pixels=budget) as doc:
        ours = [doc.render(n) for n in (1, 2)]
    document = pdfium.PdfDocument(str(pdf))
    for n, image in enumerate(ours):
        pdf_page = document[n]
        scale = render_scale(*pdf_page.get_size(), max_pixels=budget, dpi=None)
        default = pdf_page.render(scale=scale).to_pil().convert("RGB")  # BGR, swapped by PIL
        assert image.mode == "RGB"
        np.testing.assert_array_equal(np.asarray(image), np.asarray(default))
    document.close()
