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
