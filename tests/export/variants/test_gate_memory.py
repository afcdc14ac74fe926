"""The variant gate's memory: an fp16 gate session keeps its weights fp16, with the same verdicts.

onnxruntime's CPU provider has no fp16 MatMul: it casts the fp16 weights to fp32 around each
MatMul and, by default, folds every cast weight into a new fp32 initializer at load, so an fp16
session held the fp32 weights' size (the full-size gate's fp16 run: 1.63x the fp32 weights).
The gate loads fp16 with that fold off (evaluation.GATE_SESSION_CONFIG); the values its MatMuls
see are the same (docs/variants.md, "The variant step's memory").
"""

from __future__ import annotations

import collections

import numpy as np
import onnx

from colembed_export.variants import gates as E
from colembed_export.variants.recipes import VARIANTS


def _initializer_elements(path) -> dict[str, int]:
    """{data type name: elements} over the graph's initializers."""
    found: collections.Counter = collections.Counter()
    for tensor in onnx.load(str(path), load_external_data=False).graph.initializer:
        found[onnx.TensorProto.DataType.Name(tensor.data_type)] += int(np.prod(tensor.dims))
    return dict(found)


def _fp16_matmul_weight_elements(path) -> int:
    """Elements of the fp16 initializers that MatMuls read (the token-embedding table, read by a
    Gather, stays fp16 either way: the CPU provider has an fp16 Gather)."""
    graph = onnx.load(str(path), load_external_data=False).graph
    half = {
        t.name: int(np.prod(t.dims))
        for t in graph.initializer
        if t.data_type == onnx.TensorProto.FLOAT16
    }
    return sum(
        half.get(name, 0)
        for name in {i for n in graph.node if n.op_type in ("MatMul", "Gemm") for i in n.input}
    )


def test_fp16_gate_session_keeps_its_weights_fp16(exported_variants, tmp_path):
    """The session as onnxruntime optimised it: with the gate's config the fp16 weights are still
    fp16 initializers (cast per run); with the defaults they became fp32 copies. A misspelt
    optimizer name would leave the default's fp32 copies, and this fails."""
    from colembed.sessions import Session

    graph = exported_variants.folder / exported_variants.manifest.graph("fp16", "text").file
    held = {}
    for arm, config in (("default", None), ("gate", E.GATE_SESSION_CONFIG["fp16"])):
        saved = tmp_path / f"{arm}.onnx"
        Session(graph, cpu_mem_arena=False, session_config=config, save_optimized=saved)
        held[arm] = _initializer_elements(saved)
    source = _initializer_elements(graph)
    weights = _fp16_matmul_weight_elements(graph)
    assert weights > 0
    # the defaults: every fp16 MatMul weight became an fp32 copy, the fp16 one gone
    assert held["default"]["FLOAT"] - source["FLOAT"] >= weights
    assert source["FLOAT16"] - held["default"]["FLOAT16"] >= weights
    # the gate's: every fp16 weight still fp16, no fp32 copy of any
    assert held["gate"]["FLOAT16"] >= source["FLOAT16"]
    assert held["gate"]["FLOAT"] - source["FLOAT"] < weights / 100  # a few folded constants


def test_gate_session_config_reaches_both_sessions(exported_variants):
    model = E.gate_model(exported_variants.folder, "fp16")
    for session in model._sessions.values():
        assert (
            session.options.get_session_config_entry("optimization.disable_specified_optimizers")
            == "FuseFp16InitializerToFp32NodeTransformer"
        )
        assert not session.options.enable_cpu_mem_arena


def test_fp16_verdicts_and_figures_are_the_same_either_way(exported_variants, monkeypatch):
    """The gate's figures on the fp16 variant with its weights kept fp16 equal those with the
    fold (the same values reach every MatMul; fusions may sum in another order: 1e-6)."""
    folder, gates = exported_variants.folder, {"fp16": VARIANTS["fp16"].gate}
    mapped = []
    monkeypatch.setattr(E, "map_large_blocks", lambda: mapped.append(True) or True)
    kept, kept_misses = E.evaluate_variants(folder, ["fp16"], gates)
    assert mapped  # the gate maps its large blocks before its first model
    monkeypatch.setattr(E, "GATE_SESSION_CONFIG", {})
    folded, folded_misses = E.evaluate_variants(folder, ["fp16"], gates)
    assert kept_misses == folded_misses
    a, b = kept["fp16"], folded["fp16"]
    assert abs(a["mean_cosine"] - b["mean_cosine"]) < 1e-6
    assert abs(a["min_cosine"] - b["min_cosine"]) < 1e-6
    assert a["buckets"].keys() == b["buckets"].keys()
    for bucket, row in a["buckets"].items():
        assert abs(row["mean"] - b["buckets"][bucket]["mean"]) < 1e-6
        assert abs(row["min"] - b["buckets"][bucket]["min"]) < 1e-6
    assert a["ranking"] == b["ranking"]


def test_large_blocks_mapped_where_glibc_is():
    """mallopt(M_MMAP_THRESHOLD) takes on glibc (this machine, the Linux wheels); elsewhere the
    call reports False and changes nothing."""
    import platform
    import sys

    got = E.map_large_blocks()
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        assert got is True
    else:
        assert got is False


def _weight_cast_liveness(graph_path, tmp_path, order: str, feeds) -> tuple[int, int]:
    """(fp32 bytes of every weight cast, the most of them alive at once) when the gate's fp16
    session runs `feeds` with onnxruntime's `order`: the casts and their readers from the graph
    as onnxruntime optimised it, their run order from its profile."""
    import json

    from colembed.sessions import Session

    saved = tmp_path / f"{order}.onnx"
    config = E.GATE_SESSION_CONFIG["fp16"]
    Session(
        graph_path,
        threads=1,
        cpu_mem_arena=False,
        session_config=config,
        save_optimized=saved,
        execution_order=order,
    )
    graph = onnx.load(str(saved), load_external_data=False).graph
    half = {
        t.name: int(np.prod(t.dims))
        for t in graph.initializer
        if t.data_type == onnx.TensorProto.FLOAT16
    }
    casts = {
        n.output[0]: (n.name, half[n.input[0]] * 4)
        for n in graph.node
        if n.op_type == "Cast" and n.input[0] in half
    }
    readers = collections.defaultdict(list)
    for node in graph.node:
        for name in node.input:
            if name in casts:
                readers[name].append(node.name)
    session = Session(
        graph_path,
        threads=1,
        cpu_mem_arena=False,
        session_config=config,
        profile_prefix=str(tmp_path / order),
        execution_order=order,
    )
    session.run(feeds)
    events = json.load(open(session.session.end_profiling()))
    ran = [
        e["name"].removesuffix("_kernel_time")
        for e in events
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
    ]
    at = {name: i for i, name in enumerate(ran)}
    spans = [
        (at[cast], max(at[r] for r in readers[out]), size) for out, (cast, size) in casts.items()
    ]
    alive = max(
        sum(size for start, end, size in spans if start <= t <= end) for t in range(len(ran))
    )
    return sum(size for *_, size in spans), alive


def test_fp16_gate_casts_each_weight_next_to_its_matmul(exported_variants, tmp_path):
    """With its weights kept fp16, the gate's fp16 text session casts each weight to fp32 just
    before the MatMul that reads it (onnxruntime's priority-based order), not most of them at the
    start of a run as its default order does: at most two weights' fp32 casts alive at once."""
    model = E.gate_model(exported_variants.folder, "fp16")
    recorded = E.recording_feeds(model)
    model.embed_queries(["which table lists the quarterly figures?"])
    graph = exported_variants.folder / exported_variants.manifest.graph("fp16", "text").file
    total, gate = _weight_cast_liveness(
        graph, tmp_path, E.GATE_EXECUTION_ORDER["fp16"], recorded["text"][0]
    )
    _, default = _weight_cast_liveness(graph, tmp_path, "default", recorded["text"][0])
    assert total > 0
    assert default > total / 2  # what the full-size fp16 gate set paid for (1.19x the weights)
    assert gate <= total / 4


def test_the_gate_order_computes_the_same_vectors_bit_for_bit(exported_variants):
    """onnxruntime's node order changes when a node runs, not what it computes: the gate's fp16
    model gives the vectors of the same session in the default order, bit for bit."""
    import colembed
    from tests.fixtures.images import rgb

    pages = [rgb(300, 420, seed=1), rgb(20, 20, seed=2)]
    queries = ["invoice", "which table lists the quarterly figures for each product line?"]
    got = {}
    for order in ("default", E.GATE_EXECUTION_ORDER["fp16"]):
        model = colembed.load(
            exported_variants.folder,
            variant="fp16",
            **E.GATE_LOAD,
            session_config=E.GATE_SESSION_CONFIG["fp16"],
            execution_order=order,
        )
        got[order] = [*model.embed_images(pages), *model.embed_queries(queries)]
    for a, b in zip(*got.values()):
        assert a.dtype == b.dtype and np.array_equal(a, b)
