"""Windowed vision attention layout (Qwen2.5-VL towers), computed on the host in numpy.

Owns the integer layout that transformers 4.57.1 `Qwen2_5_VisionTransformerPretrainedModel`
computes inside its forward with Python loops (`get_window_index`, the `cu_seqlens` of full and
windowed blocks), so that an exported vision graph needs no data-dependent control flow, the way
`positions.py` owns the rotary tables.

The reference, per image of grid (t, h, w) in patches, merge size m, window `window_size` pixels:

- merge units (m x m patches, `t*(h/m)*(w/m)` of them, in processor order) are tiled into windows
  of `win = window_size // m // patch_size` units a side, frame by frame; windows run row-major,
  units row-major inside a window; right/bottom windows are partial. The grid is padded by
  `win - side % win`, i.e. by a whole empty window when the side divides exactly.
- `window_index[k]` = processor-order unit at window-order position k; the tower permutes patch
  rows and rotary rows by it before block 0 and un-permutes the merged tokens with its argsort.
- windowed blocks attend within `cu_window_seqlens` (patches, de-duplicated by the forward's
  `unique_consecutive`: the empty padding windows add repeats); blocks listed in
  `fullatt_block_indexes` attend within `cu_seqlens` (one segment per frame).

`WindowLayout` holds one grid's layout (same-grid images share it) and the arrays a batched graph
needs instead of `cu_seqlens` (`graph_inputs`): a padded (windows, longest window) gather of patch
rows, its validity mask, and the scatter back. They index the processor's patch order directly: a
tower is per-patch except for attention, full attention does not depend on the order, and merge
units stay contiguous in both orders, so a graph can run in processor order, gather each window's
patches for the windowed blocks, and return merged tokens already in the reference's final
(un-permuted) order. The permuted order is kept (`patch_order`, `to_window_order`) for checking,
as is the reference's packed form for several grids (`packed_window_index`, offsets per image).

Never imports torch or transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np

from ..contracts import GraphContract, TensorSpec, vision_contract
from ..errors import InputError

INDEX_DTYPE = np.int64
SEQLEN_DTYPE = np.int32  # the reference's cu_seqlens dtype outside tracing
_PAD = -100  # the reference's fill value for the window padding

# What a windowed vision graph takes beyond the full-attention image graph's inputs; the same
# symbolic "patches" as `pixel_patches`. `WindowLayout.graph_inputs` makes them.
WINDOW_INPUTS = (
    TensorSpec("window_rows", "int64", ("windows", "window_slots")),
    TensorSpec("window_valid", "int64", ("windows", "window_slots")),
    TensorSpec("window_scatter", "int64", ("patches",)),
)


def windowed_vision_contract(
    patch_dim: int, vision_head_dim: int, out_hidden: int
) -> GraphContract:
    """`vision_contract` plus `WINDOW_INPUTS`: same outputs, in the same (processor) order."""
    base = vision_contract(patch_dim, vision_head_dim, out_hidden)
    return GraphContract(role=base.role, inputs=base.inputs + WINDOW_INPUTS, outputs=base.outputs)


@dataclass(frozen=True)
class WindowLayout:
    """Windowed-attention layout of one image grid.

    window_index: (units,) int64, processor-order unit at each window-order position.
    window_lengths: (windows,) int64, patches per non-empty window, in window order.
    """

    grid_thw: tuple[int, int, int]
    merge_size: int
    window_index: np.ndarray
    window_lengths: np.ndarray

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    @property
    def num_windows(self) -> int:
        return int(self.window_lengths.shape[0])

    @cached_property
    def inverse(self) -> np.ndarray:
        """(units,) int64: window-order position of each processor-order unit (argsort)."""
        out = np.empty_like(self.window_index)
        out[self.window_index] = np.arange(self.window_index.shape[0], dtype=INDEX_DTYPE)
        return out

    @cached_property
    def patch_order(self) -> np.ndarray:
        """(patches,) int64: processor-order patch row at each window-order position."""
        unit = self.merge_size**2
        return (self.window_index[:, None] * unit + np.arange(unit, dtype=INDEX_DTYPE)).ravel()

    @cached_property
    def cu_window_seqlens(self) -> np.ndarray:
        """(windows + 1,) int32 patch offsets of the windows, as the forward uses them."""
        return np.concatenate([[0], np.cumsum(self.window_lengths)]).astype(SEQLEN_DTYPE)

    @cached_property
    def cu_seqlens(self) -> np.ndarray:
        """(t + 1,) int32 patch offsets of the frames: the full-attention blocks' segments."""
        t, h, w = self.grid_thw
        return (np.arange(t + 1) * (h * w)).astype(SEQLEN_DTYPE)

    def to_window_order(self, rows: np.ndarray) -> np.ndarray:
        """Per-patch rows (patches first: pixel patches, rotary cos/sin) in window order."""
        if rows.shape[0] != self.num_patches:
            raise InputError(f"{rows.shape[0]} rows for a grid of {self.num_patches} patches")
        return rows[self.patch_order]

    def to_processor_order(self, merged: np.ndarray) -> np.ndarray:
        """Merged-token rows (units first) from window order back to processor order."""
        if merged.shape[0] != self.window_index.shape[0]:
            raise InputError(
                f"{merged.shape[0]} rows for a grid of {self.window_index.shape[0]} units"
            )
        return merged[self.inverse]

    @cached_property
    def window_gather(self) -> tuple[np.ndarray, np.ndarray]:
        """(windows, longest) int64 processor-order patch row of each window slot, windows and
        slots in the reference's window order, and the (windows, longest) bool slot validity.
        Padding slots point at row 0 (finite) and are masked out."""
        longest = int(self.window_lengths.max())
        slot = np.arange(longest, dtype=INDEX_DTYPE)
        valid = slot[None, :] < self.window_lengths[:, None]
        starts = self.cu_window_seqlens[:-1, None].astype(INDEX_DTYPE)
        window_rows = np.minimum(starts + slot, self.num_patches - 1)
        return np.where(valid, self.patch_order[window_rows], 0), valid

    @cached_property
    def window_scatter(self) -> np.ndarray:
        """(patches,) int64: flat `window * longest + slot` position of each processor-order patch,
        i.e. where its output row is read back from the padded window layout."""
        _, valid = self.window_gather
        flat_of_window_order = np.flatnonzero(valid.ravel()).astype(INDEX_DTYPE)
        out = np.empty(self.num_patches, dtype=INDEX_DTYPE)
        out[self.patch_order] = flat_of_window_order
        return out

    def graph_inputs(self) -> dict[str, np.ndarray]:
        """The window inputs of a windowed vision graph (`WINDOW_INPUTS`), by name, int64."""
        rows, valid = self.window_gather
        return {
            "window_rows": rows,
            "window_valid": valid.astype(INDEX_DTYPE),
            "window_scatter": self.window_scatter,
        }


def merged_window_side(*, window_size: int, merge_size: int, patch_size: int) -> int:
    """Merge units on a window side (`vit_merger_window_size` of the reference)."""
    side = window_size // merge_size // patch_size
    if side < 1:
        raise InputError(
            f"window_size {window_size} px is smaller than one merged token ({merge_size * patch_size} px)"
        )
    return side


def window_layout(
    grid_thw: tuple[int, int, int], *, merge_size: int, patch_size: int, window_size: int
) -> WindowLayout:
    """The layout of one grid (see the module docstring)."""
    t, h, w = _check_grid(grid_thw, merge_size)
    side = merged_window_side(window_size=window_size, merge_size=merge_size, patch_size=patch_size)
    index, units_per_window = _frame_windows(t, h // merge_size, w // merge_size, side)
    lengths = (units_per_window[units_per_window > 0] * merge_size**2).astype(INDEX_DTYPE)
    index.setflags(write=False)
    lengths.setflags(write=False)
    return WindowLayout((t, h, w), merge_size, index, lengths)


def packed_window_index(
    grids: Sequence[tuple[int, int, int]], *, merge_size: int, patch_size: int, window_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The reference's packed form for images given one after another:
    (window_index with per-image unit offsets, cu_window_seqlens de-duplicated, cu_seqlens)."""
    if len(grids) == 0:
        raise InputError("no image grids")
    indices, window_ends, frame_ends = [], [np.zeros(1, INDEX_DTYPE)], [np.zeros(1, INDEX_DTYPE)]
    unit_offset = patch_offset = 0
    for grid in grids:
        layout = window_layout(
            grid, merge_size=merge_size, patch_size=patch_size, window_size=window_size
        )
        indices.append(layout.window_index + unit_offset)
        window_ends.append(layout.cu_window_seqlens[1:].astype(INDEX_DTYPE) + patch_offset)
        frame_ends.append(layout.cu_seqlens[1:].astype(INDEX_DTYPE) + patch_offset)
        unit_offset += layout.window_index.shape[0]
        patch_offset += layout.num_patches
    return (
        np.concatenate(indices),
        np.concatenate(window_ends).astype(SEQLEN_DTYPE),
        np.concatenate(frame_ends).astype(SEQLEN_DTYPE),
    )


def _frame_windows(t: int, units_h: int, units_w: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """(window_index, units per window incl. empty padding windows) for one image, as the reference
    pads, tiles and filters its unit grid."""
    pad_h, pad_w = side - units_h % side, side - units_w % side
    windows_h, windows_w = (units_h + pad_h) // side, (units_w + pad_w) // side
    padded = np.full((t, units_h + pad_h, units_w + pad_w), _PAD, dtype=INDEX_DTYPE)
    units = np.arange(t * units_h * units_w, dtype=INDEX_DTYPE)
    padded[:, :units_h, :units_w] = units.reshape(t, units_h, units_w)
    tiles = padded.reshape(t, windows_h, side, windows_w, side).transpose(0, 1, 3, 2, 4)
    tiles = tiles.reshape(t * windows_h * windows_w, side * side)
    flat = tiles.ravel()
    return flat[flat != _PAD], np.count_nonzero(tiles != _PAD, axis=1)


def _check_grid(grid_thw: tuple[int, int, int], merge_size: int) -> tuple[int, int, int]:
    t, h, w = (int(v) for v in grid_thw)
    if min(t, h, w) < 1 or h % merge_size or w % merge_size:
        raise InputError(f"invalid image grid {(t, h, w)} for merge size {merge_size}")
    return t, h, w


__all__ = [
    "WINDOW_INPUTS",
    "WindowLayout",
    "merged_window_side",
    "packed_window_index",
    "window_layout",
    "windowed_vision_contract",
]
