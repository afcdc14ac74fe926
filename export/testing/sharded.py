"""Random-weight checkpoints written tensor by tensor into safetensors shards, for any size.

`tiny_qwen2.build_checkpoint` builds the whole model in memory and saves it: fine for tests, but
a full-size checkpoint would need its whole fp32 weights in memory to be made, which is what the
streamed exporter is measured against. Here the model is built on the meta device (shapes,
names and tied parameters, no data) and each tensor is drawn, written and dropped in turn, so at
most one tensor is in memory.

The files are what `save_pretrained` writes for a sharded checkpoint: `model-0000i-of-0000n.
safetensors` (the safetensors format: an 8-byte little-endian header length, a JSON header of
dtypes, shapes and byte offsets, then the raw little-endian data) and `model.safetensors.
index.json` (`weight_map`: tensor -> shard), beside the config, the real Qwen tokenizer files and
the processor's, as the tiny builders write them.

Values: the model's own initialisation scheme (normal with the config's `initializer_range` for
every matrix and the patch convolution; norm weights 1 and biases 0), then every 1-D tensor
perturbed as `shared.perturb_vectors` does, so a graph that dropped a norm or a bias differs.
Deterministic per (seed, tensor name); not the values `build_checkpoint` draws for the same seed.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any, Iterator

from .shared import make_folder, resolve_preset, write_tiny_info

SHARD_BYTES = 2 * 10**9  # transformers' default max_shard_size is "5GB"; smaller shards here
INDEX_NAME = "model.safetensors.index.json"
_DTYPES = {"torch.float32": "F32", "torch.bfloat16": "BF16", "torch.float16": "F16"}


def _tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def random_tensor(name: str, shape: tuple[int, ...], std: float, seed: int):
    """The fp32 values of one tensor (module docstring), drawn with its own generator."""
    import torch

    generator = torch.Generator().manual_seed(_tensor_seed(seed, name))
    if len(shape) >= 2:
        return torch.randn(shape, generator=generator) * std
    base = 0.0 if name.endswith("bias") else 1.0
    return base + 0.1 * torch.randn(shape, generator=generator)


def named_shapes(model: Any) -> list[tuple[str, tuple[int, ...]]]:
    """Each parameter once (tied ones under their first name), in the model's order."""
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def plan_shards(
    shapes: list[tuple[str, tuple[int, ...]]], shard_bytes: int = SHARD_BYTES
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Tensors in order, cut into shards of at most `shard_bytes` of fp32 data (a larger tensor
    alone in its shard)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = 4 * _numel(shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...]]], values: Iterator) -> None:
    """One safetensors file of fp32 `tensors` (name, shape), their data drawn from `values` one
    at a time, in order: the header first (offsets follow from the shapes), then each tensor."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        nbytes = 4 * _numel(shape)
        header[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for (name, shape), value in zip(tensors, values, strict=True):
            if tuple(value.shape) != shape or str(value.dtype) not in _DTYPES:
                raise ValueError(
                    f"{name}: got {tuple(value.shape)} {value.dtype}, expected {shape}"
                )
            f.write(value.contiguous().numpy().astype("<f4", copy=False).tobytes())


def write_sharded(
    out: Path, model: Any, std: float, seed: int, shard_bytes: int = SHARD_BYTES
) -> list[Path]:
    """`model`'s parameters (meta tensors: only names and shapes are read) as random fp32 shards
    and their index in `out`; returns the shard paths."""
    shards = plan_shards(named_shapes(model), shard_bytes)
    weight_map: dict[str, str] = {}
    paths = []
    total = 0
    for i, tensors in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        values = (random_tensor(n, shape, std, seed) for n, shape in tensors)
        write_shard(out / name, tensors, values)
        weight_map.update({n: name for n, _ in tensors})
        total += sum(4 * _numel(s) for _, s in tensors)
        paths.append(out / name)
    (out / INDEX_NAME).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
    return paths


def build_sharded_checkpoint(
    out_dir: str | Path, spec: Any = "tiny", *, seed: int = 0, shard_bytes: int = SHARD_BYTES
) -> Path:
    """A random-weight ColQwen2 checkpoint folder (transformers layout, `tiny_qwen2`'s presets
    and specs) in safetensors shards, never holding more than one tensor's values."""
    import torch
    from transformers import ColQwen2ForRetrieval

    from .tiny_qwen2 import (
        PRESETS,
        TRAINING_MAX_PIXELS,
        TRAINING_MIN_PIXELS,
        build_config,
        save_processor,
    )

    spec = resolve_preset(spec, PRESETS, "architecture")
    out = make_folder(out_dir)
    config = build_config(spec)
    with torch.device("meta"):
        model = ColQwen2ForRetrieval(config)
    write_sharded(out, model, config.vlm_config.text_config.initializer_range, seed, shard_bytes)
    config.save_pretrained(out)
    save_processor(out, min_pixels=TRAINING_MIN_PIXELS, max_pixels=TRAINING_MAX_PIXELS)
    write_tiny_info(out, seed=seed, spec=spec, edited=None, sharded=True)
    return out


__all__ = [
    "build_sharded_checkpoint",
    "plan_shards",
    "random_tensor",
    "write_shard",
    "write_sharded",
]
