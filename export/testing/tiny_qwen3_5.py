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
