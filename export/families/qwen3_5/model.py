"""A ColQwen3.5 checkpoint as one torch module the exporter's shared steps take: the vision tower
(`checkpoint.load_vision_tower`: 4.57.1's Qwen3-VL tower without DeepStack) and colembed's own
text stack (`text.ColQwen3_5Text`: the Qwen3.5 language model, the projection, L2 normalisation,
times the mask), joined as colpali-engine 0.3.18's `ColQwen3_5.forward` joins them on
transformers 5.24 (docs/reference-colqwen3_5.md):

- the tower's merged features replace the embeddings of the image-pad tokens, in order;
- the 3-D multimodal positions are Qwen-VL's (4.57.1's `Qwen3VLModel.get_rope_index`, which
  gives 5.24's positions for images: docs/reference-colqwen3.md), text-only rows 0, 1, 2, ...

It is shaped like transformers' `ColQwen2ForRetrieval` where the exporter reads it
(`vlm.model.visual`, `config.vlm_config.text_config` / `.vision_config`, `config.embedding_dim`,
`forward(...).embeddings`) and is the torch model the export check compares the graphs with.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping

from colembed.errors import ExportError

from .checkpoint import (
    Qwen3_5Checkpoint,
    build_vision_tower,
    load_vision_tower,
    read_checkpoint,
)

# Where each part of the checkpoint sits in the retrieval module: the prefix of its parameters'
# names (the checkpoint's own keys have no `model.` prefix: checkpoint.py).
MODULE_PREFIXES = {
    "visual": "vlm.model.visual.",
    "language_model": "text.language_model.",
    "projection": "text.custom_text_proj.",
}


def text_config_view(checkpoint: Qwen3_5Checkpoint) -> SimpleNamespace:
    """The language model's numbers under the names the manifest's `architecture` reads
    (`checkpoint.architecture_facts`): 5.x's `rope_parameters` as `rope_theta` and an
    `rope_scaling.mrope_section`."""
    text = checkpoint.text_config
    params = text.get("rope_parameters")
    where = checkpoint.folder / "config.json"
    if not isinstance(params, Mapping) or "mrope_section" not in params:
        raise ExportError(f"{where}: text_config.rope_parameters lacks mrope_section")
    if params.get("mrope_interleaved", True) is not True:
        raise ExportError(f"{where}: Qwen3.5's M-RoPE is interleaved; mrope_interleaved=false")
    try:
        return SimpleNamespace(
            hidden_size=int(text["hidden_size"]),
            num_hidden_layers=int(text["num_hidden_layers"]),
            num_attention_heads=int(text["num_attention_heads"]),
            head_dim=int(text["head_dim"]),
            num_key_value_heads=int(text["num_key_value_heads"]),
            intermediate_size=int(text["intermediate_size"]),
            rope_scaling={"mrope_section": list(params["mrope_section"])},
            rope_theta=float(params["rope_theta"]),
            vocab_size=int(text["vocab_size"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"{where}: text_config lacks or misstates {e}") from e


def mrope_positions(input_ids, attention_mask, image_grid_thw, checkpoint: Qwen3_5Checkpoint):
    """(3, B, L) positions by 4.57.1's `Qwen3VLModel.get_rope_index` (the config's token ids
    and merge size; no video)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    config = checkpoint.config
    holder = SimpleNamespace(
        config=SimpleNamespace(
            vision_config=SimpleNamespace(
                spatial_merge_size=int(checkpoint.vision_config["spatial_merge_size"])
            ),
            image_token_id=int(config["image_token_id"]),
            video_token_id=int(config["video_token_id"]),
            vision_start_token_id=int(config["vision_start_token_id"]),
        )
    )
    positions, _ = Qwen3VLModel.get_rope_index(
        holder, input_ids, image_grid_thw, None, attention_mask
    )
    return positions


def retrieval_module(checkpoint: Qwen3_5Checkpoint, tower, text):
    """The tower and the text stack as one retrieval module (module docstring)."""
    import torch
    from torch import nn

    image_token_id = int(checkpoint.config["image_token_id"])

    class ColQwen3_5Retrieval(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vlm = nn.Module()
            self.vlm.model = nn.Module()
            self.vlm.model.visual = tower
            self.text = text
            self.config = SimpleNamespace(
                vlm_config=SimpleNamespace(
                    text_config=text_config_view(checkpoint), vision_config=tower.config
                ),
                embedding_dim=checkpoint.embedding_dim,
            )

        def forward(
            self, input_ids, attention_mask, pixel_values=None, image_grid_thw=None, **_: Any
        ):
            embeds = self.text.language_model.embed_tokens(input_ids)
            if pixel_values is not None:
                if pixel_values.ndim == 3:  # processor-padded batch (colpali-engine's)
                    offsets = image_grid_thw[:, 1] * image_grid_thw[:, 2]
                    pixel_values = torch.cat([p[:n] for p, n in zip(pixel_values, offsets)])
                features = self.vlm.model.visual(pixel_values, grid_thw=image_grid_thw)[0]
                slots = input_ids == image_token_id
                if int(slots.sum()) != features.shape[0]:
                    raise ExportError(
                        f"{int(slots.sum())} image tokens for {features.shape[0]} features"
                    )
                embeds = embeds.masked_scatter(slots.unsqueeze(-1), features.to(embeds.dtype))
            positions = mrope_positions(input_ids, attention_mask, image_grid_thw, checkpoint)
            embeddings = self.text(
                attention_mask=attention_mask, position_ids=positions, inputs_embeds=embeds
            )
            return SimpleNamespace(embeddings=embeddings)

    return ColQwen3_5Retrieval().eval()


def load_colqwen3_5(folder: str | Path):
    """The checkpoint as a strict fp32 retrieval module: every tensor the layout names is read
    into the tower, the text stack or the projection, none missing or left over."""
    from .text import ColQwen3_5Text

    checkpoint = read_checkpoint(folder)
    tower = load_vision_tower(checkpoint)
    state = {
        f"{prefix}{name}": checkpoint.read(part, name)
        for prefix, part in checkpoint.layout.parts
        if part != "visual"
        for name in checkpoint.tensors[part]
    }
    try:
        text = ColQwen3_5Text.from_state_dict(checkpoint.config, state)
    except (KeyError, ValueError) as e:
        raise ExportError(f"{checkpoint.folder}: the text stack does not load ({e})") from e
    del state
    return retrieval_module(checkpoint, tower, text.to("cpu").float().eval())


def tensor_locations(checkpoint: Qwen3_5Checkpoint) -> dict[str, tuple[Path, str]]:
    """Every tensor the layout names, by its parameter name in the retrieval module (file, key)."""
    return {
        f"{MODULE_PREFIXES[part]}{name}": at
        for part, names in checkpoint.tensors.items()
        for name, at in names.items()
    }


def build_empty_colqwen3_5(checkpoint: Qwen3_5Checkpoint):
    """The retrieval module of `checkpoint`, fp32, with its parameters on the meta device (no
    memory: the streamed export's stand-in); the buffers (rotary tables) computed."""
    from transformers.integrations.accelerate import init_empty_weights

    from .text import ColQwen3_5Text

    tower = build_vision_tower(checkpoint, empty=True)
    try:
        with init_empty_weights(include_buffers=False):
            text = ColQwen3_5Text(checkpoint.config, checkpoint.embedding_dim)
    except (KeyError, ValueError) as e:
        raise ExportError(f"{checkpoint.folder}: the text stack does not build ({e})") from e
    return retrieval_module(checkpoint, tower, text.eval())


__all__ = [
    "MODULE_PREFIXES",
    "build_empty_colqwen3_5",
    "load_colqwen3_5",
    "mrope_positions",
    "retrieval_module",
    "tensor_locations",
    "text_config_view",
]
