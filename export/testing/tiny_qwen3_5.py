"""Qwen3.5 parts with random weights of the real shapes, for tests and benchmarks."""

from __future__ import annotations


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
