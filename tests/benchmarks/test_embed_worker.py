"""bench_embed's worker and report on an OpenVINO variant of the tiny checkpoint: the letter page
alone (no budget page), what OpenVINO compiled recorded beside the timings, and the accuracy
against fp32 without a retrieval set (the full-depth setting). No timing is asserted: the figures
live in benchmarks/results/embed/."""

from __future__ import annotations

import json

import pytest
from tests.fixtures.builds import base_staging, build_once

ov = pytest.importorskip("openvino", reason="the OpenVINO runtime is not installed")

OPENVINO_ALL = ["openvino", "openvino-bf16", "openvino-int8"]


@pytest.fixture(scope="module")
def openvino_tiny(exported_tiny, tmp_path_factory):
    """The tiny export with the OpenVINO variants written and gated by the exporter's variant
    step (the build tests/runtime/test_openvino.py shares under the same name)."""
    from colembed_export.variants.write import write_variants

    def build(folder):
        graphs, write_manifest = base_staging(exported_tiny.folder, folder / "model")
        results = write_variants(
            folder / "model", graphs, OPENVINO_ALL, write_manifest=write_manifest
        )
        (folder / "results.json").write_text(json.dumps(results, default=str))

    return build_once(tmp_path_factory, "openvino-tiny", build) / "model"


def test_an_openvino_row_records_what_was_compiled_and_may_skip_the_budget_page(
    openvino_tiny, tmp_path
):
    from benchmarks.embed.report import accuracy, derive, markdown
    from benchmarks.embed.worker import run_worker
    from benchmarks.shared.common import machine_info
    from benchmarks.shared.flops import Shapes

    from colembed.manifest import MANIFEST_NAME

    def job(variant):
        return {
            "runtime": "colembed",
            "variant": variant,
            "folder": str(openvino_tiny),
            "threads": 1,
            "page_repeats": 1,
            "query_repeats": 2,
            "batch_repeats": 1,
            "budget_page": False,
            "retrieval_pages": 0,
            "embeddings_out": str(tmp_path / f"emb-{variant}.npz"),
        }

    run_worker(job("fp32"))  # onnxruntime: the reference of the accuracy figures
    row = run_worker(job("openvino-bf16")) | {"runtime": "colembed", "variant": "openvino-bf16"}
    assert "budget_page_s" not in row and row["page_s"]["median"] > 0
    assert len(row["query_latency_s"]["all"]) == 2
    compiled = row["openvino_compiled"]
    assert set(compiled) == {"vision", "text"}
    # a bf16 request compiles bf16 only where the CPU plugin offers bf16 arithmetic
    has_bf16 = "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    for properties in compiled.values():
        assert properties["INFERENCE_PRECISION_HINT"] == ("bf16" if has_bf16 else "f32")
        assert properties["EXECUTION_MODE_HINT"]

    manifest = json.loads((openvino_tiny / MANIFEST_NAME).read_text())
    rows = {"openvino-bf16": row}
    peaks = {"fp32_gflops": 1.0, "int8_gops": 1.0, "fp32_how": "-", "int8_how": "-"}
    derive(rows, Shapes.from_manifest(manifest), peaks, openvino_tiny, openvino_tiny)
    assert row["budget_pages_per_s"] is None
    # the letter page and the 16 queries against fp32, no retrieval set: no top-5 figures
    acc = accuracy(tmp_path, ["openvino-bf16"])["openvino-bf16"]
    assert "top5" not in acc and acc["mean_cosine"] > 0.99
    setting = {
        "vision_depth": 1,
        "text_layers": 1,
        "threads": 1,
        "model": "tiny",
        "retrieval_pages": 0,
    }
    results = {
        "machine": machine_info(),
        "setting": setting,
        "peaks": peaks,
        "runtimes": rows,
        "accuracy": {"openvino-bf16": acc},
    }
    table = markdown(results)
    precision = compiled["vision"]["INFERENCE_PRECISION_HINT"]
    assert f"openvino-bf16: vision {precision}" in table
    speed, figures = [x for x in table.splitlines() if x.startswith("| openvino-bf16 |")]
    assert speed.split(" | ")[2] == "-"  # the budget page's column
    assert "16 queries, no retrieval set" in table
    # variant, mean, min, top-5 same set, top-5 within ties, gate
    assert [c.strip() for c in figures.strip("|").split("|")][3:] == ["-", "-", "pass"]
