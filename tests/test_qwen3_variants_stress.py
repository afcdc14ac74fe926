"""ColQwen3's stress checkpoint (`tiny_qwen3.build_stress_checkpoint_3`: the trained-model
activation traits of `StressTraits`, placed where Qwen3-VL's modules allow) carries those traits.

Not yet here: the variants' gates on it. An export of this checkpoint with int8, int4 and fp16
stops before any variant, at the ranking set ("0 clear-winner queries under fp32": the stress
traits make every page look alike to the fp32 graphs at tiny-3 size), so the gate tests were
taken out until the checkpoint (or the ranking set at this size) is fixed; see issue #22's note."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import build_once

pytestmark = pytest.mark.slow


def stress_checkpoint(tmp_path_factory):
    from colembed_export.tiny_qwen3 import build_stress_checkpoint_3

    return build_once(tmp_path_factory, "qwen3-stress", lambda folder: build_stress_checkpoint_3(
        folder / "tiny-3-stress", "tiny-3")) / "tiny-3-stress"


def test_stress_checkpoint_carries_the_traits(tmp_path_factory):
    """Massive residual channels (100-1000x the median) at every language layer, a vision
    residual stream beyond fp16's 65504, DeepStack features in the hundreds."""
    import torch

    from colembed_export.checkpoint_qwen3 import load_colqwen3
    from colembed_export.verify import reference_processor_qwen3, sample_pages

    folder = stress_checkpoint(tmp_path_factory)
    model = load_colqwen3(folder)
    processor, _ = reference_processor_qwen3(folder)
    backbone = model.vlm.model
    layers, blocks = [], []
    hooks = [layer.register_forward_hook(lambda m, a, out: layers.append(out[0] if isinstance(
        out, tuple) else out)) for layer in backbone.language_model.layers]
    hooks += [block.register_forward_hook(lambda m, a, out: blocks.append(float(out.abs().max())))
              for block in backbone.visual.blocks]
    with torch.no_grad():
        model(**processor.process_queries(["What was the revenue in 2023?"]))
        page = processor.process_images(sample_pages()[:1])
        _, deepstack = backbone.visual(page["pixel_values"][0], grid_thw=page["image_grid_thw"])
    for hook in hooks:
        hook.remove()
    for hidden in layers:
        values = hidden[0].abs()
        assert 100 <= float(values.max() / values.median()) <= 1000
    assert max(blocks) > 65504
    assert all(100 < float(d.abs().max()) < 1000 for d in deepstack)
