"""Qwen3-VL's learned vision position embeddings, interpolated to a grid: the host-made half.

Qwen3-VL's tower adds to each patch a position embedding taken from a learned
(side * side, width) table, bilinearly interpolated to the image's (h, w) patch grid
(transformers `Qwen3VLVisionModel.fast_pos_embed_interpolate`, identical in 4.57.1 and 5.24). The
interpolation indices and weights depend on the grid only, so the host computes them, like the
rotary tables, and the image graph does the dense part (4 gathers from the table, a weighted sum):

- rows `r = linspace(0, side - 1, h)`, columns `c = linspace(0, side - 1, w)` in float32;
  floor `r0 = int(r)`, ceil `r1 = min(r0 + 1, side - 1)` (same for c), fractions `dr = r - r0`;
- per patch (i, j), the four corners in the order (r0, c0), (r0, c1), (r1, c0), (r1, c1), as
  flat table indices `row * side + col`, with weights (1-dr)(1-dc), (1-dr)dc, dr(1-dc), dr dc,
  each a float32 product;
- listed in the processor's patch order (2x2 merge blocks, as the pixels and rotary tables), and
  repeated over t frames.

`torch.linspace` is matched bit for bit (checked for every side 2..69 and length 1..499 against
torch 2.13's CPU kernel on AVX2): the first half is `step * i`, the second half
`end - step * (n - 1 - i)` with one rounding (the kernel's fused multiply-add), step rounded to
float32 first. A torch build that does not fuse there differs in the last bit of some weights
(~6e-8 relative), far below every tolerance.

Never imports torch.
"""

from __future__ import annotations

import numpy as np

from ..contracts import TensorSpec
from ..errors import InputError

CORNERS = 4
# Image-graph inputs, after the rotary tables: flat table index and weight of each patch's four
# interpolation corners, (4, patches), in the processor's patch order.
POSITION_INPUTS = (
    TensorSpec("position_index", "int64", (CORNERS, "patches")),
    TensorSpec("position_weight", "float32", (CORNERS, "patches")),
)


def torch_linspace_float32(end: float, steps: int) -> np.ndarray:
    """`torch.linspace(0, end, steps)` in float32, bit for bit (see the module docstring)."""
    if steps < 1:
        raise InputError(f"linspace needs at least one step, got {steps}")
    if steps == 1:
        return np.zeros(1, np.float32)
    end32 = np.float32(end)
    step = np.float32(end32 / np.float32(steps - 1))
    i = np.arange(steps)
    low = (np.float64(step) * i).astype(np.float32)
    high = (np.float64(end32) - np.float64(step) * (steps - 1 - i)).astype(np.float32)
    return np.where(i < steps // 2, low, high)


def interpolated_positions(
    grid_thw: tuple[int, int, int], *, merge_size: int, grid_side: int
) -> tuple[np.ndarray, np.ndarray]:
    """(index (4, t*h*w) int64, weight (4, t*h*w) float32) for one image grid, in patch order."""
    t, h, w = (int(v) for v in grid_thw)
    if min(t, h, w) < 1 or h % merge_size or w % merge_size:
        raise InputError(f"invalid image grid {(t, h, w)} for merge size {merge_size}")
    if grid_side < 1:
        raise InputError(f"position grid side must be >= 1, got {grid_side}")
    rows = torch_linspace_float32(grid_side - 1, h)
    cols = torch_linspace_float32(grid_side - 1, w)
    r0, c0 = rows.astype(np.int64), cols.astype(np.int64)  # truncation, as `.int()`
    r1, c1 = np.minimum(r0 + 1, grid_side - 1), np.minimum(c0 + 1, grid_side - 1)
    dr, dc = rows - r0.astype(np.float32), cols - c0.astype(np.float32)
    one = np.float32(1)
    index = np.stack(
        [
            (r0[:, None] * grid_side + c0[None]),
            (r0[:, None] * grid_side + c1[None]),
            (r1[:, None] * grid_side + c0[None]),
            (r1[:, None] * grid_side + c1[None]),
        ]
    )
    weight = np.stack(
        [
            (one - dr)[:, None] * (one - dc)[None],
            (one - dr)[:, None] * dc[None],
            dr[:, None] * (one - dc)[None],
            dr[:, None] * dc[None],
        ]
    ).astype(np.float32)
    m = merge_size

    def patch_order(a: np.ndarray) -> np.ndarray:  # (4, h, w) -> (4, h*w) in 2x2-block order
        return (
            a.reshape(CORNERS, h // m, m, w // m, m).transpose(0, 1, 3, 2, 4).reshape(CORNERS, -1)
        )

    index, weight = patch_order(index), patch_order(weight)
    return np.tile(index, (1, t)).astype(np.int64), np.tile(weight, (1, t))


__all__ = ["POSITION_INPUTS", "interpolated_positions", "torch_linspace_float32"]
