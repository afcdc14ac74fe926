"""The ColQwen2.5 image graph against the unpatched reference vision tower, in torch and after
ONNX export on onnxruntime: pages with several windows, one smaller than a window, batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from colembed.preprocess.positions import vision_rotary_tables
from colembed.preprocess.windows import window_layout, windowed_vision_contract
from tests.fixtures.qwen2_5 import PRESETS, checkpoint, load_reference

# (t, h, w) in patches. tiny-2.5 windows are 4x4 patches, tiny-2.5-alt's 8x8.
GRIDS = [(1, 4, 4), (1, 2, 6), (1, 22, 14), (1, 18, 30), (1, 8, 8)]
TOLERANCE = 1e-5  # relative to the largest reference feature of the page


def visual_of(tmp_path_factory, preset):
    return load_reference(checkpoint(tmp_path_factory, preset, "transformers")).vlm.model.visual


def graph_inputs(visual, grid, images):
    """Numpy inputs for `images` random pages of one grid, as the runtime would make them."""
    config = visual.config
    layout = window_layout(
        grid,
        merge_size=config.spatial_merge_size,
        patch_size=config.patch_size,
        window_size=config.window_size,
    )
    cos, sin = vision_rotary_tables(
        grid,
        merge_size=config.spatial_merge_size,
        head_dim=config.hidden_size // config.num_heads,
        theta=10000.0,
    )
    rng = np.random.default_rng(sum(grid) + images)
    patches = rng.standard_normal((images, layout.num_patches, 3 * 2 * 14 * 14)).astype(np.float32)
    return {"pixel_patches": patches, "rotary_cos": cos, "rotary_sin": sin, **layout.graph_inputs()}


def reference_features(visual, patches, grid):
    with torch.no_grad():
        return visual(torch.from_numpy(patches), grid_thw=torch.tensor([grid])).numpy()


def assert_close(got, want):
    scale = float(np.abs(want).max())
    assert np.abs(got - want).max() <= TOLERANCE * max(scale, 1.0), (
        np.abs(got - want).max(),
        scale,
    )


@pytest.mark.parametrize("preset", PRESETS)
def test_windowed_graph_equals_the_reference_tower_in_torch(tmp_path_factory, preset):
    from colembed_export.families.qwen2_5.graphs import WindowedImageGraph

    visual = visual_of(tmp_path_factory, preset)
    graph = WindowedImageGraph(visual).eval()
    for grid in GRIDS:
        inputs = graph_inputs(visual, grid, images=2)
        with torch.no_grad():
            got = graph(
                *(torch.from_numpy(np.ascontiguousarray(v)) for v in inputs.values())
            ).numpy()
        for image in range(2):
            assert_close(
                got[image], reference_features(visual, inputs["pixel_patches"][image], grid)
            )
    # the patch is scoped: the checkpoint's tower is the reference again afterwards
    assert "forward" not in vars(visual.blocks[0].attn)


def test_windowed_graph_holds_with_trained_like_activations(tmp_path_factory):
    """Random weights are tame: large patch features and one outlier residual channel (as trained
    towers have) must not break the windowed graph's agreement, relative to the features' scale."""
    import copy

    from colembed_export.families.qwen2_5.graphs import WindowedImageGraph

    visual = copy.deepcopy(visual_of(tmp_path_factory, "tiny-2.5-alt"))
    with torch.no_grad():
        visual.patch_embed.proj.weight.mul_(30.0)
        for block in visual.blocks:
            block.mlp.down_proj.bias[3] += 500.0
    residual = []  # the merger's input: the last residual stream (its RMSNorm hides the scale)
    visual.merger.register_forward_hook(
        lambda module, args, out: residual.append(args[0].abs().max().item())
    )
    graph = WindowedImageGraph(visual).eval()
    for grid in [(1, 4, 4), (1, 18, 30)]:
        inputs = graph_inputs(visual, grid, images=1)
        with torch.no_grad():
            got = graph(
                *(torch.from_numpy(np.ascontiguousarray(v)) for v in inputs.values())
            ).numpy()
        want = reference_features(visual, inputs["pixel_patches"][0], grid)
        assert_close(got[0], want)
    assert min(residual) > 1000.0  # the perturbation took effect


@pytest.fixture(scope="module")
def exported(exported_tiny_2_5, tmp_path_factory):
    """tiny-2.5's image graph on onnxruntime: the session's export of it (conftest), traced by the
    exporter on 3 windows of <= 16 slots over 40 patches, from the same weights."""
    import onnxruntime as ort

    visual = visual_of(tmp_path_factory, "tiny-2.5")
    config = visual.config
    contract = windowed_vision_contract(
        3 * 2 * 14 * 14, config.hidden_size // config.num_heads, config.out_hidden_size
    )
    path = exported_tiny_2_5.folder / exported_tiny_2_5.manifest.graph("fp32", "vision").file
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert contract.mismatches(session) == []
    return visual, session


@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_onnx_graph_equals_the_reference_tower(exported, grid):
    visual, session = exported
    inputs = graph_inputs(visual, grid, images=2)
    (got,) = session.run(None, inputs)
    alone = session.run(None, {**inputs, "pixel_patches": inputs["pixel_patches"][1:]})[0]
    for image in range(2):
        assert_close(got[image], reference_features(visual, inputs["pixel_patches"][image], grid))
    np.testing.assert_allclose(alone[0], got[1], rtol=0, atol=1e-6)
