"""Variants on the stress checkpoint (trained-model activation traits, export/testing/tiny_qwen2.py): one export
with all three variants serves the module. Apart from test_variants.py so that the two exports can
run on different xdist workers."""

from __future__ import annotations

import json

import pytest

from colembed_export.variants import gates as E
from colembed_export.graphs import edits as G
from colembed_export.variants import write as V

pytestmark = pytest.mark.heavy("stress")

ALL = ("int8", "int4", "fp16")


@pytest.fixture(scope="module")
def stress_variants(tmp_path_factory):
    from colembed_export.pipeline.exporter import export_model
    from colembed_export.testing.tiny_qwen2 import build_stress_checkpoint

    checkpoint = build_stress_checkpoint(tmp_path_factory.mktemp("ckpt") / "stress", "tiny")
    return export_model(
        checkpoint, tmp_path_factory.mktemp("variants") / "stress", variants=list(ALL)
    )


# ----------------------------------------------------------------------------- stress checkpoint
@pytest.mark.slow
def test_stress_checkpoint_carries_trained_model_traits(stress_variants):
    """Massive residual channels (100-1000x) on every token from layer 0 on, compensated by the
    norms; a vision residual stream beyond fp16's range; image features in the hundreds."""
    from colembed_export.testing.tiny_qwen2 import activation_report
    from colembed_export.pipeline.verify import SAMPLE_QUERIES, sample_pages

    source = stress_variants.manifest.model.source
    report = activation_report(source, sample_pages(), list(SAMPLE_QUERIES))
    for rows in report["text"].values():
        embeddings, *layers, final = rows
        assert embeddings["ratio"] < 100
        for row in layers:
            assert 100 <= row["ratio"] <= 1000 and row["peak"] > 256, row  # Pow(x, 2) > 65504
        assert final["ratio"] < 20  # the final norm's weights compensate
    assert report["text"]["queries"][1]["tokens_over_100x"] == 1.0
    assert max(block["peak"] for block in report["vision"]) > 65504
    assert 100 < report["features_peak"] < 1000


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL)
def test_gates_met_on_the_stress_checkpoint(stress_variants, name):
    figures = stress_variants.manifest.checks[name]
    assert figures["finite"]
    assert not V.GATES[name].misses(figures), figures


@pytest.mark.slow
def test_fp16_without_fp32_islands_fails_on_the_stress_checkpoint(stress_variants, tmp_path):
    """The stress is real: onnxruntime's plain fp16 conversion (its default op block list only)
    overflows or loses the embeddings; the fp16 variant passed its gate on the same folder."""
    import shutil

    import colembed
    import onnx_ir as ir
    from colembed.integrity import describe_file
    from colembed.manifest import MANIFEST_NAME
    from onnxruntime.transformers.float16 import convert_float_to_float16

    folder = shutil.copytree(stress_variants.folder, tmp_path / "plain")
    for role in ("vision", "text"):
        plain = convert_float_to_float16(str(folder / f"{role}.onnx"), keep_io_types=True)
        del plain.graph.value_info[:]
        model = ir.from_proto(plain)
        G.finish(model)
        V.save_graph(model, folder, f"{role}.fp16.onnx", external=False)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    for role in ("vision", "text"):
        manifest["files"][f"{role}.fp16.onnx"] = describe_file(folder / f"{role}.fp16.onnx")
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    from colembed_export.pipeline.verify import SAMPLE_QUERIES, sample_pages

    pages, queries = sample_pages(), list(SAMPLE_QUERIES)
    want = colembed.load(folder, verify=False)
    got = colembed.load(folder, variant="fp16", verify=False)
    figures = E.cosine_figures(
        got.embed_images(pages),
        want.embed_images(pages),
        got.embed_queries(queries),
        want.embed_queries(queries),
    )
    assert V.GATES["fp16"].misses(figures), figures


# ------------------------------------------------------------- sharp attentions (sharp_scores.py)
def test_row_spread_is_the_widest_causal_row_max_minus_median():
    """Row t of the causal scores spans keys 0..t; the spread is max minus median over those,
    per head (two query heads sharing one key head here)."""
    import numpy as np

    from colembed_export.variants.sharp_scores import row_spreads

    k = np.array([[1.0, 0.0], [0.0, 1.0], [3.0, 0.0]])
    q = np.array([[9.0, 9.0, 9.0, 9.0], [2.0, 0.0, 0.0, 5.0], [4.0, 0.0, 1.0, 0.0]])
    # head 0 (q[:, :2]): row 1 scores [2, 0] -> 1; row 2 [4, 0, 12] -> 8. head 1: row 1 [0, 5]
    # -> 2.5; row 2 [1, 0, 3] -> 2
    assert row_spreads(q, k, heads=2, kv_heads=1, scale=1.0) == 8.0
    assert row_spreads(q, k, heads=2, kv_heads=1, scale=0.5) == 4.0
    assert row_spreads(q[:1], k[:1], heads=2, kv_heads=1, scale=1.0) == 0.0


@pytest.fixture(scope="module")
def stress_spreads(stress_variants):
    """The stress export's fp32 text graph, its calibration feeds and every attention's spread."""
    from colembed_export.variants.sharp_scores import sharp_attentions

    folder = stress_variants.folder
    calibration = E.calibration_feeds(folder)
    spreads = {
        a.path: a.spread for a in sharp_attentions(folder / "text.onnx", calibration["text"], 0.0)
    }
    return folder, calibration, spreads


@pytest.mark.slow
def test_int8_keeps_fp32_what_feeds_attentions_whose_calibration_scores_spread_wide(
    stress_spreads, tmp_path
):
    """The choice follows the calibration: with a limit between the two layers' spreads, every
    MatMul the wide attention's scores depend on (its q/k, the layer before) stays fp32 and the
    rest (its v/o, its MLP, the projection) is int8; at the recipe's own limit the stress
    checkpoint has no sharp attention and its int8 graph keeps nothing fp32."""
    import onnx_ir as ir

    from colembed_export.graphs.edits import module_path
    from colembed_export.variants.recipes import quantize_int8, weight_matmuls
    from colembed_export.variants.sharp_scores import sharp_attentions

    folder, calibration, spreads = stress_spreads
    narrow, wide = sorted(spreads, key=spreads.get)
    assert spreads[wide] > 10 * spreads[narrow], spreads
    limit = (spreads[wide] * spreads[narrow]) ** 0.5
    src = folder / "text.onnx"
    assert sharp_attentions(src, calibration["text"]) == []
    sharp = sharp_attentions(src, calibration["text"], limit)
    assert [(a.path, a.on_pages) for a in sharp] == [(wide, True)]
    model, info = quantize_int8(src, tmp_path, calibration=calibration["text"], sharp=sharp)
    layer_before = narrow.rsplit(".self_attn", 1)[0] + "."
    _, plain = quantize_int8(src, tmp_path, calibration=calibration["text"])
    every = {module_path(n) for n in weight_matmuls(ir.load(src))}  # the fp32 graph's MatMuls
    fp32_paths = {  # left with fp32 weights (not the int8 MatMuls' fp32 outlier-channel products)
        p for p in map(module_path, weight_matmuls(model)) if "outlier" not in p
    }
    kept = {f"{wide}.q_proj", f"{wide}.k_proj"} | {p for p in every if p.startswith(layer_before)}
    assert set(info["int8_kept_fp32"]) == kept == fp32_paths
    assert len(kept) >= 2 + 7, kept  # q, k + the layer before's q, k, v, o, gate, up, down
    assert all(wide in why and f"> {limit:.0f}" in why for why in info["int8_kept_fp32"].values())
    assert {f"{wide}.v_proj", f"{wide}.o_proj"} <= every - fp32_paths
    assert plain["int8_kept_fp32"] == {}
    assert info["int8_matmuls"]["fp32"] == plain["int8_matmuls"]["fp32"] + len(kept)


@pytest.mark.slow
def test_an_attention_sharp_on_pages_keeps_the_int8_variants_vision_graph_fp32(
    stress_spreads, tmp_path, monkeypatch
):
    """Through the exporter's variant step with the limit between the layers' spreads: the int8
    variant reads the fp32 vision graph file (its features form the sharp attention's keys), its
    text graph keeps that attention's q/k fp32, the manifest's check says what and why, and the
    gate still judges it."""
    from colembed.manifest import read_manifest
    from colembed_export.variants import sharp_scores
    from tests.fixtures.builds import variant_step

    folder, _, spreads = stress_spreads
    narrow, wide = sorted(spreads, key=spreads.get)
    monkeypatch.setattr(
        sharp_scores, "SHARP_SCORE_SPREAD", (spreads[wide] * spreads[narrow]) ** 0.5
    )
    figures, _ = variant_step(folder, tmp_path / "staging", ["int8"])
    manifest = read_manifest(tmp_path / "staging")
    assert manifest.graph("int8", "vision").file == manifest.graph("fp32", "vision").file
    assert (tmp_path / "staging" / manifest.graph("fp32", "vision").file).is_file()
    check = figures["int8"]  # what the exporter records as the manifest's checks.int8
    assert wide in check["int8_kept_fp32"]["vision"]["every MatMul"]
    assert {f"{wide}.q_proj", f"{wide}.k_proj"} <= set(check["int8_kept_fp32"]["text"])
    assert f"{wide}.v_proj" not in check["int8_kept_fp32"]["text"]
    assert not V.GATES["int8"].misses(figures["int8"]), figures["int8"]
