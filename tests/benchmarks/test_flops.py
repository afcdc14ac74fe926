"""benchmarks/shared/flops.py counts ColQwen3's DeepStack: the mergers that turn the outputs of some vision
blocks into features for the first language layers. The count is checked against the
work the real modules do: every `nn.Linear` call inside the tower's DeepStack mergers, recorded by
forward hooks on a tiny-3 checkpoint (transformers' own Qwen3-VL), rows x in x out x 2."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def flops():
    from benchmarks.shared import flops

    return flops


def manifest_parts(folder: Path):
    """(torch model, the manifest's parts that `Shapes.from_manifest` reads), from the very facts
    the exporter writes the manifest from (`exporter.load`)."""
    from colembed_export.families.checkpoint import check_architecture
    from colembed_export.pipeline.exporter import load
    from colembed_export.families import export_family

    model, facts = load(folder, export_family(check_architecture(folder).name))
    parts = {
        "architecture": facts.architecture,
        "preprocess": facts.preprocess.to_dict(),
        "vision_attention": facts.vision_attention.to_dict(),
    }
    if facts.vision_extras is not None:
        parts["vision_extras"] = facts.vision_extras.to_dict()
    return model, parts


def linear_flops(modules, run) -> float:
    """2 x rows x in x out of every `nn.Linear` call inside `modules` while `run()` runs."""
    import torch

    counted = []

    def hook(module, args, out):
        rows = args[0].numel() // module.in_features
        counted.append(2 * rows * module.in_features * module.out_features)

    hooks = [
        m.register_forward_hook(hook)
        for top in modules
        for m in top.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in hooks:
            h.remove()
    return float(sum(counted))


def test_deepstack_mergers_are_counted_as_the_work_they_do(flops, tmp_path_factory):
    """tiny-3 has two DeepStack layers: the vision count moves by exactly the FLOPs of their
    mergers' linears on that image, and each merger is `merger_flops` (the final merger's too)."""
    import torch
    from tests.fixtures.qwen3 import checkpoint

    model, parts = manifest_parts(checkpoint(tmp_path_factory, "tiny-3"))
    shapes = flops.Shapes.from_manifest(parts)
    visual = model.vlm.model.visual
    assert shapes.deepstack_layers == len(visual.deepstack_merger_list) == 2
    grid = torch.tensor([[1, 6, 8]])  # 48 patches, 12 image tokens
    patches = int(grid.prod())
    pixels = torch.randn(patches, shapes.patch_dim, generator=torch.Generator().manual_seed(0))

    def run():
        visual(pixels, grid_thw=grid)

    deepstack = linear_flops(visual.deepstack_merger_list, run)
    without = dataclasses.replace(shapes, deepstack_layers=0)
    assert flops.vision_flops(shapes, patches) - flops.vision_flops(without, patches) == deepstack
    assert deepstack == shapes.deepstack_layers * flops.merger_flops(shapes, patches)
    assert linear_flops([visual.merger], run) == flops.merger_flops(shapes, patches)
    page = flops.page_flops(shapes, patches // shapes.merge, patches // shapes.merge + 11)
    assert (
        page["total"]
        - flops.page_flops(without, patches // shapes.merge, patches // shapes.merge + 11)["total"]
        == deepstack
    )


def test_families_without_deepstack_count_none(flops, tiny_checkpoint):
    """ColQwen2's manifest has no `vision_extras`: no DeepStack merger is counted."""
    _, parts = manifest_parts(tiny_checkpoint)
    assert "vision_extras" not in parts
    assert flops.Shapes.from_manifest(parts).deepstack_layers == 0


def test_language_model_counts_use_the_declared_head_dim(flops, tmp_path):
    """Qwen3 declares its head dim (Qwen3-VL-4B: 128, where hidden / heads is 80): q and o are
    hidden x (heads x head dim), k and v hidden x (kv heads x head dim), and the attention products
    run over heads x head dim. tiny-3 with the 4B's trait (head dim 32, hidden / heads 16): the
    language model's count is the linear work its real modules do on a query, and the attention
    products span q_proj's width; hidden / heads would count less of both."""
    import dataclasses

    import torch
    from colembed_export.testing.tiny_qwen3 import PRESETS_3, build_checkpoint_3

    spec = dataclasses.replace(
        PRESETS_3["tiny-3"], name="tiny-3-wide-heads", text_head_dim=32, mrope_section=(4, 6, 6)
    )
    assert spec.text_head_dim != spec.text_hidden // spec.text_heads
    model, parts = manifest_parts(build_checkpoint_3(tmp_path / "ckpt", spec, seed=0))
    shapes = flops.Shapes.from_manifest(parts)
    assert shapes.text_head_dim == 32
    tokens = 13
    ids = torch.arange(1000, 1000 + tokens).unsqueeze(0)
    mask = torch.ones_like(ids)
    linear = linear_flops(
        [model.vlm.model.language_model, model.embedding_proj_layer],
        lambda: model(input_ids=ids, attention_mask=mask),
    )
    assert flops.text_flops(shapes, tokens) - flops.text_attention_flops(shapes, tokens) == linear
    q_width = model.vlm.model.language_model.layers[0].self_attn.q_proj.out_features
    assert q_width == spec.text_heads * spec.text_head_dim
    assert flops.text_attention_flops(shapes, tokens) == 4 * spec.text_layers * tokens**2 * q_width


def test_a_manifest_without_the_head_dim_reads_it_from_the_rotary_sections():
    """Manifests written before `text_head_dim` was recorded: twice the M-RoPE sections' total,
    which is hidden / heads for every ColQwen2 and ColQwen2.5 (Qwen2-VL-2B: 2 x 64 = 1536 / 12)."""
    from colembed.manifest import Architecture

    old = {
        "text_hidden": 1536,
        "text_layers": 28,
        "text_heads": 12,
        "text_kv_heads": 2,
        "text_intermediate": 8960,
        "mrope_section": [16, 24, 24],
        "rope_theta": 1e6,
        "vocab_size": 151936,
        "vision_depth": 32,
        "vision_embed_dim": 1280,
        "vision_heads": 16,
        "vision_mlp_ratio": 4.0,
        "embedding_dim": 128,
    }
    assert Architecture.from_dict(old).text_head_dim == 128
    assert Architecture.from_dict({**old, "text_head_dim": 96}).text_head_dim == 96
    assert Architecture.from_dict(Architecture.from_dict(old).to_dict()).text_head_dim == 128
