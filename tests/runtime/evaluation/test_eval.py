"""`colembed eval`: the metric functions on hand-made rankings, and whole runs on small labelled
sets written here (BEIR-style and ViDoRe / MTEB Parquet) with the tiny random-weight model.

Random weights rank pages arbitrarily, so a run's expected figures are computed by hand (the
formulas written out below, not the module's functions) from the rankings the run's own index
folders return when searched again.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from colembed.cli import main
from colembed.evaluation.labelled import LabelledSetError, read_labelled_set
from colembed.evaluation.metrics import mrr_at_k, ndcg_at_k, overlap_at_k, recall_at_k
from colembed.evaluation.run import evaluate
from colembed.index import Index
from tests.fixtures.images import rgb
from tests.fixtures.documents import write_pdf

TOKENS = 64
LOG3 = math.log2(3)


# ------------------------------------------------------------------------------------ metrics
def test_graded_ndcg_recall_and_mrr_of_a_hand_made_ranking():
    labels = {"a": 3, "b": 2, "c": 0, "d": 1}
    ranking = ["c", "a", "x", "d", "b"]  # "x" is not judged: grade 0
    # DCG@3 = 0/1 + 3/log2(3) + 0/2; ideal: 3/1 + 2/log2(3) + 1/2
    assert ndcg_at_k(ranking, labels, 3) == pytest.approx(0.39748952229168844)
    assert recall_at_k(ranking, labels, 3) == pytest.approx(1 / 3)
    assert mrr_at_k(ranking, labels, 3) == 0.5
    assert recall_at_k(ranking, labels, 5) == 1.0
    assert ndcg_at_k(["a", "b", "d"], labels, 3) == pytest.approx(1.0)


def test_ties_duplicates_and_absent_documents():
    equal = {"a": 1, "b": 1}
    assert ndcg_at_k(["b", "a"], equal, 2) == pytest.approx(1.0)  # either order is ideal
    assert ndcg_at_k(["x", "a"], equal, 2) == pytest.approx(0.38685280723454163)
    assert ndcg_at_k(["a", "a", "b"], {"a": 3, "b": 2}, 2) == pytest.approx(1.0)  # counted once
    assert recall_at_k(["a", "a"], equal, 2) == 0.5
    assert ndcg_at_k([], equal, 5) == recall_at_k([], equal, 5) == mrr_at_k([], equal, 5) == 0.0
    assert mrr_at_k(["x", "y", "b"], equal, 2) == 0.0  # the relevant page is below the cut
    with pytest.raises(ValueError, match="no relevant"):
        ndcg_at_k(["a"], {"a": 0}, 1)
    with pytest.raises(ValueError, match="k must be"):
        recall_at_k(["a"], equal, 0)
    assert overlap_at_k(["a", "b", "c"], ["c", "d", "a"], 3) == pytest.approx(2 / 3)
    assert overlap_at_k([], [], 3) == 1.0


@given(
    st.lists(st.sampled_from("abcdefgh"), max_size=10),
    st.dictionaries(st.sampled_from("abcdefgh"), st.integers(0, 3), min_size=1),
    st.integers(1, 10),
)
def test_metrics_stay_in_range_and_the_ideal_ranking_scores_one(ranking, labels, k):
    if not any(labels.values()):
        return
    for metric in (ndcg_at_k, recall_at_k, mrr_at_k):
        assert 0.0 <= metric(ranking, labels, k) <= 1.0 + 1e-12
    ideal = sorted(labels, key=lambda d: -labels[d])
    assert ndcg_at_k(ideal, labels, k) == pytest.approx(1.0)


# ------------------------------------------------------------------------------- labelled sets
IMAGES = {"alpha": 1, "beta": 2, "gamma": 3, "delta": 4}
QUERIES = {
    "q1": "first question",
    "q2": "second question",
    "q3": "third question",
    "q4": "a query without a relevant page",
}
QRELS = [
    ("q1", "alpha", 2),
    ("q1", "report#2", 1),
    ("q2", "beta", 1),
    ("q2", "gamma", 0),
    ("q3", "delta", 1),
    ("q3", "missing-page", 2),
    ("q4", "alpha", 0),
]


def png(seed: int) -> bytes:
    buffer = io.BytesIO()
    rgb(160, 120, seed=seed).save(buffer, format="PNG")
    return buffer.getvalue()


def write_beir(root: Path, with_pdf: bool = True) -> Path:
    (root / "corpus").mkdir(parents=True)
    (root / "qrels").mkdir()
    for name, seed in IMAGES.items():
        (root / "corpus" / f"{name}.png").write_bytes(png(seed))
    if with_pdf:
        write_pdf(root / "corpus" / "report.pdf", ["report page one", "report page two"])
    (root / "queries.jsonl").write_text(
        "".join(json.dumps({"_id": q, "text": t}) + "\n" for q, t in QUERIES.items())
    )
    rels = [r for r in QRELS if with_pdf or "#" not in r[1]]
    (root / "qrels" / "test.tsv").write_text(
        "query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{c}\t{s}\n" for q, c, s in rels)
    )
    return root


def write_parquet_set(root: Path, spelling: str) -> Path:
    qid, cid = f"query{spelling}id", f"corpus{spelling}id"
    for part in ("corpus", "queries", "qrels"):
        (root / part).mkdir(parents=True)
    pq.write_table(
        pa.table(
            {
                cid: list(IMAGES),
                "image": [
                    {"bytes": png(seed), "path": f"{name}.png"} for name, seed in IMAGES.items()
                ],
            }
        ),
        root / "corpus" / "test-00000-of-00001.parquet",
    )
    pq.write_table(
        pa.table({qid: list(QUERIES), "query": list(QUERIES.values())}),
        root / "queries" / "test-00000-of-00001.parquet",
    )
    rels = [r for r in QRELS if "#" not in r[1]]
    pq.write_table(
        pa.table(
            {qid: [r[0] for r in rels], cid: [r[1] for r in rels], "score": [r[2] for r in rels]}
        ),
        root / "qrels" / "test-00000-of-00001.parquet",
    )
    return root


def hand_ndcg(ranked: list[str], labels: dict[str, int], k: int) -> float:
    gains = [labels.get(doc, 0) for doc in ranked[:k]]
    found = sum(g / math.log2(i + 2) for i, g in enumerate(gains))
    best = sorted((g for g in labels.values() if g > 0), reverse=True)[:k]
    return found / sum(g / math.log2(i + 2) for i, g in enumerate(best))


def ids_of(hits) -> list[str]:
    """The documented rule: a one-page file's id is its name without extension, `<name>#<page>`
    for a page of a longer file."""
    return [
        Path(h.file).stem + (f"#{h.page}" if Path(h.file).suffix == ".pdf" else "") for h in hits
    ]


def test_a_beir_run_gives_the_hand_computed_figures(tmp_path, exported_tiny):
    dataset = write_beir(tmp_path / "set")
    work = tmp_path / "work"
    k = 3
    report = evaluate(
        dataset,
        str(exported_tiny.folder),
        budgets=[TOKENS, 32],
        modes=["exact", "two-stage", "hybrid"],
        k=k,
        work=work,
    )
    assert (report.queries, report.skipped_queries, report.corpus_pages, report.unknown_labels) == (
        3,
        1,
        6,
        1,
    )
    rows = {(r.max_image_tokens, r.mode): r for r in report.rows}
    assert list(rows) == [
        (TOKENS, "exact"),
        (TOKENS, "two-stage"),
        (TOKENS, "hybrid"),
        (32, "exact"),
        (32, "two-stage"),
        (32, "hybrid"),
    ]
    assert report.rows[0].reference and (report.rows[0].top1_agreement, report.rows[0].overlap) == (
        1.0,
        1.0,
    )
    labels = {
        "q1": {"alpha": 2, "report#2": 1},
        "q2": {"beta": 1, "gamma": 0},
        "q3": {"delta": 1, "missing-page": 2},
    }
    check_hand_figures(report, labels, k)
    for budget in (TOKENS, 32):  # the exact rankings are what the run's index folders return
        with Index(work / f"index-fp32-{budget}", create=False) as index:
            assert len(index) == 6
            found = index.search([QUERIES[q] for q in labels], k=k, mode="exact")
            assert report.rankings[f"fp32 / {budget} tokens / exact"] == {
                q: ids_of(hits) for q, hits in zip(labels, found)
            }
    # a second run on the same work folder reuses its indexes (nothing embedded again)
    again = evaluate(
        dataset, str(exported_tiny.folder), budgets=[TOKENS, 32], modes=["exact"], k=k, work=work
    )
    assert again.rows[0] == report.rows[0]


def check_hand_figures(report, labels: dict[str, dict[str, int]], k: int) -> None:
    """Each row's figures, computed by hand from the rankings the run's searches returned (the
    tiny model's pages tie, so two-stage and hybrid order them arbitrarily: read them back)."""
    n = len(labels)
    reference = report.rankings[
        report.rows[0].variant + " / " + str(report.rows[0].max_image_tokens) + " tokens / exact"
    ]
    relevant = {q: {d for d, g in labels[q].items() if g > 0} for q in labels}
    for row in report.rows:
        ranked = report.rankings[f"{row.variant} / {row.max_image_tokens} tokens / {row.mode}"]
        assert set(ranked) == set(labels) and all(len(r) == k for r in ranked.values())
        assert row.ndcg == pytest.approx(
            sum(hand_ndcg(ranked[q], labels[q], k) for q in labels) / n
        )
        assert row.recall == pytest.approx(
            sum(len(set(ranked[q][:k]) & relevant[q]) / len(relevant[q]) for q in labels) / n
        )
        assert row.mrr == pytest.approx(
            sum(
                next((1 / r for r, d in enumerate(ranked[q][:k], 1) if d in relevant[q]), 0.0)
                for q in labels
            )
            / n
        )
        assert row.top1_agreement == pytest.approx(
            sum(ranked[q][0] == reference[q][0] for q in labels) / n
        )
        assert row.overlap == pytest.approx(
            sum(len(set(ranked[q]) & set(reference[q])) / k for q in labels) / n
        )


@pytest.mark.parametrize("spelling", ["-", "_"])  # ViDoRe v2 / MTEB, ViDoRe v3
def test_a_parquet_set_is_scored_by_its_corpus_ids(tmp_path, exported_tiny, spelling):
    work = tmp_path / "work"
    report = evaluate(
        write_parquet_set(tmp_path / "vidore", spelling),
        str(exported_tiny.folder),
        budgets=[TOKENS],
        modes=["exact", "two-stage"],
        k=2,
        work=work,
    )
    assert (report.corpus_pages, report.queries, report.unknown_labels) == (4, 3, 1)
    labels = {
        "q1": {"alpha": 2},
        "q2": {"beta": 1, "gamma": 0},
        "q3": {"delta": 1, "missing-page": 2},
    }
    check_hand_figures(report, labels, 2)
    # the images were written in row order, each page named by its row: ids are the rows' ids
    row_id = {f"page-{n:06d}": cid for n, cid in enumerate(IMAGES, 1)}
    with Index(work / f"index-fp32-{TOKENS}", create=False) as index:
        found = index.search([QUERIES[q] for q in labels], k=2, mode="exact")
    assert report.rankings[f"fp32 / {TOKENS} tokens / exact"] == {
        q: [row_id[Path(h.file).stem] for h in hits] for q, hits in zip(labels, found)
    }


def test_the_command_prints_the_table_and_json(tmp_path, exported_tiny, capsys):
    dataset = write_beir(tmp_path / "set", with_pdf=False)
    args = [
        "eval",
        str(dataset),
        "--model",
        str(exported_tiny.folder),
        "--max-image-tokens",
        str(TOKENS),
        "--mode",
        "exact",
        "--mode",
        "two-stage",
        "-k",
        "2",
    ]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["mode"] for r in out["rows"]] == ["exact", "two-stage"] and out["k"] == 2
    assert main(args + ["--quiet"]) == 0
    text = capsys.readouterr().out
    assert "nDCG@2" in text and "top-1 = fp32 exact" in text and "(reference)" in text


# ----------------------------------------------------------------------------------- refusals
def test_bad_inputs_are_refused_naming_file_row_and_column(tmp_path):
    dataset = write_beir(tmp_path / "set", with_pdf=False)
    qrels = dataset / "qrels" / "test.tsv"
    qrels.write_text("query-id\tcorpus-id\tscore\nq1\talpha\t1\nq2\tbeta\n")
    with pytest.raises(LabelledSetError, match=r"test\.tsv row 3: 2 columns"):
        read_labelled_set(dataset)
    qrels.write_text("query-id\tcorpus-id\tscore\nq1\talpha\tnan\n")
    with pytest.raises(LabelledSetError, match=r"row 2: column 'score'"):
        read_labelled_set(dataset)
    (dataset / "queries.jsonl").write_text('{"_id": "q1", "text": "x"}\n{"_id": "q2"}\n')
    with pytest.raises(LabelledSetError, match=r"queries\.jsonl line 2: column 'text'"):
        read_labelled_set(dataset)

    jsonl = write_beir(tmp_path / "jsonl", with_pdf=False)
    (jsonl / "corpus.jsonl").write_text('{"_id": "alpha", "file": "corpus/alpha.png", "page": 0}\n')
    with pytest.raises(LabelledSetError, match=r"corpus\.jsonl line 1: column 'page'"):
        read_labelled_set(jsonl)

    vidore = write_parquet_set(tmp_path / "vidore", "-")
    pq.write_table(
        pa.table({"query-id": ["q1"], "text": ["x"]}),
        vidore / "queries" / "test-00000-of-00001.parquet",
    )
    with pytest.raises(LabelledSetError, match=r"queries.*parquet: no column 'query'"):
        read_labelled_set(vidore)
    with pytest.raises(LabelledSetError, match="neither a BEIR-style"):
        read_labelled_set(tmp_path)


def test_an_image_column_that_is_no_image_is_named(tmp_path, exported_tiny):
    vidore = write_parquet_set(tmp_path / "vidore", "_")
    pq.write_table(
        pa.table({"corpus_id": ["alpha"], "image": [{"bytes": b"not an image", "path": "a.png"}]}),
        vidore / "corpus" / "test-00000-of-00001.parquet",
    )
    with pytest.raises(LabelledSetError, match=r"corpus.*parquet row 1: column 'image'"):
        evaluate(vidore, str(exported_tiny.folder), modes=["exact"])


def test_a_work_folder_the_run_does_not_own_is_refused_and_left_alone(tmp_path, exported_tiny):
    dataset = write_beir(tmp_path / "set", with_pdf=False)
    work = tmp_path / "mine"
    work.mkdir()
    (work / "notes.txt").write_text("keep me")
    with pytest.raises(LabelledSetError, match="not made by colembed eval"):
        evaluate(dataset, str(exported_tiny.folder), modes=["exact"], work=work)
    assert [p.name for p in work.iterdir()] == ["notes.txt"]
    (dataset / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq9\talpha\t1\n")
    with pytest.raises(LabelledSetError, match="query id 'q9'"):
        evaluate(dataset, str(exported_tiny.folder), modes=["exact"])
