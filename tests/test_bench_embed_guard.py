"""The release guard's own mechanics (benchmarks/embed_against.py, issue 25): what one timed
sample holds and when the other version's export is reused. No timing is asserted: the guard's
figures live in benchmarks/results/embed-against.md."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def guard():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import embed_against

        yield embed_against
    finally:
        sys.path.remove(str(BENCHMARKS))


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
    embedder.model.embed_queries = lambda texts, **kw: asked.append(list(texts)) or real(texts, **kw)
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
