"""The Qwen2.5-VL image graph: the checkpoint's own windowed vision tower, batched for export.

`WindowedImageGraph` is `graphs.ImageGraph` (patch embedding as a MatMul, batched full attention
through `colembed::full_attention`) plus what Qwen2.5-VL adds, changing only attention:

- blocks in `fullatt_block_indexes` run Qwen2-VL's batched full attention unchanged;
- the other blocks attend within windows. The reference splits a packed, window-permuted sequence
  by `cu_window_seqlens` in Python (`.tolist()`, frozen by export). Here the host's window layout
  (`colembed.preprocess.windows.WindowLayout.graph_inputs`) drives it instead: q/k/v rows are
  gathered into a padded (images * windows, longest window) batch, attend under a key-validity
  mask, and are gathered back. Cost is linear in the window size, not quadratic in the page.

No permutation runs in the graph: the layout indexes the processor's patch order, every other
op is per patch, and merge units stay contiguous, so the graph takes the same pixel and rotary
inputs as Qwen2-VL's and returns merged tokens in processor order, i.e. the reference's output
after its own `argsort(window_index)` (checked against the unpatched tower by the tests).

The window inputs are int64 (`WINDOW_INPUTS`): the same graph serves fp32 and fp16 variants, and
the mask becomes additive inside `scaled_dot_product_attention` in the compute dtype.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from ..qwen2.graphs import ImageGraph, qkv_with_rotary


def _windowed_vision_attention(
    self, hidden_states: torch.Tensor, position_embeddings=None, windows=None, **_: object
) -> torch.Tensor:
    """`Qwen2_5_VLVisionAttention.forward` over (images, patches, width) within host-made windows.

    `windows` = (rows, valid, scatter) from `WindowLayout.graph_inputs`. Same weights, rotary and
    attention math as the reference; padding slots attend like real rows (to valid keys only, so
    they stay finite) and are dropped by the scatter.
    """
    rows, valid, scatter = windows
    images, patches, width = hidden_states.shape
    num_windows, slots = rows.shape
    query, key, value = qkv_with_rotary(self, hidden_states, position_embeddings)

    def by_window(t: torch.Tensor) -> torch.Tensor:  # (images, patches, width) ->
        # (images * windows, heads, slots, hd)
        t = torch.index_select(t, 1, rows.reshape(-1))  # one ONNX Gather (indexing gives GatherND)
        return t.reshape(images * num_windows, slots, self.num_heads, -1).transpose(1, 2)

    mask = (valid > 0).reshape(1, num_windows, 1, 1, slots).expand(images, -1, -1, -1, -1)
    out = nn.functional.scaled_dot_product_attention(
        by_window(query),
        by_window(key),
        by_window(value),
        attn_mask=mask.reshape(images * num_windows, 1, 1, slots),
        scale=float(self.scaling),
    )
    out = out.transpose(1, 2).reshape(images, num_windows * slots, width)
    return self.proj(torch.index_select(out, 1, scatter))


class WindowedImageGraph(ImageGraph):
    """(images, patches, 1176) pixel patches + rotary tables + window layout
    -> (images, patches/4, text width), images of one grid, processor order throughout."""

    def __init__(self, visual: nn.Module) -> None:
        super().__init__(visual)
        self.full_blocks = frozenset(int(i) for i in visual.fullatt_block_indexes)

    def forward(
        self, pixel_patches, rotary_cos, rotary_sin, window_rows, window_valid, window_scatter
    ):
        images = pixel_patches.shape[0]
        hidden = torch.matmul(pixel_patches, self.patch_weight)
        position_embeddings = (rotary_cos, rotary_sin)
        windows = (window_rows, window_valid, window_scatter)
        # ImageGraph's scope gives every block Qwen2-VL's batched full attention (which ignores
        # `windows`) and removes the instance attribute on exit, so the windowed blocks' override
        # set inside it is undone with it: the checkpoint's modules stay the reference outside.
        with self._batched_attention():
            for index, block in enumerate(self.visual.blocks):
                if index not in self.full_blocks:
                    block.attn.forward = types.MethodType(_windowed_vision_attention, block.attn)
                hidden = block(
                    hidden,
                    cu_seqlens=None,
                    position_embeddings=position_embeddings,
                    windows=windows,
                )
        merged = self.visual.merger(hidden)  # flattens images: (images * patches/4, text width)
        return merged.reshape(images, -1, merged.shape[-1])


__all__ = ["WindowedImageGraph"]
