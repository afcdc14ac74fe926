"""Loading a ColQwen3 checkpoint (colpali-engine's layout) strictly, in fp32, in the export environment.

The export environment pins transformers 4.57.1 (ColQwen2's reference), whose own `Qwen3VLModel`
computes what colpali-engine 0.3.18's `ColQwen3` (a `Qwen3VLModel` subclass on transformers 5.x)
computes: measured on the same weights, docs/reference-colqwen3.md, `tests/test_qwen3_reference.py`.
So the exporter wraps the checkpoint's weights in 4.57.1's modules and adds the head colpali-engine
adds (`custom_text_proj`, L2 normalisation, times the mask), nothing else.

Two spellings of the same checkpoint are read:
- weights `model.visual.*`, `model.language_model.*`, `model.custom_text_proj.*` (what
  `ColQwen3.save_pretrained` writes under 5.x) or the same without `model.`;
- the text rope as 5.x's `rope_parameters` (`rope_theta`, `mrope_section`, `mrope_interleaved`) or
  4.x's `rope_scaling` + `rope_theta` (Qwen/Qwen3-VL-* configs). Nothing else is renamed.

Every missing, unexpected or mis-shaped tensor is an error naming it (a partial checkpoint would
export random layers).

Memory: the model is built (random init), then the file's tensors are loaded and copied in as
fp32, so a load holds about two fp32 copies of the weights plus the file's. Fine for the tiny and
reduced-depth checkpoints; a full Qwen3-VL-4B (17.6 GB in fp32) would not fit this 24 GB machine
this way: it needs a lean load (tensor by tensor), not written yet.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from colembed.errors import ExportError

PROJECTION = "custom_text_proj"
_PREFIXES = ("model.", "")


def normalised_config(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json with the text rope in the installed transformers' spelling (4.57.1:
    `rope_scaling` + `rope_theta`); a 5.x `rope_parameters` is translated, not guessed."""
    config = copy.deepcopy(raw)
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ExportError("config.json: a qwen3_vl config needs a text_config object")
    params = text.pop("rope_parameters", None)
    if params is not None:
        if "mrope_section" not in params or "rope_theta" not in params:
            raise ExportError(f"config.json: text_config.rope_parameters {params} lacks "
                              "mrope_section or rope_theta")
        if params.get("rope_type", "default") != "default":
            raise ExportError(f"config.json: rope_type {params['rope_type']!r} is not supported")
        text["rope_theta"] = params["rope_theta"]
        text["rope_scaling"] = {"rope_type": "default",
                                "mrope_section": list(params["mrope_section"]),
                                "mrope_interleaved": bool(params.get("mrope_interleaved", True))}
    scaling = text.get("rope_scaling")
    if not isinstance(scaling, dict) or "mrope_section" not in scaling:
        raise ExportError("config.json: text_config has no mrope_section (rope_scaling or "
                          "rope_parameters)")
    if scaling.get("mrope_interleaved") is False:
        raise ExportError("config.json: Qwen3-VL's M-RoPE is interleaved; mrope_interleaved=false "
                          "is not supported")
    config["vision_config"] = {k: v for k, v in config.get("vision_config", {}).items()
                               if k != "rope_parameters"}
    return config


def _retrieval_module(backbone, projection, embedding_dim: int):
    """A module shaped like transformers' `ColQwen2ForRetrieval` for the exporter's shared steps
    (`vlm.model`, `embedding_proj_layer`, `config.vlm_config`, `config.embedding_dim`), whose
    forward is colpali-engine 0.3.18 `ColQwen3.forward`: backbone -> projection -> L2 -> x mask."""
    import torch
    from torch import nn

    class ColQwen3Retrieval(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vlm = nn.Module()
            self.vlm.model = backbone
            self.embedding_proj_layer = projection
            self.config = SimpleNamespace(vlm_config=backbone.config, embedding_dim=embedding_dim)

        def forward(self, input_ids, attention_mask, pixel_values=None, image_grid_thw=None,
                    **_: Any):
            if pixel_values is not None and pixel_values.ndim == 3:  # processor-padded batch
                offsets = image_grid_thw[:, 1] * image_grid_thw[:, 2]
                pixel_values = torch.cat([p[:n] for p, n in zip(pixel_values, offsets)])
            hidden = self.vlm.model(input_ids=input_ids, attention_mask=attention_mask,
                                    pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                                    use_cache=False, return_dict=True).last_hidden_state
            proj = self.embedding_proj_layer(hidden)
            proj = proj / proj.norm(dim=-1, keepdim=True)
            return SimpleNamespace(embeddings=proj * attention_mask.unsqueeze(-1))

    return ColQwen3Retrieval().eval()


def load_colqwen3(folder: Path):
    """The checkpoint as a strict fp32 retrieval module (4.57.1's Qwen3VLModel + the projection)."""
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen3VLConfig, Qwen3VLModel

    folder = Path(folder)
    config = normalised_config(json.loads((folder / "config.json").read_text()))
    weights: dict[str, Any] = {}
    for path in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(path)))
    prefix = next((p for p in _PREFIXES if f"{p}{PROJECTION}.weight" in weights), None)
    if prefix is None:
        raise ExportError(f"{folder}: no {PROJECTION}.weight (with or without 'model.'): not a "
                          "colpali-engine ColQwen3 checkpoint")
    vlm_config = Qwen3VLConfig(**{k: v for k, v in config.items()
                                  if k not in ("architectures", "dtype", "model_type")})
    backbone = Qwen3VLModel(vlm_config).to(torch.float32).eval()
    projection_weight = weights[f"{prefix}{PROJECTION}.weight"]
    projection = torch.nn.Linear(projection_weight.shape[1], projection_weight.shape[0],
                                 bias=f"{prefix}{PROJECTION}.bias" in weights)
    state = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
    stray = sorted(k for k in weights if not k.startswith(prefix))
    projection_state = {k[len(PROJECTION) + 1:]: state.pop(k) for k in list(state)
                        if k.startswith(PROJECTION + ".")}
    problems = [f"{len(stray)} tensor(s) outside '{prefix}': {stray[:5]}"] if stray else []
    try:
        result = backbone.load_state_dict({k: v.to(torch.float32) for k, v in state.items()},
                                          strict=False)
        projection.load_state_dict({k: v.to(torch.float32) for k, v in projection_state.items()})
    except RuntimeError as e:
        raise ExportError(f"{folder}: the checkpoint does not load ({e})") from e
    if result.missing_keys:
        problems.append(f"{len(result.missing_keys)} missing tensor(s): {result.missing_keys[:10]}")
    if result.unexpected_keys:
        problems.append(f"{len(result.unexpected_keys)} unexpected tensor(s): "
                        f"{result.unexpected_keys[:10]}")
    if problems:
        raise ExportError(f"{folder}: refusing a partial checkpoint, it would export random "
                          "layers: " + "; ".join(problems))
    return _retrieval_module(backbone, projection.to(torch.float32).eval(),
                             projection_weight.shape[0])


__all__ = ["load_colqwen3", "normalised_config"]
