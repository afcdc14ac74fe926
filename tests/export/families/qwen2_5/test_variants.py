"""ColQwen2.5's reduced-precision variants: the fp16 vision graph under trained-like activations.

The stress checkpoint (`build_stress_checkpoint_2_5`) carries what trained Qwen2.5-VL vision
towers do and random weights do not: a residual stream above fp16's 65504 and, in every block,
a gated-MLP intermediate (silu(gate) * up, the down-projection's input) at 2e5, the seed notes'
fp16 overflow point. onnxruntime's CPU provider runs fp16 MatMuls in fp32 between its own casts,
so only the measured peak at the fp16 GEMMs can show such an overflow (recipes.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.fixtures.qwen2_5 import load_reference

pytestmark = pytest.mark.heavy("qwen2.5")

FP16_MAX = 65504.0


@pytest.fixture(scope="module")
def stress_2_5(tmp_path_factory):
    from colembed_export.testing.tiny_qwen2_5 import build_stress_checkpoint_2_5

    return build_stress_checkpoint_2_5(tmp_path_factory.mktemp("stress-2.5") / "tiny-2.5-stress")


def window_feeds(visual, grids):
    """One random page per grid, as the runtime feeds the windowed image graph."""
    from tests.export.families.qwen2_5.test_vision_graph import graph_inputs

    return [graph_inputs(visual, grid, images=1) for grid in grids]


@pytest.fixture(scope="module")
def stress_export(stress_2_5, tmp_path_factory):
    """The stress checkpoint exported with the fp16 variant (the exporter's recipe and gate), the
    check on: one export serves the end-to-end test and, through its fp32 image graph, the
    recipe's own test (which traced the tower a second time before)."""
    from colembed_export.pipeline.exporter import export_model

    return export_model(
        stress_2_5,
        tmp_path_factory.mktemp("stress-export") / "stress-2.5",
        variants=("fp16",),
        random_weights=True,
    )


@pytest.fixture(scope="module")
def stress_vision_graph(stress_export, stress_2_5, tmp_path_factory):
    """The stress checkpoint's windowed image graph (the export's fp32 ONNX, copied so that a
    test can write its own fp16 graph beside it) and its tower."""
    import shutil

    import onnxruntime as ort

    from colembed.preprocess.windows import windowed_vision_contract

    visual = load_reference(stress_2_5).vlm.model.visual
    config = visual.config
    contract = windowed_vision_contract(
        3 * 2 * 14 * 14, config.hidden_size // config.num_heads, config.out_hidden_size
    )
    source = stress_export.folder / stress_export.manifest.graph("fp32", "vision").file
    work = tmp_path_factory.mktemp("stress-onnx")
    for part in stress_export.folder.glob(f"{source.name}*"):  # the graph and any external data
        shutil.copy(part, work / part.name)
    path = work / source.name
    assert (
        contract.mismatches(ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]))
        == []
    )
    return path, visual


def test_stress_checkpoint_2_5_overflows_fp16_where_trained_towers_do(stress_2_5):
    visual = load_reference(stress_2_5).vlm.model.visual
    seen = {}

    def record(name):
        def hook(module, args):
            seen[name] = float(args[0].abs().max())  # returns None: the input is left as is

        return hook

    hooks = [
        visual.blocks[-1].mlp.down_proj.register_forward_pre_hook(record("down_input")),
        visual.merger.register_forward_pre_hook(record("residual")),
    ]
    patches = torch.from_numpy(
        np.random.default_rng(0).standard_normal((8 * 12, 1176)).astype(np.float32)
    )
    with torch.no_grad():
        features = visual(patches, grid_thw=torch.tensor([[1, 8, 12]]))
    for hook in hooks:
        hook.remove()
    assert seen["down_input"] > 2 * FP16_MAX and seen["residual"] > FP16_MAX
    assert 100 < float(features.abs().max()) < 1000 and torch.isfinite(features).all()


def cosines(got, want):
    a, b = (x.reshape(-1, x.shape[-1]).astype(np.float64) for x in (got, want))
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.slow  # the stress checkpoint's export (shared with the end-to-end test below)
def test_fp16_vision_graph_keeps_the_overflowing_gemms_fp32(stress_vision_graph):
    """With the recipe's keep rule the down-projections stay fp32, the rest is fp16 and agrees
    with fp32; without it, the gate refuses and names the down-projection."""
    import onnx_ir as ir
    import onnxruntime as ort

    from colembed_export.graphs.edits import finish
    from colembed_export.variants.recipes import GATES, convert_fp16

    path, visual = stress_vision_graph
    calibration = window_feeds(visual, [(1, 18, 30), (1, 4, 4)])
    model, figures = convert_fp16(path, calibration)
    blocks = len(visual.blocks)
    assert figures["fp16_kept_fp32"] == [f"visual.blocks.{i}.mlp.down_proj" for i in range(blocks)]
    assert figures["fp16_gemm_peak"] < FP16_MAX / 4
    finish(model)
    ir.save(model, path.with_name("vision.fp16.onnx"))
    fp16 = ort.InferenceSession(
        str(path.with_name("vision.fp16.onnx")), providers=["CPUExecutionProvider"]
    )
    fp32 = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    half = [
        n for n in model.graph if n.op_type == "MatMul" and n.inputs[1].dtype == ir.DataType.FLOAT16
    ]
    assert len(half) == 1 + 4 * blocks  # patch embedding; qkv, proj, gate, up per block
    for feed in window_feeds(visual, [(1, 22, 14), (1, 2, 6)]):  # pages the calibration never saw
        got, want = fp16.run(None, feed)[0], fp32.run(None, feed)[0]
        assert np.isfinite(got).all()
        assert cosines(got, want).min() > 0.999
    gate = GATES["fp16"]
    passing = {
        "mean_cosine": 1.0,
        "min_cosine": 1.0,
        "tokens": 1,
        **{k: {"vision": v} for k, v in figures.items()},
    }
    assert gate.misses(passing) == []
    _, unkept = convert_fp16(path, calibration, safe_peak=None)
    refused = gate.misses({**passing, **{k: {"vision": v} for k, v in unkept.items()}})
    assert len(refused) == 1 and "visual.blocks.0.mlp.down_proj" in refused[0]
    assert "reaches 200000" in refused[0] and "DirectML" in refused[0]


def test_gate_refuses_inf_and_nan_explicitly():
    from colembed_export.variants.gates import cosine_figures
    from colembed_export.variants.recipes import GATES

    want = [np.eye(3, 4, dtype=np.float32)]
    broken = [want[0].copy()]
    broken[0][1, 2] = np.inf
    figures = cosine_figures(broken, want, want, want)
    assert figures["non_finite_tokens"] == 1
    for name in ("int8", "int4", "fp16"):
        assert any(
            "1 of 6 token embeddings hold inf or NaN" in m for m in GATES[name].misses(figures)
        )
    assert cosine_figures(want, want, want, want)["non_finite_tokens"] == 0


@pytest.fixture(scope="module")
def variants_2_5(exported_tiny_2_5):
    """tiny-2.5 (colpali layout) exported with every variant, gated as ColQwen2's are (the
    session's export: conftest `exported_tiny_2_5`)."""
    return exported_tiny_2_5


def test_colqwen2_5_variants_meet_colqwen2s_gates(variants_2_5):
    import colembed
    from colembed_export.variants.recipes import GATES

    manifest = variants_2_5.manifest
    assert manifest.family == "colqwen2.5"
    assert {"int8", "int4", "fp16"} <= set(manifest.variants)
    for name in ("int8", "int4", "fp16"):
        figures = variants_2_5.check[name]
        assert GATES[name].misses(figures) == [] and figures["non_finite_tokens"] == 0
    assert variants_2_5.check["fp16"]["fp16_kept_fp32"] == {
        "vision": [],
        "text": [],
    }  # tame weights
    pages = _pages()
    fp32 = colembed.load(variants_2_5.folder).embed_images(pages)
    for name in ("int8", "fp16"):
        got = colembed.load(variants_2_5.folder, variant=name).embed_images(pages)
        assert min(cosines(g, w).mean() for g, w in zip(got, fp32)) > GATES[name].mean_cosine


def _pages():
    from tests.fixtures.images import rgb

    return [rgb(300, 420, seed=5), rgb(60, 90, seed=6)]  # several windows; smaller than one


@pytest.mark.slow  # one export of the stress checkpoint with the fp16 variant
def test_fp16_variant_of_the_stress_checkpoint_is_finite_and_gated(stress_export, stress_2_5):
    """End to end: the exporter's fp16 recipe keeps the overflowing down-projections fp32, records
    them, and the variant passes the fp16 gate (peak and finiteness included)."""
    from colembed_export.variants.recipes import GATES

    report = stress_export
    figures = report.check["fp16"]
    blocks = len(load_reference(stress_2_5).vlm.model.visual.blocks)
    assert figures["fp16_kept_fp32"]["vision"] == [
        f"visual.blocks.{i}.mlp.down_proj" for i in range(blocks)
    ]
    assert max(figures["fp16_gemm_peak"].values()) < FP16_MAX / 4
    assert figures["non_finite_tokens"] == 0 and GATES["fp16"].misses(figures) == []
