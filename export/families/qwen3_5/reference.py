"""What the pinned reference (transformers 5.24, docs/reference-colqwen3_5.md) computes, run in
its own environment (`colembed_export.testing.reference_env`):

- `layer IN OUT`: transformers' `Qwen3_5GatedDeltaNet` (no cache: the torch fallback path, its
  chunked delta rule) on the weights and inputs in IN (.npz: `config` JSON, `w.<name>` weights,
  `hidden<i>` (B, L, D) and `mask<i>` (B, L) pairs); writes `out<i>` to OUT, and, with `time<i>`
  = repeats in IN, the best wall time of that many runs as `seconds<i>`.
- `tokenizer IN OUT`: transformers' `Qwen3_5Tokenizer` built from a tiktoken ranks file by
  transformers' own converter (IN: `ranks_file`, `specials` [[id, content], ...], `texts`, JSON);
  writes each text's ids to OUT (JSON).

Run with `python -m colembed_export.families.qwen3_5.reference layer|tokenizer IN OUT`.
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


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("layer", "tokenizer"):
        raise SystemExit(__doc__)
    (run_layer if sys.argv[1] == "layer" else run_tokenizer)(Path(sys.argv[2]), Path(sys.argv[3]))
