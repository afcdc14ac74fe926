"""The two torch modules that become colembed's graphs, built from the checkpoint's own modules.

No third definition of ColQwen2 lives here. `ImageGraph` holds the checkpoint's vision tower and
changes exactly two things for export, both checked against the unpatched tower by `verify.py`:

- the Conv3d patch embedding runs as a MatMul over the 1176 values of a patch (it *is* a Linear;
  quantisers and DirectML see a MatMul),
- `VisionAttention.forward` runs batched over (images, patches) instead of splitting the packed
  sequence by `cu_seqlens` in Python (`.tolist()` would freeze the grid into the graph). Attention is
  full within an image and none across images, as in the reference.

`TextGraph` holds the checkpoint's language model and projection and replaces `masked_scatter` (a
data-dependent op) with a gather driven by a host-made index. Position ids come from the host.
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen2_vl.modeling_qwen2_vl import (
    apply_rotary_pos_emb_vision,
    eager_attention_forward,
)


def _batched_vision_attention(
    self, hidden_states: torch.Tensor, position_embeddings=None, **_: object
) -> torch.Tensor:
    """`VisionAttention.forward` over (images, patches, width): one attention per image.

    Same weights, rotary and attention kernel as the reference; only the packing differs.
    """
    images, patches, width = hidden_states.shape
    qkv = self.qkv(hidden_states).reshape(images, patches, 3, self.num_heads, -1)
    query, key, value = qkv.permute(2, 0, 1, 3, 4).unbind(0)  # each (images, patches, heads, hd)
    cos, sin = position_embeddings
    query, key = apply_rotary_pos_emb_vision(query, key, cos, sin)
    query, key, value = (t.transpose(1, 2) for t in (query, key, value))  # (images, heads, patches, hd)
    attention = eager_attention_forward
    if self.config._attn_implementation != "eager":
        attention = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
    out, _ = attention(self, query, key, value, attention_mask=None, scaling=self.scaling,
                       dropout=0.0, is_causal=False)
    return self.proj(out.reshape(images, patches, width))


class ImageGraph(nn.Module):
    """(images, patches, 1176) pixel patches + rotary tables -> (images, patches/4, text width)."""

    def __init__(self, visual: nn.Module) -> None:
        super().__init__()
        self.visual = visual
        embed = visual.patch_embed
        # Conv3d with kernel == stride over a pre-cut patch is a Linear over (C, T, P, P) values.
        weight = embed.proj.weight.detach().reshape(embed.embed_dim, -1).t().contiguous()
        self.register_buffer("patch_weight", weight, persistent=False)

    @contextlib.contextmanager
    def _batched_attention(self):
        """Swap in the batched attention for one forward; the checkpoint's model stays unpatched,
        so the exporter can still run the reference forward on the very same modules."""
        attns = [block.attn for block in self.visual.blocks]
        for attn in attns:
            attn.forward = types.MethodType(_batched_vision_attention, attn)
        try:
            yield
        finally:
            for attn in attns:
                del attn.forward

    def forward(self, pixel_patches, rotary_cos, rotary_sin):
        images = pixel_patches.shape[0]
        hidden = torch.matmul(pixel_patches, self.patch_weight)
        position_embeddings = (rotary_cos, rotary_sin)
        with self._batched_attention():
            for block in self.visual.blocks:
                hidden = block(hidden, cu_seqlens=None, position_embeddings=position_embeddings)
        merged = self.visual.merger(hidden)  # flattens images: (images * patches/4, text width)
        return merged.reshape(images, -1, merged.shape[-1])


class TextGraph(nn.Module):
    """ids, mask, 3-D positions, image features + their placement -> normalised token embeddings."""

    def __init__(self, retrieval_model: nn.Module) -> None:
        super().__init__()
        self.language_model = retrieval_model.vlm.model.language_model
        self.projection = retrieval_model.embedding_proj_layer

    def forward(self, input_ids, attention_mask, position_ids, image_feature_index, image_features):
        embeds = self.language_model.embed_tokens(input_ids)
        # Row 0 is a placeholder so that a text-only batch (zero feature rows) gathers validly.
        table = torch.cat([image_features.new_zeros(1, image_features.shape[-1]), image_features])
        placed = table[image_feature_index]
        embeds = torch.where((image_feature_index > 0).unsqueeze(-1), placed, embeds)
        hidden = self.language_model(
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            return_dict=True,
        ).last_hidden_state
        proj = self.projection(hidden)
        proj = proj / proj.norm(dim=-1, keepdim=True)
        return proj * attention_mask.unsqueeze(-1).to(proj.dtype)
