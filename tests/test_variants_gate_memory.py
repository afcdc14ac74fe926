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

from colembed_export import evaluation as E
from colembed_export.recipes import VARIANTS


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
    half = {t.name: int(np.prod(t.dims)) for t in graph.initializer
            if t.data_type == onnx.TensorProto.FLOAT16}
    return sum(half.get(name, 0) for name in {i for n in graph.node if n.op_type in ("MatMul", "Gemm")
                                             for i in n.input})


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
        assert session.options.get_session_config_entry(
            "optimization.disable_specified_optimizers") == "FuseFp16InitializerToFp32NodeTransformer"
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
