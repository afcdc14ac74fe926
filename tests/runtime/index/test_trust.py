"""An index users can trust: no silent short run, no leaked lock, nothing deleted that
the run does not own, reopened as it was built, a CLI that says what happened.

Faults are injected at library boundaries (pypdfium2, the model's `embed_pages`, the store's
`upsert` / `flush`, the OS), never inside colembed's own threads. The tiny random-weight model at
64 image tokens keeps it fast.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pypdfium2 as pdfium
import pytest

import colembed
from colembed.cli import _parse, main
from colembed.index import Index, IndexBusyError, IndexNotFoundError, ModelMismatchError, StoreError
from colembed.index.records import ModelIdentity
from tests.fixtures.commands import quiet_index_flags
from tests.fixtures.documents import write_pdf

TOKENS = 64


@pytest.fixture(scope="module")
def small_model(exported_tiny):
    return colembed.load(exported_tiny.folder, max_image_tokens=TOKENS)


def _number_pages(monkeypatch):
    """pypdfium2's pages, each told its 1-based number (`page.number`) when the document hands it
    out, so a patched `PdfPage.render` can fail on one page."""
    real = pdfium.PdfDocument.__getitem__

    def getitem(self, i):
        page = real(self, i)
        page.number = i + 1
        return page

    monkeypatch.setattr(pdfium.PdfDocument, "__getitem__", getitem)


def _source_name(source) -> str:
    """The path pypdfium2 reads: a path, or the open file colembed hands it (its `name`)."""
    return str(getattr(source, "name", source))


def _contents(index):
    return sorted((p["path"], p["page"], p["sha256"]) for _, p in index.store.payloads())


# ---------------------------------------------------- 1. a run never stops early looking complete
def test_an_unexpected_error_on_a_page_fails_that_page_and_the_run_goes_on(
    tmp_path, small_model, monkeypatch
):
    docs = tmp_path / "docs"
    docs.mkdir()
    write_pdf(docs / "a.pdf", ["a 1", "poster", "a 3"])
    write_pdf(docs / "b.pdf", ["b 1"])
    write_pdf(docs / "c.pdf", ["c 1", "c 2"])
    _number_pages(monkeypatch)
    real_render = pdfium.PdfPage.render

    def render(self, *args, **kwargs):  # pdfium running out of memory on page 2 of a.pdf
        if _source_name(self.pdf._input) == str(docs / "a.pdf") and self.number == 2:
            raise MemoryError("cannot allocate the bitmap")
        return real_render(self, *args, **kwargs)

    def open_document(self, source, *args, **kwargs):
        if _source_name(source).endswith("b.pdf"):
            raise OSError(5, "Input/output error")  # the disk under b.pdf
        real_init(self, source, *args, **kwargs)

    real_init = pdfium.PdfDocument.__init__
    monkeypatch.setattr(pdfium.PdfPage, "render", render)
    monkeypatch.setattr(pdfium.PdfDocument, "__init__", open_document)
    with Index(tmp_path / "db", model=small_model) as index:
        result = index.add([docs], progress=False)
        assert not result.ok
        failed = {os.path.basename(r.path): r for r in result.failed}
        assert failed["a.pdf"].reason == (
            "page 2 of 3: unexpected MemoryError: cannot allocate "
            "the bitmap; its other 2 page(s) are indexed"
        )
        assert "b.pdf" in failed and "Input/output error" in failed["b.pdf"].reason
        assert [os.path.basename(r.path) for r in result.added] == ["c.pdf"]
        assert len(index) == 4


def test_an_error_in_the_model_on_one_page_fails_that_page_only(tmp_path, small_model, monkeypatch):
    write_pdf(tmp_path / "a.pdf", ["a 1", "a 2", "a 3", "a 4", "a 5"])
    real = type(small_model).embed_pages

    def embed_pages(self, images, *args, **kwargs):  # a RuntimeError from onnxruntime on page 3
        if any(getattr(im, "info", {}).get("bad") for im in images):
            if len(images) == 1:
                raise RuntimeError("onnxruntime: bad allocation")
            raise RuntimeError("onnxruntime: bad allocation (batch)")
        return real(self, images, *args, **kwargs)

    _number_pages(monkeypatch)
    real_render = pdfium.PdfPage.render

    def render(self, *args, **kwargs):
        bitmap = real_render(self, *args, **kwargs)
        if self.number == 3:
            real_to_pil = bitmap.to_pil
            bitmap.to_pil = lambda: _marked(real_to_pil())
        return bitmap

    def _marked(image):
        image.info["bad"] = True
        return image

    monkeypatch.setattr(type(small_model), "embed_pages", embed_pages)
    monkeypatch.setattr(pdfium.PdfPage, "render", render)
    with Index(tmp_path / "db", model=small_model) as index:
        result = index.add([tmp_path / "a.pdf"], batch_size=4, progress=False)
        (failed,) = result.failed
        assert failed.reason.startswith("page 3 of 5: unexpected RuntimeError: onnxruntime")
        assert sorted(p["page"] for _, p in index.store.payloads()) == [1, 2, 4, 5]


def test_a_store_that_fails_ends_the_run_with_its_error_not_a_flush_error(tmp_path, small_model):
    write_pdf(tmp_path / "a.pdf", ["a"])
    with Index(tmp_path / "db", model=small_model) as index:

        def upsert(points):
            raise StoreError("upsert failed: the server went away")

        def flush():
            raise StoreError("flush failed too")

        index.store.upsert, index.store.flush = upsert, flush
        with pytest.raises(StoreError, match="upsert failed") as raised:
            index.add([tmp_path / "a.pdf"], progress=False)
        assert any("flush failed too" in n for n in getattr(raised.value, "__notes__", []))
        del index.store.upsert, index.store.flush


# ---------------------------------------------------------------------------- 2. no leaked lock
def test_a_refused_or_forgotten_index_does_not_keep_its_folder_locked(
    tmp_path, small_model, exported_tiny
):
    db = tmp_path / "db"
    with Index(db, model=small_model) as index:
        index.add([write_pdf(tmp_path / "a.pdf", ["a"])], progress=False)
    other = colembed.load(exported_tiny.folder, max_image_tokens=2 * TOKENS)
    with pytest.raises(ModelMismatchError):
        Index(db, model=other)
    forgotten = Index(db, model=small_model)  # no close, no context manager
    with pytest.raises(IndexBusyError, match="this process"):
        Index(db, model=small_model)
    del forgotten
    gc.collect()
    with Index(db, model=small_model) as index:
        assert len(index) == 1


# ------------------------------------------------------------- 3, 4. reopened as it was built
def test_reopening_loads_the_image_budget_it_was_built_with(
    tmp_path, small_model, exported_tiny, capsys
):
    db = tmp_path / "db"
    with Index(db, model=small_model) as index:
        index.add([write_pdf(tmp_path / "a.pdf", ["alpha", "beta"])], progress=False)
    with Index(db) as reopened:  # no model, no budget: the stored ones
        assert reopened.model.max_image_tokens == TOKENS and reopened.model.variant == "fp32"
        assert reopened.search("alpha", k=1)[0].file == str(tmp_path / "a.pdf")
    with Index(db, model=exported_tiny.folder) as given:  # a folder without a budget: the stored
        assert given.model.max_image_tokens == TOKENS
    assert main(["search", "alpha", "--db", str(db), "-k", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["hits"][0]["file"] == str(tmp_path / "a.pdf")


def test_runs_at_another_budget_or_dpi_are_refused_naming_both(
    tmp_path, small_model, exported_tiny
):
    db = tmp_path / "db"
    with Index(db, model=small_model) as index:
        index.add([write_pdf(tmp_path / "a.pdf", ["a"])], progress=False)
        with pytest.raises(
            ModelMismatchError, match="render: the index has 'pixel budget', this run '100 dpi'"
        ):
            index.add([write_pdf(tmp_path / "b.pdf", ["b"])], dpi=100, progress=False)
    with pytest.raises(
        ModelMismatchError, match=f"max_image_tokens: the index has {TOKENS}, this run {2 * TOKENS}"
    ):
        Index(db, model=exported_tiny.folder, max_image_tokens=2 * TOKENS)
    code = main(
        [
            "index",
            str(tmp_path / "b.pdf"),
            "--db",
            str(db),
            "--quiet",
            "--max-image-tokens",
            str(2 * TOKENS),
        ]
    )
    assert code == 1
    with Index(db) as index:
        assert _contents(index) == [(str(tmp_path / "a.pdf"), 1, _contents(index)[0][2])]


def test_an_index_at_a_dpi_reopens_at_that_dpi(tmp_path, small_model):
    db = tmp_path / "db"
    with Index(db, model=small_model) as index:
        index.add([write_pdf(tmp_path / "a.pdf", ["a"])], dpi=50, progress=False)
    with Index(db, model=small_model) as index:
        again = index.add([write_pdf(tmp_path / "b.pdf", ["b"])], progress=False)
        assert again.ok and {p["render"] for _, p in index.store.payloads()} == {"50 dpi"}


def test_the_identity_holds_what_changes_vectors(small_model):
    a = ModelIdentity.of_model(small_model, schema=2, dpi=None)
    b = ModelIdentity.of_folder(
        small_model.folder, variant="fp32", max_image_tokens=TOKENS, dpi=None, schema=2
    )
    assert a == b and a.max_image_tokens == TOKENS
    older = {k: v for k, v in a.payload().items() if k not in ModelIdentity.LATER}
    a.check(older, "db")  # an index written before the budget was recorded still opens
    with pytest.raises(ModelMismatchError, match="variant: the index has 'int8', this run 'fp32'"):
        a.check(dict(a.payload(), variant="int8"), "db")


# ----------------------------------------------------- 5. prune and replacement: only what we own
def test_prune_touches_only_given_present_roots_and_this_source(tmp_path, small_model):
    first, second, elsewhere = (tmp_path / n for n in ("first", "second", "elsewhere"))
    for folder in (first, second, elsewhere):
        folder.mkdir()
        write_pdf(folder / "keep.pdf", [f"{folder.name} keep"])
        write_pdf(folder / "gone.pdf", [f"{folder.name} gone"])
    db = tmp_path / "db"
    with Index(db, model=small_model) as index:
        index.add([first, second, elsewhere], progress=False)
    with Index(db, model=small_model, source="laptop-2") as other:  # another machine, same paths
        write_pdf(tmp_path / "theirs.pdf", ["theirs"])
        other.add([tmp_path / "theirs.pdf"], progress=False)
    (tmp_path / "theirs.pdf").unlink()
    for folder in (first, second, elsewhere):
        (folder / "gone.pdf").unlink()
    shutil.move(first, tmp_path / "unmounted")  # the drive is not mounted this time
    with Index(db, model=small_model) as index:
        result = index.add([first, second], prune=True, progress=False)
        assert [r.path for r in result.removed] == [str(second / "gone.pdf")]
        assert (
            result.failed[0].path == str(first)
            and "nothing under it was pruned" in result.failed[0].reason
        )
        paths = {p for p, _, _ in _contents(index)}
        assert str(first / "gone.pdf") in paths and str(elsewhere / "gone.pdf") in paths
        assert str(tmp_path / "theirs.pdf") in paths  # another source's page
        everything = index.add([tmp_path], prune=True, progress=False)  # a root holding theirs
        assert str(tmp_path / "theirs.pdf") not in [r.path for r in everything.removed]


def test_a_changed_file_replaces_only_this_sources_older_version(tmp_path, small_model):
    pdf = write_pdf(tmp_path / "report.pdf", ["version from laptop 2"])
    db = tmp_path / "db"
    with Index(db, model=small_model, source="laptop-2") as other:
        other.add([pdf], progress=False)
    write_pdf(pdf, ["version here"])  # same path string, another file (another machine)
    with Index(db, model=small_model) as index:
        result = index.add([pdf], progress=False)
        assert result.added[0].reason == "" and len(index) == 2  # theirs is not "older"
        write_pdf(pdf, ["version here, edited"])
        again = index.add([pdf], progress=False)
        assert again.added[0].reason == "replaced an older version" and len(index) == 2
        assert {p["source"] for _, p in index.store.payloads()} == {"laptop-2", index.source}


# -------------------------------------------------------------------- 6. search never creates
def test_search_on_a_missing_index_says_so_and_creates_nothing(tmp_path, exported_tiny, capsys):
    db = tmp_path / "typo"
    for extra in ([], ["--model", str(exported_tiny.folder)]):
        assert main(["search", "q", "--db", str(db), *extra]) == 1
        assert "no index here" in capsys.readouterr().err
        assert not db.exists()
    with pytest.raises(IndexNotFoundError):
        Index(db, model=exported_tiny.folder, create=False)
    assert not db.exists()


# ------------------------------------------------------------------------------- 7. CLI edges
@pytest.mark.parametrize("k", ["-1", "0", "two"])
def test_search_k_must_be_positive(k, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["search", "q", "--db", "x", "-k", k])
    assert exited.value.code == 2 and "-k" in capsys.readouterr().err


def test_ray_takes_an_address_only_when_it_is_one():
    args = _parse(["index", "--ray", "docs", "--db", "x"])
    assert (args.ray, args.paths) == ("local", ["docs"])
    args = _parse(["index", "--ray", "auto", "docs", "--db", "x"])
    assert (args.ray, args.paths) == ("auto", ["docs"])
    args = _parse(["index", "docs", "--ray", "10.0.0.5:6379", "--db", "x"])
    assert (args.ray, args.paths) == ("10.0.0.5:6379", ["docs"])
    with pytest.raises(SystemExit) as exited:
        _parse(["index", "--ray", "auto", "--db", "x"])
    assert exited.value.code == 2


def test_usage_errors_exit_2_and_runtime_errors_1(tmp_path, capsys):
    assert main(["index", str(tmp_path), "--db", "a", "--qdrant-url", "http://x"]) == 2
    assert main(["index", str(tmp_path), "--db", "a", "--actors", "2"]) == 2
    capsys.readouterr()
    db = tmp_path / "db"
    db.mkdir()
    (db / "colembed_index.json").write_text("{ not json")
    assert main(["search", "q", "--db", str(db)]) == 1
    err = capsys.readouterr().err
    assert "colembed_index.json: the index's meta file is damaged" in err
    assert "Traceback" not in err


def test_an_unwritable_folder_is_a_clear_error(tmp_path, small_model, monkeypatch):
    real_open = os.open

    def refusing(path, *args, **kwargs):
        if str(path).endswith("colembed_index.lock"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)
    with pytest.raises(StoreError, match="cannot open the index's lock file .Permission denied"):
        Index(tmp_path / "db", model=small_model)


def test_batch_size_is_used_without_ray(tmp_path, exported_tiny, monkeypatch):
    seen = []
    model_type = type(colembed.load(exported_tiny.folder, max_image_tokens=TOKENS))
    real = model_type.embed_pages

    def embed_pages(self, images, *args, batch_size=None, **kwargs):
        seen.append(batch_size)
        return real(self, images, *args, batch_size=batch_size, **kwargs)

    monkeypatch.setattr(model_type, "embed_pages", embed_pages)
    pdf = write_pdf(tmp_path / "a.pdf", [str(n) for n in range(5)])
    assert (
        main(
            [
                "index",
                str(pdf),
                *quiet_index_flags(
                    tmp_path / "db", exported_tiny.folder, TOKENS, "--batch-size", "2"
                ),
            ]
        )
        == 0
    )
    assert set(seen) == {2}


def test_ctrl_c_stops_cleanly_keeps_the_pages_and_a_rerun_finishes(
    tmp_path, exported_tiny, small_model, monkeypatch, capsys
):
    docs = tmp_path / "docs"
    docs.mkdir()
    write_pdf(docs / "a.pdf", ["a 1", "a 2", "a 3"])
    write_pdf(docs / "b.pdf", ["b 1", "b 2"])
    model_type = type(colembed.load(exported_tiny.folder, max_image_tokens=TOKENS))
    real, calls = model_type.embed_pages, []

    def embed_pages(self, images, *args, **kwargs):
        calls.append(len(images))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, images, *args, **kwargs)

    monkeypatch.setattr(model_type, "embed_pages", embed_pages)
    common = quiet_index_flags(tmp_path / "db", exported_tiny.folder, TOKENS, "--batch-size", "1")
    assert main(["index", str(docs), *common]) == 130
    err = capsys.readouterr().err
    assert "resume by re-running" in err and "Traceback" not in err
    with Index(tmp_path / "db") as index:
        assert len(index) == 2
    monkeypatch.setattr(model_type, "embed_pages", real)
    assert main(["index", str(docs), *common]) == 0
    with Index(tmp_path / "db") as resumed, Index(tmp_path / "clean", model=small_model) as clean:
        clean.add([docs], progress=False)
        assert _contents(resumed) == _contents(clean)


# --------------------------------------------------------------------------- 9. crash windows
CREATE_THEN_DIE = textwrap.dedent("""
    import os, sys
    import qdrant_edge as qe
    from colembed.index import open_store

    real = qe.EdgeShard.create

    class Shard:  # Qdrant Edge creates the shard, then the process is killed
        @staticmethod
        def create(*args):
            real(*args)
            os._exit(9)

        load = qe.EdgeShard.load

    qe.EdgeShard = Shard
    open_store(sys.argv[1], dim=128)
""")


def test_a_kill_during_creation_leaves_a_folder_the_next_run_completes(tmp_path, small_model):
    db = tmp_path / "db"
    child = subprocess.run([sys.executable, "-c", CREATE_THEN_DIE, str(db)])
    assert child.returncode == 9 and (db / "shard").is_dir()
    assert not (db / "colembed_index.json").exists()
    with pytest.raises(IndexNotFoundError, match="interrupted creation"):
        Index(db, create=False)
    with Index(db, model=small_model) as index:
        assert index.add([write_pdf(tmp_path / "a.pdf", ["a"])], progress=False).ok
    with Index(db) as index:
        assert len(index) == 1


def test_a_kill_between_the_upgrade_renames_keeps_the_index(tmp_path, small_model):
    db = tmp_path / "db"
    with Index(db, model=small_model) as index:
        index.add([write_pdf(tmp_path / "a.pdf", ["a", "b"])], progress=False)
    os.rename(db, tmp_path / ".db.replaced-1-2")  # commit_folder's first rename, then the kill
    with Index(db, model=small_model) as index:
        assert len(index) == 2  # the old index is put back, not replaced by an empty one
    assert not list(tmp_path.glob(".db.replaced-*"))


def test_skipped_files_behind_a_partial_batch_are_written_as_they_go(
    tmp_path, small_model, monkeypatch
):
    from colembed.index.ingest import HELD_LIMIT

    docs = tmp_path / "docs"
    docs.mkdir()
    names = [f"f{n:03d}.pdf" for n in range(HELD_LIMIT + 8)]
    for name in names:
        write_pdf(docs / name, [name])
    with Index(tmp_path / "db", model=small_model) as index:
        index.add([docs], progress=False)
        write_pdf(docs / names[0], ["changed first"])
        write_pdf(docs / names[-1], ["changed last"])
        real, sizes = small_model.embed_pages, []

        def counting(images, *args, **kwargs):
            sizes.append(len(images))
            return real(images, *args, **kwargs)

        monkeypatch.setattr(small_model, "embed_pages", counting)
        result = index.add([docs], batch_size=4, progress=False)
        assert sizes == [1, 1]  # the first page did not wait for the last one's batch
        assert len(result.added) == 2 and len(result.skipped) == len(names) - 2


# ------------------------------------------------------------------------------ 10. folders
def test_symlinked_subfolders_are_followed_once(tmp_path, small_model):
    docs, outside = tmp_path / "docs", tmp_path / "outside"
    docs.mkdir()
    outside.mkdir()
    write_pdf(outside / "linked.pdf", ["linked"])
    write_pdf(docs / "here.pdf", ["here"])
    (docs / "link").symlink_to(outside, target_is_directory=True)
    (outside / "loop").symlink_to(docs, target_is_directory=True)  # a cycle back
    with Index(tmp_path / "db", model=small_model) as index:
        result = index.add([docs], progress=False)
        assert sorted(os.path.basename(r.path) for r in result.added) == ["here.pdf", "linked.pdf"]
        assert any("symlink" in r.reason for r in result.skipped)


def test_an_int8_index_is_searched_with_int8_without_being_told(
    tmp_path, exported_variants, capsys
):
    """The case as a user met it: `colembed index --variant int8`, then `colembed search` with no
    --model / --variant loaded fp32 and stopped with "variant: index has 'int8'"."""
    db, folder = tmp_path / "db", exported_variants.folder
    docs = write_pdf(tmp_path / "a.pdf", ["alpha", "beta"])
    assert (
        main(
            [
                "index",
                str(docs),
                "--db",
                str(db),
                "--model",
                str(folder),
                "--variant",
                "int8",
                "--max-image-tokens",
                str(TOKENS),
                "--quiet",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["search", "alpha", "--db", str(db), "-k", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["hits"][0]["file"] == str(docs)
    with Index(db) as index:
        assert (index.model.variant, index.model.max_image_tokens) == ("int8", TOKENS)
