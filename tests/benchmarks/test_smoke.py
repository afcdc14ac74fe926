"""The index suite's jobs (benchmarks/index/) run end to end at a few pages and its tables are written from what they
return, so a helper moved between benchmarks/ modules, or a figure renamed on one side only, fails
here rather than at the end of an hour-long run. No timing is checked (speed lives in results/);
what is checked is that each job's result carries what the report reads, and the quality figures
a search plan must reach on a store this small (every plan finds the needle among 8 pages)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def bench():
    """The index suite's store jobs, ingest job and report (benchmarks.index)."""
    from benchmarks.index import ingest, report, stores

    return stores, ingest, report


def test_the_store_jobs_feed_the_report(bench, tmp_path, monkeypatch):
    """Every Edge plan on the local-answer set (local_answer.py over synthetic_pages.py's rows),
    and the numpy scorer on the page-wide set (synthetic_pages.py), in one table."""
    stores, _, report = bench
    data = "local"
    from benchmarks.shared.common import machine_info

    monkeypatch.setattr(stores, "NEEDLE_QUERIES", 4)  # a smoke run: few queries, few rounds
    monkeypatch.setattr(stores, "QUERY_ROUNDS", {1000: (2, 1)})
    pages, folder = 8, tmp_path / "edge"
    build = stores.worker_build("edge", pages, folder, data)
    assert build["insert_s"] > 0 and build["disk_mib"] > 0
    by_backend = {
        b: {**build, **stores.worker_query(b, pages, folder, data)} for b in stores.EDGE_BACKENDS
    }
    quality = by_backend["edge-two-stage"]
    # a new folder (schema 3) has no rows / cols: the plans reading them are skipped
    ran = {b for b in stores.EDGE_BACKENDS if b not in ("edge-mean-gated", "edge-previous")}
    assert quality["needle_at_10"] == {b: 1.0 for b in ran}
    assert quality["score_max_abs_diff_vs_numpy"] < 1e-2  # float16 storage
    by_backend["numpy"] = stores.worker_numpy(pages)
    table = report.markdown(
        {
            "machine": machine_info(),
            "load_before": [0.0],
            "load_after": [0.0],
            "stores": {f"{data}:{pages}": by_backend},
            "ingest": {},
        }
    )
    for backend in by_backend:
        assert f"| {backend} |" in table
    assert f"## {pages:,} pages, {data} set" in table


def test_the_ingest_job_feeds_the_report(bench, tmp_path, exported_tiny, monkeypatch):
    _, ingest, report = bench
    label, _, _ = ingest.INGEST_MODELS["tiny"]
    monkeypatch.setitem(ingest.INGEST_MODELS, "tiny", (label, 2, 2))  # 4 pages, one round
    monkeypatch.setattr(ingest, "INGEST_ROUNDS", 1)
    result = ingest.bench_ingest("tiny", exported_tiny.folder, tmp_path)
    assert result["pages"] == 4 and 0 < result["bound"] <= 1
    assert set(result["ms_per_page"]) == {"hash", "render", "store", "embed", "index"}
    table = "\n".join(report.ingest_markdown("tiny", result))
    assert "`Index.add` (all of it, pipelined)" in table and "Bound" in table


def test_a_result_note_shows_the_module_form_of_its_command():
    """`python -m benchmarks.x` leaves x's file path in argv[0]; the note shows `-m benchmarks.x`,
    which runs from any checkout."""
    from pathlib import Path

    from benchmarks.shared.machine import _as_module

    root = Path(__file__).resolve().parents[2] / "benchmarks"
    assert _as_module([str(root / "export" / "streamed.py"), "--runs", "a b"]) == [
        "-m",
        "benchmarks.export.streamed",
        "--runs",
        "a b",
    ]
    assert _as_module([str(root / "embed" / "__main__.py"), "--full"]) == [
        "-m",
        "benchmarks.embed",
        "--full",
    ]
    assert _as_module(["/elsewhere/tool.py", "x"]) == ["/elsewhere/tool.py", "x"]
