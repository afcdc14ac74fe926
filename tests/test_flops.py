"""benchmarks/flops.py counts ColQwen3's DeepStack: the mergers that turn the outputs of some vision
blocks into features for the first language layers (issue #22). The count is checked against the
work the real modules do: every `nn.Linear` call inside the tower's DeepStack mergers, recorded by
forward hooks on a tiny-3 checkpoint (transformers' own Qwen3-VL), rows x in x out x 2."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def flops():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import flops

        yield flops
    finally:
        sys.path.remove(str(BENCHMARKS))


def manifest_parts(folder: Path):
    """(torch model, the manifest's parts that `Shapes.from_manifest` reads), from the very facts
    the exporter writes the manifest from (`exporter.load`)."""
    from colembed_export.checkpoint import check_architecture
    from colembed_export.exporter import load
    from colembed_export.families import export_family

    model, facts = load(folder, export_family(check_architecture(folder).name))
    parts = {"architecture": facts.architecture, "preprocess": facts.preprocess.to_dict(),
             "vision_attention": facts.vision_attention.to_dict()}
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

    hooks = [m.register_forward_hook(hook) for top in modules for m in top.modules()
             if isinstance(m, torch.nn.Linear)]
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
    from qwen3_fixtures import checkpoint

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
    assert page["total"] - flops.page_flops(without, patches // shapes.merge,
                                            patches // shapes.merge + 11)["total"] == deepstack


def test_families_without_deepstack_count_none(flops, tiny_checkpoint):
    """ColQwen2's manifest has no `vision_extras`: no DeepStack merger is counted."""
    _, parts = manifest_parts(tiny_checkpoint)
    assert "vision_extras" not in parts
    assert flops.Shapes.from_manifest(parts).deepstack_layers == 0
