"""ColQwen3.5's text side as colembed's own torch modules: the Qwen3.5 language model, the
projection, L2 normalisation and the mask, exportable to standard ONNX ops.

It computes what colpali-engine 0.3.18's `ColQwen3_5` computes on transformers 5.24 after the
image features are placed (the pinned reference, docs/reference-colqwen3_5.md): the export
environment's transformers (4.57.1) has no Qwen3.5, so the layers are written here, with the
reference's parameter names, so its state dict loads as it is.

API (what the family wiring uses):

- `ColQwen3_5Text.from_state_dict(config, state_dict)`: `config` is the checkpoint's config.json
  (a dict holding `text_config`, or the text config itself); `state_dict` holds the keys
  `ColQwen3_5.save_pretrained` writes, `language_model.*` and `custom_text_proj.*` (no `model.`
  prefix); other keys (`visual.*`) are ignored, a missing or unexpected text key is an error
  naming them all. Every width, the layer types and the rotary layout come from `config`; the
  output width from `custom_text_proj` (checked against `config["dim"]` when it is given).
- `ColQwen3_5Text.forward(input_ids=None, attention_mask=..., position_ids=None,
  inputs_embeds=None)`: ids (B, L) int64 or embeddings (B, L, hidden) float32; mask (B, L) 1s then
  0s per row (right padding); positions (3, B, L) int64 (temporal, height, width; text tokens
  carry the same position on all three), `None` for text-only right-padded rows (0, 1, 2, ...).
  Returns (B, L, dim) float32: unit vectors on real tokens, zeros on padding.
- `ColQwen3_5TextGraph(model)`: the same stack behind colembed's text-graph contract
  (`colembed.contracts.text_contract`: ids, mask, positions, image-feature index, image
  features), so image features enter where the host's index places them.
- `export_text_graph(model, path)`: that graph written with `graphs.onnx_io.export_graph`.

The layers, in the reference's order and arithmetic:

- zero-centred RMS norms: x (float32) * rsqrt(mean x^2 + eps) * (1 + w), cast back;
- decoder layers per `layer_types`: `linear_attention` is `delta_net.GatedDeltaNet`;
  `full_attention` is Qwen3.5's attention: `q_proj` gives each head's query and an output gate,
  q and k RMS-normed per head, rotary on the first `partial_rotary_factor` of each head with
  interleaved multimodal frequencies (`mrope_section`: frequency i takes its angle from the
  height positions where i % 3 == 1 and i < 3 * section[1], from the width positions where
  i % 3 == 2 and i < 3 * section[2], from the temporal ones otherwise), grouped KV heads, softmax
  in float32, times sigmoid(gate), `o_proj`;
- the SiLU-gated MLP, the final norm, `custom_text_proj`, L2 normalisation, times the mask.

Deliberate differences in form: the reference pads on the left and masks padding keys; these
modules take right padding and mask padding keys as well as later tokens, so a real token sees
exactly the real tokens before it either way (the linear-attention layers zero padding rows, which
makes the side irrelevant to them: docs/reference-colqwen3_5.md). A masked score is replaced by
the dtype's lowest value (not -inf), so an all-padding row stays finite. Attention is plain
MatMul/Softmax, not a fused kernel.

Imports torch; never imported by `colembed`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .delta_net import SCAN_LEVELS, GatedDeltaNet

LINEAR, FULL = "linear_attention", "full_attention"
PREFIXES = ("language_model.", "custom_text_proj.")
# The text config's fields these modules read (`head_dim` may be absent: hidden / heads, as the
# reference derives it).
REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "layer_types",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def text_config_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """The text config of a ColQwen3.5 config.json (its `text_config`), or `config` itself;
    refuses one that lacks a field these modules read, naming them all."""
    text = dict(config.get("text_config") or config)
    missing = [name for name in REQUIRED if text.get(name) is None]
    if missing:
        raise ValueError(f"the text config has no {', '.join(missing)}")
    return text


def rope_settings(text_config: Mapping[str, Any]) -> tuple[float, float, list[int]]:
    """(theta, partial rotary factor, mrope section) of a text config: transformers 5.x's
    `rope_parameters`, or the older top-level `rope_theta` / `partial_rotary_factor` with
    `rope_scaling`. Only the default rope type is the reference's here."""
    params = dict(text_config.get("rope_parameters") or {})
    legacy = dict(text_config.get("rope_scaling") or {})
    rope_type = params.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
    if rope_type != "default":
        raise ValueError(f"rope type {rope_type!r}: only 'default' (M-RoPE) is supported")
    theta = params.get("rope_theta", text_config.get("rope_theta"))
    factor = params.get("partial_rotary_factor", text_config.get("partial_rotary_factor"))
    section = params.get("mrope_section", legacy.get("mrope_section"))
    found = {"rope_theta": theta, "partial_rotary_factor": factor, "mrope_section": section}
    missing = [name for name, value in found.items() if value is None]
    if missing:
        raise ValueError(f"the text config has no {', '.join(missing)}")
    return float(theta), float(factor), [int(s) for s in section]


class ZeroCentredRMSNorm(nn.Module):
    """`Qwen3_5RMSNorm`: the weight is stored centred on zero and applied as (1 + w)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class MultimodalRotary(nn.Module):
    """cos/sin tables (B, L, rotary dim) from (3, B, L) positions, interleaved per frequency."""

    def __init__(self, head_dim: int, theta: float, factor: float, section: list[int]) -> None:
        super().__init__()
        dim = int(head_dim * factor)
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        if len(section) != 3 or sum(section) != inv_freq.numel():
            raise ValueError(
                f"mrope_section {section} must be 3 numbers summing to {inv_freq.numel()} "
                f"(half the rotary width, head_dim {head_dim} x {factor})"
            )
        index = torch.arange(inv_freq.numel())
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer(
            "from_h", (index % 3 == 1) & (index < 3 * section[1]), persistent=False
        )
        self.register_buffer(
            "from_w", (index % 3 == 2) & (index < 3 * section[2]), persistent=False
        )

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq  # (3, B, L, F)
        tables = []
        for table in (freqs.cos(), freqs.sin()):
            picked = torch.where(self.from_w, table[2], table[0])
            picked = torch.where(self.from_h, table[1], picked)
            tables.append(torch.cat([picked, picked], dim=-1))
        return tables[0], tables[1]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on the first cos.shape[-1] channels of x (B, H, L, head_dim); the rest pass."""
    width = cos.shape[-1]
    rotated, passed = x[..., :width], x[..., width:]
    rotated = rotated * cos + _rotate_half(rotated) * sin
    return torch.cat([rotated, passed], dim=-1)


class FullAttention(nn.Module):
    """`Qwen3_5Attention` without a cache: gated output, q/k norms, partial M-RoPE, GQA."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, bias = config["hidden_size"], bool(config.get("attention_bias", False))
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        if self.heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.heads}) is not a multiple of "
                f"num_key_value_heads ({self.kv_heads})"
            )
        self.head_dim = config.get("head_dim") or hidden // self.heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, config["rms_norm_eps"])
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, config["rms_norm_eps"])

    def forward(self, hidden, cos, sin, allowed):
        """hidden (B, L, D), cos/sin (B, L, rotary), allowed (B, 1, L, L) bool -> (B, L, D)."""
        batch, length, _ = hidden.shape
        query, gate = torch.chunk(
            self.q_proj(hidden).reshape(batch, length, self.heads, 2 * self.head_dim), 2, dim=-1
        )
        gate = gate.reshape(batch, length, -1)
        query = self.q_norm(query).transpose(1, 2)  # (B, H, L, hd)
        key = self.k_proj(hidden).reshape(batch, length, self.kv_heads, self.head_dim)
        key = self.k_norm(key).transpose(1, 2)  # (B, KV, L, hd)
        value = self.v_proj(hidden).reshape(batch, length, self.kv_heads, self.head_dim)
        value = value.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        query, key = _apply_rotary(query, cos, sin), _apply_rotary(key, cos, sin)
        groups = self.heads // self.kv_heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        scores = torch.matmul(query, key.transpose(2, 3)) * self.scaling
        scores = torch.where(allowed, scores, torch.finfo(scores.dtype).min)
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.matmul(weights, value).transpose(1, 2).reshape(batch, length, -1)
        return self.o_proj(out * torch.sigmoid(gate))


class MLP(nn.Module):
    """`Qwen3_5MLP`: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        if act != "silu":
            raise ValueError(f"hidden_act {act!r}: Qwen3.5's MLP is 'silu'")
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """`Qwen3_5DecoderLayer`: pre-norm token mixer (linear or full attention) and MLP."""

    def __init__(self, config: Mapping[str, Any], kind: str, scan_levels: int) -> None:
        super().__init__()
        self.kind = kind
        if kind == LINEAR:
            self.linear_attn = GatedDeltaNet.from_config(config, scan_levels)
        elif kind == FULL:
            self.self_attn = FullAttention(config)
        else:
            raise ValueError(f"layer type {kind!r}: expected {LINEAR!r} or {FULL!r}")
        hidden, eps = config["hidden_size"], config["rms_norm_eps"]
        self.mlp = MLP(hidden, config["intermediate_size"], config.get("hidden_act", "silu"))
        self.input_layernorm = ZeroCentredRMSNorm(hidden, eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(hidden, eps)

    def forward(self, hidden, attention_mask, cos, sin, allowed):
        normed = self.input_layernorm(hidden)
        if self.kind == LINEAR:
            hidden = hidden + self.linear_attn(normed, attention_mask)
        else:
            hidden = hidden + self.self_attn(normed, cos, sin, allowed)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LanguageModel(nn.Module):
    """`Qwen3_5TextModel` without a cache: embeddings, decoder layers, final norm."""

    def __init__(self, config: Mapping[str, Any], scan_levels: int = SCAN_LEVELS) -> None:
        super().__init__()
        config = text_config_of(config)
        layer_types = list(config["layer_types"])
        if len(layer_types) != config["num_hidden_layers"]:
            raise ValueError(
                f"layer_types names {len(layer_types)} layers, "
                f"num_hidden_layers is {config['num_hidden_layers']}"
            )
        hidden = config["hidden_size"]
        self.embed_tokens = nn.Embedding(config["vocab_size"], hidden)
        self.layers = nn.ModuleList(DecoderLayer(config, k, scan_levels) for k in layer_types)
        self.norm = ZeroCentredRMSNorm(hidden, config["rms_norm_eps"])
        theta, factor, section = rope_settings(config)
        head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
        self.rotary = MultimodalRotary(head_dim, theta, factor, section)

    def forward(self, embeds, attention_mask, position_ids):
        length = embeds.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=embeds.device).tril()
        allowed = causal[None, None] & attention_mask.bool()[:, None, None, :]  # (B, 1, L, L)
        cos, sin = self.rotary(position_ids)
        hidden = embeds
        for layer in self.layers:
            hidden = layer(hidden, attention_mask, cos, sin, allowed)
        return self.norm(hidden)


class ColQwen3_5Text(nn.Module):
    """The text path of `ColQwen3_5`: language model, `custom_text_proj`, unit vectors, mask."""

    def __init__(self, config: Mapping[str, Any], dim: int, scan_levels: int = SCAN_LEVELS):
        super().__init__()
        text = text_config_of(config)
        self.language_model = LanguageModel(text, scan_levels)
        self.custom_text_proj = nn.Linear(text["hidden_size"], dim)
        self.hidden_size, self.dim = text["hidden_size"], dim

    @classmethod
    def from_state_dict(
        cls,
        config: Mapping[str, Any],
        state_dict: Mapping[str, torch.Tensor],
        scan_levels: int = SCAN_LEVELS,
    ) -> ColQwen3_5Text:
        """Built from the checkpoint's config and its (ColQwen3_5.save_pretrained) state dict."""
        text = {k: v for k, v in state_dict.items() if k.startswith(PREFIXES)}
        if "custom_text_proj.weight" not in text:
            raise KeyError(
                "no custom_text_proj.weight: expected ColQwen3_5.save_pretrained's keys "
                f"({', '.join(p + '*' for p in PREFIXES)}); found e.g. {sorted(state_dict)[:5]}"
            )
        dim = int(text["custom_text_proj.weight"].shape[0])
        if config.get("dim") is not None and int(config["dim"]) != dim:
            raise ValueError(f"config dim {config['dim']} but custom_text_proj gives {dim}")
        model = cls(config, dim, scan_levels)
        expected = set(model.state_dict())
        missing, unexpected = sorted(expected - set(text)), sorted(set(text) - expected)
        if missing or unexpected:
            raise KeyError(f"state dict does not match: missing {missing}, unexpected {unexpected}")
        model.load_state_dict({k: v.to(torch.float32) for k, v in text.items()}, strict=True)
        return model.eval()

    def text_positions(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """(3, B, L) positions of right-padded text rows: 0, 1, 2, ... on every axis."""
        batch, length = attention_mask.shape
        positions = torch.arange(length, device=attention_mask.device)
        return positions.expand(3, batch, length)

    def embed(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """`custom_text_proj`, L2-normalised, times the mask: colpali-engine's head."""
        proj = self.custom_text_proj(hidden)
        proj = proj / proj.norm(dim=-1, keepdim=True)
        return proj * attention_mask.unsqueeze(-1).to(proj.dtype)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.language_model.embed_tokens(input_ids)
        if attention_mask is None:
            attention_mask = torch.ones(inputs_embeds.shape[:2], dtype=torch.int64)
        if position_ids is None:
            position_ids = self.text_positions(attention_mask)
        hidden = self.language_model(inputs_embeds, attention_mask, position_ids)
        return self.embed(hidden, attention_mask)


def place_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows[index - 1] per token, zeros where index is 0 (row 0 is a placeholder, so a text-only
    batch with zero rows gathers validly): the text contract's placement."""
    table = torch.cat([rows.new_zeros(1, rows.shape[-1]), rows])
    return table[index]


class ColQwen3_5TextGraph(nn.Module):
    """`ColQwen3_5Text` behind `colembed.contracts.text_contract`: ids, mask, (3, B, L) positions,
    image-feature index (B, L) and features (rows, hidden) -> (B, L, dim) embeddings."""

    def __init__(self, model: ColQwen3_5Text) -> None:
        super().__init__()
        self.model = model

    def contract(self):
        from colembed.contracts import text_contract

        return text_contract(self.model.hidden_size, self.model.dim)

    def forward(self, input_ids, attention_mask, position_ids, image_feature_index, image_features):
        embeds = self.model.language_model.embed_tokens(input_ids)
        placed = place_rows(image_features, image_feature_index)
        embeds = torch.where((image_feature_index > 0).unsqueeze(-1), placed, embeds)
        return self.model(
            attention_mask=attention_mask, position_ids=position_ids, inputs_embeds=embeds
        )

    def example_inputs(self, batch: int = 2, length: int = 300, rows: int = 5) -> tuple:
        """Tracing inputs in contract order. The length spans two groups of DeltaNet chunks, and
        no two symbolic sizes are equal or 1, so torch.export ties none of them together."""
        ids = torch.randint(
            0, self.model.language_model.embed_tokens.num_embeddings, (batch, length)
        )
        mask = torch.ones(batch, length, dtype=torch.int64)
        positions = torch.arange(length).expand(3, batch, length).contiguous()
        index = torch.zeros(batch, length, dtype=torch.int64)
        index[0, 1 : rows + 1] = torch.arange(1, rows + 1)
        features = torch.randn(rows, self.model.hidden_size)
        return ids, mask, positions, index, features


def export_text_graph(model: ColQwen3_5Text, path: str | Path, **options) -> dict[str, Any]:
    """`ColQwen3_5TextGraph(model)` exported to `path` per the text contract
    (`graphs.onnx_io.export_graph`, whose keyword options pass through)."""
    from ...graphs.onnx_io import export_graph

    graph = ColQwen3_5TextGraph(model).eval()
    with torch.no_grad():
        return export_graph(graph, graph.example_inputs(), graph.contract(), Path(path), **options)


__all__ = ["ColQwen3_5Text", "ColQwen3_5TextGraph", "export_text_graph", "text_config_of"]
