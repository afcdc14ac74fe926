"""The Qwen3-VL graphs: the checkpoint's own vision tower and language model, with DeepStack.

`DeepStackImageGraph` is `graphs.ImageGraph` (patch embedding as a MatMul, batched full attention
through `colembed::full_attention`) plus what Qwen3-VL's tower adds, each from the checkpoint's
modules:

- the patch embedding's bias (Qwen2-VL's Conv3d has none);
- the learned position table (`visual.pos_embed`), interpolated to the grid by the host's four
  corner indices and weights (`colembed.preprocess.vision_positions`): one Gather from the table,
  a weighted sum in the reference's order (corner 0 + 1 + 2 + 3). The reference computes the same
  indices and weights in Python per grid (`fast_pos_embed_interpolate`, `.tolist()`), which export
  would freeze;
- DeepStack: after each block in `deepstack_visual_indexes` its own merger
  (`deepstack_merger_list`, post-shuffle LayerNorm) merges the hidden state; those features are a
  second output, (images, layers, merged tokens, text width). A tower whose list is empty
  (Qwen3.5's: Qwen3-VL's tower without DeepStack, docs/reference-colqwen3_5.md) has the merged
  features as its only output, as its `VisionExtras` (no DeepStack layers) declares.

`DeepStackTextGraph` is `graphs.TextGraph` plus DeepStack's input: the (layers, rows, width)
features placed by the same host index as the image features, added to the hidden state after
each of the first `layers` decoder layers at image-token positions. The reference does this with
boolean-mask indexing (`Qwen3VLTextModel._deepstack_process`, data-dependent); for export it is
swapped for `where(mask, hidden + placed, hidden)`, the same sum on the same rows, for one forward
only, so the checkpoint's modules stay the reference outside it. A text-only batch passes zero
feature rows: every row keeps its hidden state, as the reference skips DeepStack without images.
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn

from ..qwen2.graphs import ImageGraph, TextGraph, place_rows


class DeepStackImageGraph(ImageGraph):
    """(images, patches, 1536) patches + rotary tables + position-table interpolation
    -> (images, patches/4, text width) features, (images, layers, patches/4, text width) DeepStack."""

    def __init__(self, visual: nn.Module) -> None:
        super().__init__(visual)
        self.register_buffer(
            "patch_bias", visual.patch_embed.proj.bias.detach().clone(), persistent=False
        )
        self.deepstack_blocks = [int(i) for i in visual.deepstack_visual_indexes]

    def forward(self, pixel_patches, rotary_cos, rotary_sin, position_index, position_weight):
        images = pixel_patches.shape[0]
        hidden = torch.matmul(pixel_patches, self.patch_weight) + self.patch_bias
        table = self.visual.pos_embed.weight
        corners = torch.index_select(table, 0, position_index.reshape(-1))
        corners = corners.reshape(position_index.shape[0], -1, table.shape[-1])
        corners = corners * position_weight.unsqueeze(-1)
        hidden = hidden + (corners[0] + corners[1] + corners[2] + corners[3])
        position_embeddings = (rotary_cos, rotary_sin)
        deepstack = []
        with self._batched_attention():
            for index, block in enumerate(self.visual.blocks):
                hidden = block(hidden, cu_seqlens=None, position_embeddings=position_embeddings)
                if index in self.deepstack_blocks:
                    merger = self.visual.deepstack_merger_list[self.deepstack_blocks.index(index)]
                    merged = merger(hidden)
                    deepstack.append(merged.reshape(images, -1, merged.shape[-1]))
        merged = self.visual.merger(hidden)
        merged = merged.reshape(images, -1, merged.shape[-1])
        if not deepstack:  # a tower without DeepStack (Qwen3.5's): the merged features only
            return merged
        return merged, torch.stack(deepstack, dim=1)


def _add_at_image_tokens(self, hidden_states, visual_pos_masks, visual_embeds):
    """`Qwen3VLTextModel._deepstack_process` without data-dependent indexing: `visual_embeds` is
    already placed per token (B, L, width); non-image tokens keep their hidden state."""
    return torch.where(visual_pos_masks.unsqueeze(-1), hidden_states + visual_embeds, hidden_states)


class DeepStackTextGraph(TextGraph):
    """TextGraph + (layers, image_rows, width) DeepStack features placed by the same index."""

    @contextlib.contextmanager
    def _placed_deepstack(self):
        model = self.language_model
        model._deepstack_process = types.MethodType(_add_at_image_tokens, model)
        try:
            yield
        finally:
            del model._deepstack_process

    def forward(
        self,
        input_ids,
        attention_mask,
        position_ids,
        image_feature_index,
        image_features,
        deepstack_features,
    ):
        embeds = self.language_model.embed_tokens(input_ids)
        is_image = image_feature_index > 0
        embeds = torch.where(
            is_image.unsqueeze(-1), place_rows(image_features, image_feature_index), embeds
        )
        placed = [
            place_rows(deepstack_features[k], image_feature_index)
            for k in range(deepstack_features.shape[0])
        ]
        with self._placed_deepstack(), self.fused_attention():
            hidden = self.hidden_states(
                embeds,
                attention_mask,
                position_ids,
                visual_pos_masks=is_image,
                deepstack_visual_embeds=placed,
            )
        return self.normalised_embeddings(hidden, attention_mask)


__all__ = ["DeepStackImageGraph", "DeepStackTextGraph"]
