"""The release guard's own mechanics (benchmarks/embed/against.py): what one timed
sample holds and when this version's and the other version's exports are reused. No timing is
asserted: the guard's figures live in benchmarks/results/embed/embed-against.md."""

from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

import pytest


@pytest.fixture(scope="module")
def guard():
    from benchmarks.embed import against

    return against


def test_a_sample_holds_at_least_the_least_work(guard):
    """A 30 ms query on the fastest side: one pass of 16 calls is 0.48 s, so two passes make a
    sample; a page of seconds is one call; a failed warm-up time still gives one repeat."""
    assert guard.sample_repeats(0.030 * 16) == 2
    assert guard.sample_repeats(0.34) == 2
    assert guard.sample_repeats(0.5) == 1
    assert guard.sample_repeats(8.0) == 1
    assert guard.sample_repeats(0.0) == 1
    assert guard.sample_repeats(0.1, least_s=1.0) == 10


def test_one_query_sample_runs_every_query_once_per_pass(guard, exported_tiny):
    """The "1 query" item is `repeats` passes over the 16 queries, one single-query call each
    (the old guard took the mean of 4 calls whatever their length)."""
    embedder = guard._Embedder()
    embedder.load("colembed", variant="fp32", folder=str(exported_tiny.folder), threads=1)
    asked = []
    real = embedder.model.embed_queries
    embedder.model.embed_queries = lambda texts, **kw: asked.append(list(texts)) or real(
        texts, **kw
    )
    got = embedder.time("q1", repeats=2)
    assert got["calls"] == 2 * guard.SINGLE_QUERIES == len(asked)
    assert all(len(texts) == 1 for texts in asked)
    assert [t[0] for t in asked] == [q for q in guard.QUERIES[:16]] * 2
    assert got["s"] > 0
    assert embedder.time("q16", repeats=3)["calls"] == 3
    with pytest.raises(ValueError, match="unknown item"):
        embedder.time("q2")


def test_the_other_versions_export_is_reused(guard, tmp_path, monkeypatch):
    """A folder that holds a finished export (its colembed_manifest.json) is not exported again
    (the old check looked for "manifest.json", which no version writes, and re-exported every
    run)."""
    from colembed.layout import MANIFEST_NAME

    done = tmp_path / "model-ref"
    done.mkdir()
    (done / MANIFEST_NAME).write_text("{}")

    def refuse(*args, **kwargs):
        raise AssertionError(f"exported again: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)
    assert guard.ref_export(tmp_path, tmp_path / "ckpt", done, progress=print) == done
    with pytest.raises(AssertionError, match="exported again"):
        guard.ref_export(tmp_path, tmp_path / "ckpt", tmp_path / "model-new", progress=print)


def test_an_export_is_reused_only_by_the_exporter_source_that_wrote_it(
    guard, tmp_path, monkeypatch
):
    """This checkout's export in --workdir (embed_models.EXPORTER_STAMP) is reused only when the
    exporter source that wrote it is the one running now: an A/B of an exporter change must time
    the new graphs, not whatever a previous checkout left there. The export itself is replaced by
    a recorder (a 2B-width export takes minutes); what is checked is the reuse decision."""
    import colembed_export.pipeline.exporter as exporter
    from benchmarks.shared import embed_models

    exports = []

    def record(ckpt, folder, *, overwrite, variants, int8_weight_passes, progress):
        assert int8_weight_passes is None  # the exporter's own int8 fallback unless forced
        # the real exporter refuses to replace a folder holding anything it did not write
        assert not folder.exists() or [p.name for p in folder.iterdir()] == [
            embed_models.MANIFEST_NAME
        ], "the bench left a foreign file in the export folder"
        exports.append(list(variants))
        folder.mkdir(exist_ok=True)
        manifest = {"variants": {v: {} for v in ["fp32", *variants]}}
        (folder / embed_models.MANIFEST_NAME).write_text(json.dumps(manifest))

    monkeypatch.setattr(exporter, "export_model", record)
    args = SimpleNamespace(
        family="colqwen2", vision_depth=1, text_layers=1, variants=["fp32", "int8"]
    )
    tag = "2b-v1-t1"
    ckpt = tmp_path / f"ckpt-{tag}"
    ckpt.mkdir()
    (ckpt / "colembed_tiny.json").write_text("{}")  # the checkpoint counts as built
    said = []

    embed_models.prepare_model(args, tmp_path, said.append)
    embed_models.prepare_model(args, tmp_path, said.append)
    assert exports == [["int8"]]  # the same source: the folder is reused

    stamp = embed_models.exporter_stamp(tmp_path / f"model-{tag}")
    assert stamp.read_text() == embed_models.exporter_fingerprint()
    stamp.write_text("another exporter")
    embed_models.prepare_model(args, tmp_path, said.append)
    assert exports == [["int8"], ["int8"]]
    assert any("re-exporting" in line for line in said)
    stamp.unlink()  # a folder from before the stamp existed counts as another source
    embed_models.prepare_model(args, tmp_path, said.append)
    assert len(exports) == 3
