"""The two torch modules that become colembed's graphs, built from the checkpoint's own modules.

No third definition of ColQwen2 lives here. `ImageGraph` holds the checkpoint's vision tower and
changes exactly three things for export, all checked against the unpatched tower by `verify.py`:

- the Conv3d patch embedding runs as a MatMul over the 1176 values of a patch (it *is* a Linear;
  quantisers and DirectML see a MatMul),
- `VisionAttention.forward` runs batched over (images, patches) instead of splitting the packed
  sequence by `cu_seqlens` in Python (`.tolist()` would freeze the grid into the graph). Attention is
  full within an image and none across images, as in the reference. The attention itself is one
  custom op, `colembed::full_attention`, which runs as scaled-dot-product attention in torch and is
  exported as onnxruntime's fused `com.microsoft.MultiHeadAttention`: measured on one 2976-patch
  Qwen2-VL-2B layer (16 heads of 80), 0.18 s against 0.25 s for MatMul-Softmax-MatMul, where the
  Softmax alone was a quarter of the image graph's time;
- the rotary on query and key is one custom op too, `colembed::vision_rotary` (the reference's
  `apply_rotary_pos_emb_vision` in torch), exported as onnxruntime's fused
  `com.microsoft.RotaryEmbedding`, and q/k/v are sliced from the fused projection without the
  reference's permute (`qkv_with_rotary`): the layout ops around attention (Split, Transpose,
  Neg, Concat, Mul, Add) were a page's largest cost after attention and the GEMMs; without them a
  letter page runs 1.05x (int8) and 1.03x (fp32) faster (benchmarks/results/embed/embed-against-own.md).

`TextGraph` holds the checkpoint's language model and projection and replaces `masked_scatter` (a
data-dependent op) with a gather driven by a host-made index. Position ids come from the host.
Its attention forward is swapped (`_fused_text_attention`, every family) for the same
projections with the rotary and the attention as two custom ops, exported as onnxruntime's
`com.microsoft.RotaryEmbedding` over per-token tables made once (`per_token_tables`) and
`com.microsoft.GroupQueryAttention` (`causal_attention`: causal, right-padded batches, no
padding mask, the key/value heads not repeated): the eager chain (Transposes, repeated key/value
heads, the boolean mask's Where, Softmax, IsNaN) was over a third of a page's int8 text graph
(what it bought: benchmarks/results/embed/embed-against-own.md, against the release before it).
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn
from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision


@torch.library.custom_op("colembed::full_attention", mutates_args=())
def full_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, num_heads: int, scale: float
) -> torch.Tensor:
    """Non-causal attention over (batch, tokens, heads*head_dim) tensors, no mask."""
    batch, tokens, width = query.shape
    q, k, v = (t.reshape(batch, tokens, num_heads, -1).transpose(1, 2) for t in (query, key, value))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
    return out.transpose(1, 2).reshape(batch, tokens, width)


@full_attention.register_fake
def _(query, key, value, num_heads, scale):
    return torch.empty_like(query)


def _contrib_schema(
    name: str,
    inputs: tuple[str, ...],
    attributes: dict[str, str],
    *,
    outputs: tuple[str, ...] = ("output",),
    optional: tuple[str, ...] = (),
    other_types: dict[str, tuple[str, ...]] | None = None,
):
    """The part of an onnxruntime contrib op's schema we use (onnx's registry does not hold
    them): float inputs "T" unless `other_types` names another constraint for an input;
    `attributes` maps an INT/FLOAT attribute's name to its type's name."""
    from onnx.defs import OpSchema

    other_types = other_types or {}
    option = OpSchema.FormalParameterOption

    def parameter(n: str) -> OpSchema.FormalParameter:
        kind = next((t for t, names in other_types.items() if n in names), "T")
        return OpSchema.FormalParameter(
            n, kind, param_option=option.Optional if n in optional else option.Single
        )

    kinds = {"M": ["tensor(int64)"], "I": ["tensor(int32)"]}
    return OpSchema(
        name,
        "com.microsoft",
        1,
        inputs=[parameter(n) for n in inputs],
        outputs=[OpSchema.FormalParameter(n, "T") for n in outputs],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)"], "float tensors"),
            *((t, kinds[t], t) for t in other_types),
        ],
        attributes=[
            OpSchema.Attribute(a, getattr(OpSchema.AttrType, kind), a)
            for a, kind in attributes.items()
        ],
    )


def _contrib_op(schema):
    import onnxscript

    return onnxscript.values.Op(onnxscript.values.Opset("com.microsoft", 1), schema.name, schema)


def _multi_head_attention_schema():
    return _contrib_schema(
        "MultiHeadAttention", ("query", "key", "value"), {"num_heads": "INT", "scale": "FLOAT"}
    )


def _full_attention_onnx(query, key, value, num_heads: int, scale: float):
    attention = _contrib_op(_multi_head_attention_schema())
    return attention(query, key, value, num_heads=num_heads, scale=scale)


@torch.library.custom_op("colembed::vision_rotary", mutates_args=())
def vision_rotary(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The vision tower's rotary on (batch, tokens, heads*head_dim) query and key, with the
    (tokens, head_dim) tables the host makes: the reference's own `apply_rotary_pos_emb_vision`.

    Exported as onnxruntime's fused `com.microsoft.RotaryEmbedding` (one pass per tensor) instead
    of the reference's rotate_half chain (Split, Neg, Concat, two Muls and an Add per tensor;
    the module docstring has what it saves a page). The fused op
    takes half tables: every family's vision tables are cat(freqs, freqs) (the reference builds
    them so; `colembed.preprocess.positions.vision_rotary_tables` too), so their first halves
    hold all of it. Position ids are one offset, 0: token t reads row t of the tables.
    """
    batch, tokens, width = query.shape
    q, k = (t.reshape(batch, tokens, num_heads, -1) for t in (query, key))
    q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
    return q.reshape(batch, tokens, width), k.reshape(batch, tokens, width)


@vision_rotary.register_fake
def _(query, key, cos, sin, num_heads):
    return torch.empty_like(query), torch.empty_like(key)


def _rotary_embedding_schema():
    return _contrib_schema(
        "RotaryEmbedding",
        ("input", "position_ids", "cos_cache", "sin_cache"),
        {"num_heads": "INT", "interleaved": "INT"},
        other_types={"M": ("position_ids",)},
    )


def _vision_rotary_onnx(query, key, cos, sin, num_heads: int):
    from onnxscript import opset18 as op

    rotary = _contrib_op(_rotary_embedding_schema())
    half = op.Div(op.Shape(cos, start=-1), op.Constant(value_ints=[2]))
    zero, last = op.Constant(value_ints=[0]), op.Constant(value_ints=[-1])
    cos_half, sin_half = (op.Slice(t, zero, half, last) for t in (cos, sin))
    return tuple(
        rotary(t, zero, cos_half, sin_half, num_heads=num_heads, interleaved=0)
        for t in (query, key)
    )


@torch.library.custom_op("colembed::text_rotary", mutates_args=())
def text_rotary(
    query: torch.Tensor,
    key: torch.Tensor,
    cos_half: torch.Tensor,
    sin_half: torch.Tensor,
    positions: torch.Tensor,
    num_heads: int,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The language model's rotary on (batch, tokens, heads*head_dim) query and key.

    `cos_half` / `sin_half` are (batch*tokens, head_dim/2): each token's own table row (the
    multimodal rotary gives every token its own angles, so the "cache" holds one row per token,
    `positions` (batch, tokens) = arange(batch*tokens) reads row t for token t) and only its
    first half: every family's text tables are cat(freqs, freqs) (Qwen2-VL's mrope sections are
    doubled the same way, `per_token_tables`), so the halves are equal. In torch it is the
    reference's own rotate_half rotary over the full rows; exported it is onnxruntime's fused
    `com.microsoft.RotaryEmbedding` over the rank-3 input DirectML's kernel reads.
    """
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    batch, tokens, _ = query.shape
    rows = positions.reshape(-1)
    cos = torch.cat([cos_half, cos_half], dim=-1)[rows].reshape(batch, tokens, -1)
    sin = torch.cat([sin_half, sin_half], dim=-1)[rows].reshape(batch, tokens, -1)
    q = query.reshape(batch, tokens, num_heads, -1)
    k = key.reshape(batch, tokens, kv_heads, -1)
    q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    return q.reshape(query.shape), k.reshape(key.shape)


@text_rotary.register_fake
def _(query, key, cos_half, sin_half, positions, num_heads, kv_heads):
    return torch.empty_like(query), torch.empty_like(key)


def _text_rotary_onnx(query, key, cos_half, sin_half, positions, num_heads: int, kv_heads: int):
    rotary = _contrib_op(_rotary_embedding_schema())
    return (
        rotary(query, positions, cos_half, sin_half, num_heads=num_heads, interleaved=0),
        rotary(key, positions, cos_half, sin_half, num_heads=kv_heads, interleaved=0),
    )


@torch.library.custom_op("colembed::causal_attention", mutates_args=())
def causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    num_heads: int,
    kv_heads: int,
    scale: float,
) -> torch.Tensor:
    """Causal grouped-query attention over (batch, tokens, heads*head_dim) query and
    (batch, tokens, kv_heads*head_dim) key and value, with no padding mask: the batch must be
    right-padded, as colembed's tokenizer pads (preprocess/text.py `pad_batch`). Then a real
    token never sees a padded one (they all come after it), so its row is the reference's
    (causal + padding mask) exactly; a padded token attends to everything before it and stays
    finite (its rows are zeroed at the graph's end).

    Exported as onnxruntime's `com.microsoft.GroupQueryAttention` for a first prompt (no cache),
    every item's `seqlens_k` the full length - 1: the form its CPU kernel computes every row of
    (with a shorter `seqlens_k` the CPU kernel leaves padded rows' softmax reading unwritten
    memory) and the one DirectML's kernel computes in any case (it ignores `seqlens_k` on a
    prompt: DmlOperatorGroupQueryAttention.cpp at onnxruntime@735e69a). It replaces the eager
    chain (module docstring).
    """
    batch, tokens, _ = query.shape
    q = query.reshape(batch, tokens, num_heads, -1).transpose(1, 2)
    k, v = (
        t.reshape(batch, tokens, kv_heads, -1)
        .transpose(1, 2)
        .repeat_interleave(num_heads // kv_heads, dim=1)
        for t in (key, value)
    )
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out.transpose(1, 2).reshape(batch, tokens, -1)


@causal_attention.register_fake
def _(query, key, value, num_heads, kv_heads, scale):
    return torch.empty_like(query)


def _group_query_attention_schema():
    return _contrib_schema(
        "GroupQueryAttention",
        ("query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"),
        {"num_heads": "INT", "kv_num_heads": "INT", "scale": "FLOAT"},
        outputs=("output", "present_key", "present_value"),
        optional=("past_key", "past_value"),
        other_types={"I": ("seqlens_k", "total_sequence_length")},
    )


def _causal_attention_onnx(query, key, value, num_heads: int, kv_heads: int, scale: float):
    from onnxscript import INT32
    from onnxscript import opset18 as op

    attention = _contrib_op(_group_query_attention_schema())
    tokens = op.Shape(query, start=1, end=2)  # (1,) int64
    last = op.Cast(
        op.Expand(op.Sub(tokens, op.Constant(value_ints=[1])), op.Shape(query, start=0, end=1)),
        to=INT32.dtype,
    )
    total = op.Cast(op.Squeeze(tokens), to=INT32.dtype)
    out, _, _ = attention(
        query,
        key,
        value,
        None,
        None,
        last,
        total,
        num_heads=num_heads,
        kv_num_heads=kv_heads,
        scale=scale,
    )
    return out


# torch op -> ONNX translation, handed to `torch.onnx.export(custom_translation_table=...)`.
ONNX_TRANSLATIONS = {
    torch.ops.colembed.full_attention.default: _full_attention_onnx,
    torch.ops.colembed.vision_rotary.default: _vision_rotary_onnx,
    torch.ops.colembed.text_rotary.default: _text_rotary_onnx,
    torch.ops.colembed.causal_attention.default: _causal_attention_onnx,
}


def qkv_with_rotary(
    attn: nn.Module, hidden_states: torch.Tensor, position_embeddings
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A vision attention's query, key and value, each (images, patches, heads * head_dim), the
    rotary applied to query and key by `vision_rotary`.

    The reference reshapes the fused qkv output to (.., 3, heads, head_dim) and permutes before
    unbinding, which exports as a Split plus one Transpose copy per tensor; its channels are
    ordered (3, heads, head_dim), so three slices of the last axis are the same tensors, one Split.
    """
    query, key, value = attn.qkv(hidden_states).chunk(3, dim=-1)
    cos, sin = position_embeddings
    query, key = vision_rotary(query, key, cos, sin, attn.num_heads)
    return query, key, value


def _batched_vision_attention(
    self, hidden_states: torch.Tensor, position_embeddings=None, **_: object
) -> torch.Tensor:
    """`VisionAttention.forward` over (images, patches, width): one attention per image.

    Same weights, rotary and attention math as the reference; only the packing and the fused
    rotary and attention kernels differ (checked against the unpatched tower before anything is
    written).
    """
    query, key, value = qkv_with_rotary(self, hidden_states, position_embeddings)
    out = full_attention(query, key, value, self.num_heads, float(self.scaling))
    return self.proj(out)


class ImageGraph(nn.Module):
    """(images, patches, 1176) pixel patches + rotary tables -> (images, patches/4, text width)."""

    def __init__(self, visual: nn.Module) -> None:
        super().__init__()
        self.visual = visual
        embed = visual.patch_embed
        # Conv3d with kernel == stride over a pre-cut patch is a Linear over (C, T, P, P) values.
        weight = embed.proj.weight.detach().reshape(embed.embed_dim, -1).t().contiguous()
        self.register_buffer("patch_weight", weight, persistent=False)

    @classmethod
    def of_model(cls, retrieval_model: nn.Module) -> "ImageGraph":
        return cls(retrieval_model.vlm.model.visual)

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


def per_token_tables(
    cos: torch.Tensor, sin: torch.Tensor, mrope_section: list[int] | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The text rotary embedding's (cos, sin) -> what `text_rotary` takes: (batch*tokens,
    head_dim/2) half tables and (batch, tokens) row positions, made once for all layers.

    Qwen3-VL's rotary embedding returns per-token (batch, tokens, head_dim) tables already (its
    interleaved mrope is inside it); Qwen2-VL's and Qwen2.5-VL's return one table per position
    axis, (3, batch, tokens, head_dim), and the attention picks each head-dim section's axis
    (`apply_multimodal_rotary_pos_emb`'s first two lines, the sections doubled for the two
    halves): done here once instead of in every layer.
    """
    if cos.dim() == 4:
        if mrope_section is None:
            raise ValueError("per-axis rotary tables without the config's mrope_section")
        sections = list(mrope_section) * 2
        cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(sections, dim=-1))], dim=-1)
        sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(sections, dim=-1))], dim=-1)
    batch, tokens, width = cos.shape
    half = width // 2
    positions = torch.arange(batch * tokens, device=cos.device).reshape(batch, tokens)
    rows = batch * tokens
    return cos.reshape(rows, width)[:, :half], sin.reshape(rows, width)[:, :half], positions


def _fused_text_attention(self, hidden_states: torch.Tensor, position_embeddings=None, **_: object):
    """The text attention's forward (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) with fused kernels: the
    checkpoint's own q/k/v/o projections and, where the family has them (Qwen3-VL), its per-head
    q/k norms; the rotary and the attention as `text_rotary` and `causal_attention`, with no
    (batch, heads, tokens, head_dim) layout in between. `position_embeddings` is what
    `per_token_tables` made; batches are right-padded (see `causal_attention`)."""
    if getattr(self, "sliding_window", None) is not None:
        raise ValueError(
            "sliding-window text attention is not exported (the configs of this "
            "family do not use it)"
        )
    batch, tokens, _ = hidden_states.shape
    heads, kv_heads = self.config.num_attention_heads, self.config.num_key_value_heads
    query, key, value = (
        self.q_proj(hidden_states),
        self.k_proj(hidden_states),
        self.v_proj(hidden_states),
    )
    if hasattr(self, "q_norm"):  # per head, over head_dim
        query = self.q_norm(query.reshape(batch, tokens, heads, -1)).reshape(query.shape)
        key = self.k_norm(key.reshape(batch, tokens, kv_heads, -1)).reshape(key.shape)
    query, key = text_rotary(query, key, *position_embeddings, heads, kv_heads)
    out = causal_attention(query, key, value, heads, kv_heads, float(self.scaling))
    return self.o_proj(out), None


class TextGraph(nn.Module):
    """ids, mask, 3-D positions, image features + their placement -> normalised token embeddings."""

    def __init__(self, retrieval_model: nn.Module) -> None:
        super().__init__()
        self.language_model = retrieval_model.vlm.model.language_model
        self.projection = retrieval_model.embedding_proj_layer

    @contextlib.contextmanager
    def fused_attention(self):
        """Swap in the fused text attention (`_fused_text_attention`) and the per-token rotary
        tables for one forward; the checkpoint's model stays unpatched, so the exporter can
        still run the reference forward on the very same modules."""
        model = self.language_model
        rotary = model.rotary_emb
        reference_rotary = rotary.forward
        mrope_section = (getattr(model.config, "rope_scaling", None) or {}).get("mrope_section")

        def tables(x, position_ids):
            return per_token_tables(*reference_rotary(x, position_ids), mrope_section)

        attns = [layer.self_attn for layer in model.layers]
        rotary.forward = tables
        for attn in attns:
            attn.forward = types.MethodType(_fused_text_attention, attn)
        try:
            yield
        finally:
            del rotary.forward
            for attn in attns:
                del attn.forward

    def hidden_states(self, embeds, attention_mask, position_ids, **extra_inputs):
        """The language model's last hidden state over `embeds`, without a cache; `extra_inputs`
        (a family's additional inputs) are passed to it as they are."""
        return self.language_model(
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            return_dict=True,
            **extra_inputs,
        ).last_hidden_state

    def normalised_embeddings(self, hidden, attention_mask):
        """Each token's projection, L2-normalised, and zero where the mask is 0 (padding)."""
        proj = self.projection(hidden)
        proj = proj / proj.norm(dim=-1, keepdim=True)
        return proj * attention_mask.unsqueeze(-1).to(proj.dtype)

    def forward(self, input_ids, attention_mask, position_ids, image_feature_index, image_features):
        embeds = self.language_model.embed_tokens(input_ids)
        placed = place_rows(image_features, image_feature_index)
        embeds = torch.where((image_feature_index > 0).unsqueeze(-1), placed, embeds)
        with self.fused_attention():
            hidden = self.hidden_states(embeds, attention_mask, position_ids)
        return self.normalised_embeddings(hidden, attention_mask)


def place_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows[index - 1] per token, zeros where index is 0 (row 0 is a placeholder, so a text-only
    batch with zero rows gathers validly)."""
    table = torch.cat([rows.new_zeros(1, rows.shape[-1]), rows])
    return table[index]


def example_grid(preprocess, attention) -> tuple[int, int, int]:
    """The grid traced for the image graph, in patches. Full attention: (2m x 3m), no axis of size
    1. Windowed: two whole windows and a partial one in a row (e.g. 3 windows of <= 16 slots over
    40 patches for 4x4-patch windows), so windows, slots, patches and merged tokens all differ and
    the exporter cannot tie one symbolic size to another."""
    from colembed.families import FULL
    from colembed.preprocess.windows import merged_window_side

    merge = preprocess.merge_size
    if attention.kind == FULL:
        return (1, 2 * merge, 3 * merge)
    side = merge * merged_window_side(
        window_size=attention.window_size, merge_size=merge, patch_size=preprocess.patch_size
    )
    return (1, side, 2 * side + merge)


def example_vision_inputs(preprocess, attention, images: int = 2, extras=None) -> tuple:
    """Example image-graph inputs in contract order: pixels and rotary tables (random; only shapes
    matter) and the family's extra per-grid inputs (window layout, position-table interpolation),
    made by the host code the runtime runs."""
    from colembed.contracts import vision_contract

    grid = example_grid(preprocess, attention)
    patches = grid[0] * grid[1] * grid[2]
    head_dim = preprocess.vision_head_dim
    extra = attention.grid_inputs(
        grid, merge_size=preprocess.merge_size, patch_size=preprocess.patch_size
    )
    specs = vision_contract(preprocess.patch_dim, head_dim, 1).inputs + attention.extra_inputs
    if extras is not None:
        from colembed.preprocess.vision_positions import POSITION_INPUTS

        extra = (*extra, *extras.grid_inputs(grid, merge_size=preprocess.merge_size))
        specs = specs + POSITION_INPUTS
    args = (
        torch.randn(images, patches, preprocess.patch_dim),
        torch.randn(patches, head_dim),
        torch.randn(patches, head_dim),
        *(torch.from_numpy(array) for array in extra),
    )
    sizes = {"merged_tokens": {patches // preprocess.merge_size**2}}
    for spec, arg in zip(specs, args):
        for dim, size in zip(spec.dims, arg.shape):
            if isinstance(dim, str):
                sizes.setdefault(dim, set()).add(int(size))
    values = [size for found in sizes.values() for size in found]
    if len(set(values)) != len(sizes) or len(values) != len(sizes) or 1 in values:
        raise ValueError(f"example grid {grid} ties symbolic sizes: {sizes}")
    return args


def example_inputs(model: nn.Module, preprocess, attention, extras=None) -> dict[str, tuple]:
    """Small example tensors for tracing, by role (shapes only matter; all axes are dynamic).
    With vision extras (ColQwen3) the text graph also takes (layers, 3, hidden) DeepStack rows."""
    hidden = model.config.vlm_config.text_config.hidden_size
    ids = torch.full((2, 7), preprocess.pad_token_id, dtype=torch.long)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0).unsqueeze(0).expand(3, -1, -1).contiguous()
    index = torch.zeros(2, 7, dtype=torch.long)
    index[0, 2:5] = torch.arange(1, 4)
    text_args = (ids, mask, positions, index, torch.randn(3, hidden))
    if extras is not None and extras.deepstack_layers:
        text_args += (torch.randn(extras.deepstack_layers, 3, hidden),)
    return {
        "vision": example_vision_inputs(preprocess, attention, extras=extras),
        "text": text_args,
    }
