"""The runtime's speed rules: how queries are grouped into runs, and when a run hands
the CPU arena's memory back. Their speed is measured in benchmarks/ (results/embed/embed-against.md);
these tests hold the decisions: an ordinary query batch is one run, a long query runs apart, and
only an unusually large query run shrinks the arena (page runs and ordinary runs never do)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import colembed
import colembed.model as runtime_model
from colembed.model import _length_groups

BIG = 10**12


def test_an_ordinary_query_batch_is_one_run():
    """16 report-style queries of 18-33 tokens: one padded run (grouping them by a padding
    ratio split them into several runs, each paying the fixed cost of a run)."""
    assert _length_groups(list(range(18, 34)), BIG) == [list(range(16))]
    assert _length_groups([25, 30, 19, 33, 22], BIG) == [[2, 4, 0, 1, 3]]


def test_a_long_query_runs_apart_and_the_budget_splits_groups():
    assert _length_groups([12, 13, 400, 12, 14], BIG) == [[0, 3, 1, 4], [2]]
    assert _length_groups([30] * 7 + [779], BIG) == [list(range(7)), [7]]
    assert _length_groups([], BIG) == [] and _length_groups([5], 1) == [[0]]
    assert _length_groups([100] * 5, max_cells=2 * 100**2) == [[0, 1], [2, 3], [4]]


def test_groups_are_the_least_cost_partition():
    """Against every split of the sorted lengths into consecutive runs (small enough to list)."""
    import itertools

    rng = np.random.default_rng(0)
    for _ in range(30):
        lengths = [int(x) for x in rng.integers(5, 400, int(rng.integers(1, 9)))]
        cells = int(rng.integers(400**2, 4 * 400**2))
        cost = lambda groups: sum(  # noqa: E731
            runtime_model.RUN_COST_TOKENS + len(g) * max(lengths[i] for i in g) for g in groups
        )
        got = _length_groups(lengths, cells)
        assert sorted(i for g in got for i in g) == list(range(len(lengths)))
        assert all(len(g) == 1 or len(g) * max(lengths[i] for i in g) ** 2 <= cells for g in got)
        order = sorted(range(len(lengths)), key=lengths.__getitem__)
        best = float("inf")
        for cuts in itertools.product([0, 1], repeat=len(order) - 1):
            groups, current = [], [order[0]]
            for flag, i in zip(cuts, order[1:]):
                if flag:
                    groups.append(current)
                    current = []
                current.append(i)
            groups.append(current)
            if all(
                len(g) == 1 or len(g) * max(lengths[i] for i in g) ** 2 <= cells for g in groups
            ):
                best = min(best, cost(groups))
        assert cost(got) == best


@pytest.fixture
def shrinking_runs(monkeypatch):
    """One (graph kind, shrinks the arena after it) per run, recorded at onnxruntime's API."""
    import onnxruntime as ort

    runs = []
    real_run = ort.InferenceSession.run

    def run(self, output_names, input_feed, run_options=None):
        shrinks = (
            run_options is not None
            and run_options.get_run_config_entry("memory.enable_memory_arena_shrinkage") == "cpu:0"
        )
        runs.append(("text" if "input_ids" in input_feed else "vision", shrinks))
        return real_run(self, output_names, input_feed, run_options)

    monkeypatch.setattr(ort.InferenceSession, "run", run)
    return runs


def test_only_an_unusually_large_query_run_shrinks_the_arena(
    exported_tiny, shrinking_runs, monkeypatch
):
    """Ordinary queries and pages run without the shrinking run options (shrinking after every
    run made each next run fault its memory in again); a query group whose attention scores
    exceed SHRINK_AFTER_QUERY_BYTES passes them."""
    from PIL import Image

    model = colembed.load(exported_tiny.folder)
    model.embed_queries(["net income", "What was the total revenue in the third quarter?"])
    model.embed_images([Image.new("RGB", (200, 300), "white")])
    assert {kind for kind, _ in shrinking_runs} == {"text", "vision"}
    assert not any(shrinks for _, shrinks in shrinking_runs)

    heads = model.manifest.architecture.text_heads
    long = "revenue " * 200
    tokens = len(model.text_encoder.encode_queries([long])[0])
    # the threshold just below one long query's scores: its run shrinks, a short one's not
    monkeypatch.setattr(runtime_model, "SHRINK_AFTER_QUERY_BYTES", heads * 4 * tokens**2 - 1)
    shrinking_runs.clear()
    model.embed_queries([long])
    model.embed_queries(["net income"])
    assert shrinking_runs == [("text", True), ("text", False)]


def test_no_shrinking_without_the_arena(exported_tiny, shrinking_runs, monkeypatch):
    monkeypatch.setattr(runtime_model, "SHRINK_AFTER_QUERY_BYTES", 0)
    colembed.load(exported_tiny.folder, cpu_mem_arena=False).embed_queries(["long " * 300])
    assert shrinking_runs == [("text", False)]


def test_results_do_not_depend_on_the_grouping(exported_tiny):
    model = colembed.load(exported_tiny.folder)
    queries = ["short one", "another short query", "long " * 300, "tiny", "a medium query here"]
    alone = [model.embed_queries([q])[0] for q in queries]
    for got, want in zip(model.embed_queries(queries, batch_size=5), alone):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_threads_spin_within_a_run_and_not_between_runs():
    """The intra-op threads may spin inside a run (each parallel section of a short int8 query
    would otherwise wait on a woken thread) but stop when the run returns
    (`session.force_spinning_stop`): a session left alone after a run burns no CPU while the host
    does its own work. The rule is the session's configuration, checked here on a real session
    that runs; the CPU it saves is measured by `python -m benchmarks.spin`, on the same graph."""
    import onnx
    from onnx import numpy_helper

    from benchmarks.spin import matmul_graph
    from colembed.sessions import RUN_THREAD_CONFIG, Session

    blob = matmul_graph()
    weight = numpy_helper.to_array(onnx.load_from_string(blob).graph.initializer[0])
    assert dict(RUN_THREAD_CONFIG) == {
        "session.intra_op.allow_spinning": "1",
        "session.force_spinning_stop": "1",
    }
    session = Session(blob, threads=2)
    config = session.options.get_session_config_entry
    assert config("session.intra_op.allow_spinning") == "1"
    assert config("session.force_spinning_stop") == "1"
    x = np.ones((256, 512), np.float32)
    want = np.einsum("ij,jk->ik", x, weight, optimize=False)
    for _ in range(3):
        np.testing.assert_allclose(session.run({"x": x})[0], want, rtol=1e-4, atol=1e-3)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_sessions_start_no_more_threads_than_the_cpus_allowed(exported_tiny):
    """A process pinned to one CPU (taskset, a container's cpuset) gets one intra-op thread, not
    one per physical core of the machine."""
    from colembed.sessions import physical_cores

    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        assert physical_cores() == 1
        model = colembed.load(exported_tiny.folder)
        assert model._preprocess_threads == 1
    finally:
        os.sched_setaffinity(0, before)
    assert 1 <= physical_cores() <= len(before)
