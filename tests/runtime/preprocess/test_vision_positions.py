"""ColQwen3's host-made vision inputs: the learned position table's interpolation, bit for bit.

`colembed.preprocess.vision_positions` must give transformers' `Qwen3VLVisionModel.
fast_pos_embed_interpolate` (4.57.1, the same code as 5.24) exactly: the indices and weights are
the host's, the weighted sum the graph's.
"""

from __future__ import annotations

import numpy as np
import pytest

from colembed.preprocess.vision_positions import interpolated_positions, torch_linspace_float32


def test_linspace_is_torchs_bit_for_bit():
    torch = pytest.importorskip("torch")
    for side in (2, 3, 6, 8, 48, 64):
        for steps in range(1, 260):
            want = torch.linspace(0, side - 1, steps).numpy()
            got = torch_linspace_float32(side - 1, steps)
            np.testing.assert_array_equal(
                got.view(np.int32), want.view(np.int32), err_msg=f"side {side}, steps {steps}"
            )


@pytest.mark.parametrize("side", [6, 8, 48])
def test_interpolated_position_embeddings_are_the_towers(side):
    torch = pytest.importorskip("torch")
    from colembed_export.testing.tiny_qwen3 import PRESETS_3, build_vlm_config
    from dataclasses import replace
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    spec = replace(PRESETS_3["tiny-3"], position_grid_side=side)
    torch.manual_seed(0)
    tower = Qwen3VLVisionModel(build_vlm_config(spec).vision_config).eval()
    table = tower.pos_embed.weight.detach().numpy()
    for grid in [(1, 2, 2), (1, 4, 6), (1, 26, 10), (1, 64, 48), (1, 100, 2), (2, 6, 4)]:
        with torch.no_grad():
            want = tower.fast_pos_embed_interpolate(torch.tensor([grid])).numpy()
        index, weight = interpolated_positions(grid, merge_size=2, grid_side=side)
        assert index.dtype == np.int64 and weight.dtype == np.float32
        corners = table[index] * weight[..., None]
        got = corners[0] + corners[1] + corners[2] + corners[3]
        np.testing.assert_array_equal(got, want, err_msg=str(grid))


def test_interpolation_refuses_a_grid_the_merge_does_not_divide():
    from colembed.errors import InputError

    with pytest.raises(InputError, match="invalid image grid"):
        interpolated_positions((1, 3, 4), merge_size=2, grid_side=8)
