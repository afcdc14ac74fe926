"""Qwen3.5's vision tower in colembed against transformers 5.24's `Qwen3_5VisionModel`.

The checkpoint is a tiny ColQwen3.5 saved by the pinned reference itself
(`tiny_qwen3_5.build_checkpoint`, both shapes). Its tower is read by
`families/qwen3_5/checkpoint.py` onto the export environment's Qwen3-VL tower without DeepStack,
wrapped in the ColQwen3 image graph (`DeepStackImageGraph`, no DeepStack layers declared) and fed
the host-made rotary tables and position-table interpolation, as the runtime feeds it. Its merged
features, eager and exported to ONNX on onnxruntime, are compared with 5.24's tower
(`model.visual(...).pooler_output`, run in the reference environment) on the same random patches
for grids from 16 to 280 merged tokens, square, wide, tall and odd.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.fixtures.colqwen3_5 import checkpoint, qwen3_5_preset  # noqa: F401

pytestmark = [pytest.mark.heavy("qwen3.5"), pytest.mark.slow]
# (t, h, w) patch grids: 16 to 280 merged tokens, several aspects
GRIDS = ((1, 8, 8), (1, 16, 10), (1, 6, 22), (1, 40, 28), (1, 2, 2))
# Relative to the largest feature: float32 sums in other orders (the position table's four
# corners, the attention's softmax), nothing more.
TOLERANCE = 2e-6


def _patches() -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [rng.standard_normal((t * h * w, 1536)).astype(np.float32) for t, h, w in GRIDS]


def _reference_merged(folder, tmp_path) -> list[np.ndarray]:
    from colembed_export.testing.tiny_qwen3_5 import run_colpali_reference

    inputs = {}
    for i, (pixels, grid) in enumerate(zip(_patches(), GRIDS)):
        inputs[f"pixels{i}"] = pixels
        inputs[f"grid{i}"] = np.array([grid], np.int64)
    np.savez(tmp_path / "in.npz", **inputs)
    run_colpali_reference("vision", folder, tmp_path / "in.npz", tmp_path / "out.npz")
    with np.load(tmp_path / "out.npz") as out:
        return [out[f"merged{i}"] for i in range(len(GRIDS))]


def _host_inputs(checkpoint_, grid) -> tuple[np.ndarray, ...]:
    from colembed.families import COLQWEN3_5
    from colembed.preprocess.positions import vision_rotary_tables

    vision = checkpoint_.vision_config
    extras = COLQWEN3_5.extras(vision)
    cos, sin = vision_rotary_tables(
        grid,
        merge_size=vision["spatial_merge_size"],
        head_dim=COLQWEN3_5.vision_head_dim(vision),
        theta=COLQWEN3_5.vision_rope_theta(vision),
    )
    return (cos, sin, *extras.grid_inputs(grid, merge_size=vision["spatial_merge_size"]))


def _relative(found: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(found - expected).max() / np.abs(expected).max())


def test_the_tower_is_transformers_qwen3_5_vision_model(qwen3_5_preset, tmp_path_factory, tmp_path):
    import torch

    from colembed.families import COLQWEN3_5
    from colembed_export.families.qwen3.graphs import DeepStackImageGraph
    from colembed_export.families.qwen3_5.checkpoint import load_vision_tower, read_checkpoint
    from colembed_export.graphs.onnx_io import export_graph
    from colembed.sessions import open_session

    folder = checkpoint(tmp_path_factory, qwen3_5_preset)
    expected = _reference_merged(folder, tmp_path)
    read = read_checkpoint(folder)
    tower = load_vision_tower(read)
    assert not tower.deepstack_merger_list and not tower.deepstack_visual_indexes
    graph = DeepStackImageGraph(tower).eval()
    vision = read.vision_config
    extras = COLQWEN3_5.extras(vision)
    assert extras.deepstack_layers == 0
    contract = COLQWEN3_5.contracts(
        patch_dim=1536,
        vision_head_dim=COLQWEN3_5.vision_head_dim(vision),
        text_hidden=vision["out_hidden_size"],
        embedding_dim=read.embedding_dim,
        extras=extras,
    )["vision"]
    assert [spec.name for spec in contract.outputs] == ["image_features"]
    example = tuple(
        torch.from_numpy(a) for a in (_patches()[1][None], *_host_inputs(read, GRIDS[1]))
    )
    from colembed_export.families.qwen2.graphs import ONNX_TRANSLATIONS

    export_graph(graph, example, contract, tmp_path / "vision.onnx", translations=ONNX_TRANSLATIONS)
    session = open_session(tmp_path / "vision.onnx", providers=("CPUExecutionProvider",))
    for pixels, grid, reference in zip(_patches(), GRIDS, expected):
        host = _host_inputs(read, grid)
        with torch.no_grad():
            eager = graph(torch.from_numpy(pixels[None]), *map(torch.from_numpy, host))[0].numpy()
            unpatched = tower(torch.from_numpy(pixels), grid_thw=torch.tensor([grid]))[0].numpy()
        (onnx,) = session.run(contract.feeds(pixels[None], *host))
        assert reference.shape == (grid[1] * grid[2] // 4, vision["out_hidden_size"])
        for name, found in (("eager", eager), ("onnx", onnx[0]), ("4.57.1 tower", unpatched)):
            assert _relative(found, reference) <= TOLERANCE, (name, grid)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda v: v.update(deepstack_visual_indexes=[0]), "deepstack_visual_indexes"),
        (lambda v: v.update(num_position_embeddings=60), "not a square"),
        (lambda v: v.update(hidden_act="gelu"), "hidden_act"),
    ],
)
def test_a_tower_that_is_not_qwen3_5s_is_refused(
    change, message, qwen3_5_preset, tmp_path_factory, tmp_path
):
    import dataclasses
    import json

    from colembed.errors import ColembedError
    from colembed_export.families.qwen3_5.checkpoint import read_checkpoint, vision_tower_config

    read = read_checkpoint(checkpoint(tmp_path_factory, qwen3_5_preset))
    config = json.loads(json.dumps(read.config))
    change(config["vision_config"])
    with pytest.raises(ColembedError, match=message):
        vision_tower_config(dataclasses.replace(read, config=config))
