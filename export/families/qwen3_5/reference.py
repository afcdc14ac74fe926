"""What the pinned reference (transformers 5.24, docs/reference-colqwen3_5.md) computes, run in
its own environment (`colembed_export.testing.reference_env`):

- `layer IN OUT`: transformers' `Qwen3_5GatedDeltaNet` (no cache: the torch fallback path, its
  chunked delta rule) on the weights and inputs in IN (.npz: `config` JSON, `w.<name>` weights,
  `hidden<i>` (B, L, D) and `mask<i>` (B, L) pairs); writes `out<i>` to OUT, and, with `time<i>`
  = repeats in IN, the best wall time of that many runs as `seconds<i>`.
- `tokenizer IN OUT`: transformers' `Qwen3_5Tokenizer` built from a tiktoken ranks file by
  transformers' own converter (IN: `ranks_file`, `specials` [[id, content], ...], `texts`, JSON);
  writes each text's ids to OUT (JSON).
- `colqwen IN OUT`: a random-weight colpali-engine `ColQwen3_5` of IN's `config` (JSON, the
  `Qwen3_5Config` fields) and `seed`, saved by its own `save_pretrained` into the folder IN's
  `checkpoint` (`colembed_export.testing.tiny_qwen3_5.random_weights` gives the scales), loaded
  back by `from_pretrained`, and its `forward` on IN's inputs (.npz): `ids<i>` lists of token
  ids, each run alone and all in one batch padded on the left with `pad_id`, as colpali-engine
  pads; `embeds<i>` (B, L, hidden), `mask<i>`, `positions<i>` (3, B, L) run as given. Writes
  `ids<i>`, `ids<i>_batched` (real rows of the left-padded batch) and `injected<i>` (B, L, dim)
  to OUT.

Run with `python -m colembed_export.families.qwen3_5.reference COMMAND IN OUT`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _fallback_only() -> None:
    """The reference is the torch fallback: refuse to run if a hub kernel package could replace it."""
    import importlib.util

    for name in ("fla", "causal_conv1d", "kernels"):
        if importlib.util.find_spec(name) is not None:
            raise RuntimeError(
                f"{name} is installed: the reference layer would not be the torch path"
            )


def run_layer(inp: Path, out: Path) -> None:
    import numpy as np
    import torch
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    _fallback_only()
    torch.manual_seed(0)
    data = np.load(inp)
    fields = json.loads(str(data["config"]))
    config = Qwen3_5TextConfig(
        num_hidden_layers=1, layer_types=["linear_attention"], hidden_act="silu", **fields
    )
    layer = Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    state = {k[2:]: torch.from_numpy(data[k]) for k in data.files if k.startswith("w.")}
    layer.load_state_dict(state, strict=True)
    result = {}
    with torch.no_grad():
        for i in range(sum(k.startswith("hidden") for k in data.files)):
            hidden = torch.from_numpy(data[f"hidden{i}"])
            mask = torch.from_numpy(data[f"mask{i}"])
            result[f"out{i}"] = layer(hidden, attention_mask=mask).numpy()
            repeats = int(data[f"time{i}"]) if f"time{i}" in data.files else 0
            if repeats:
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    layer(hidden, attention_mask=mask)
                    best = min(best, time.perf_counter() - start)
                result[f"seconds{i}"] = np.array(best)
    np.savez(out, **result)


def run_tokenizer(inp: Path, out: Path) -> None:
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    job = json.loads(inp.read_text(encoding="utf-8"))
    vocab, merges = TikTokenConverter().extract_vocab_merges_from_model(job["ranks_file"])
    tokenizer = Qwen3_5Tokenizer(vocab=vocab, merges=merges)
    specials = sorted((int(i), c) for i, c in job["specials"])
    tokenizer._tokenizer.add_special_tokens(
        [AddedToken(c, special=True, normalized=False) for _, c in specials]
    )
    for i, c in specials:
        if tokenizer.convert_tokens_to_ids(c) != i:
            raise RuntimeError(f"{c!r} is {tokenizer.convert_tokens_to_ids(c)} here, not {i}")
    ids = [tokenizer(text, add_special_tokens=True)["input_ids"] for text in job["texts"]]
    out.write_text(json.dumps(ids), encoding="utf-8")


def _colqwen3_5():
    from colembed_export.families.qwen3.reference import _shim_torchvision_free

    _shim_torchvision_free()
    from colpali_engine.models import ColQwen3_5

    return ColQwen3_5


def run_colqwen(inp: Path, out: Path) -> None:
    import numpy as np
    import torch

    from transformers import Qwen3_5Config

    from colembed_export.testing.tiny_qwen3_5 import random_weights

    _fallback_only()
    data = np.load(inp)
    colqwen = _colqwen3_5()
    built = colqwen(Qwen3_5Config(**json.loads(str(data["config"])))).eval()
    random_weights(built, int(data["seed"]))
    built.save_pretrained(str(data["checkpoint"]))
    model = colqwen.from_pretrained(str(data["checkpoint"]), dtype=torch.float32).eval()
    pad_id = int(data["pad_id"])
    found = {}
    with torch.no_grad():
        texts = [data[f"ids{i}"] for i in range(sum(k.startswith("ids") for k in data.files))]
        for i, ids in enumerate(texts):
            ids = torch.from_numpy(ids)[None]
            found[f"ids{i}"] = model(input_ids=ids, attention_mask=torch.ones_like(ids))[0].numpy()
        if texts:
            length = max(len(t) for t in texts)
            ids = torch.full((len(texts), length), pad_id, dtype=torch.int64)
            mask = torch.zeros(len(texts), length, dtype=torch.int64)
            for i, t in enumerate(texts):
                ids[i, length - len(t) :], mask[i, length - len(t) :] = torch.from_numpy(t), 1
            batched = model(input_ids=ids, attention_mask=mask)
            for i, t in enumerate(texts):
                found[f"ids{i}_batched"] = batched[i, length - len(t) :].numpy()
        for i in range(sum(k.startswith("embeds") for k in data.files)):
            found[f"injected{i}"] = model(
                inputs_embeds=torch.from_numpy(data[f"embeds{i}"]),
                attention_mask=torch.from_numpy(data[f"mask{i}"]),
                position_ids=torch.from_numpy(data[f"positions{i}"]),
            ).numpy()
    np.savez(out, **found)


COMMANDS = {
    "layer": run_layer,
    "tokenizer": run_tokenizer,
    "colqwen": run_colqwen,
}

if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in COMMANDS:
        raise SystemExit(__doc__)
    COMMANDS[sys.argv[1]](Path(sys.argv[2]), Path(sys.argv[3]))
