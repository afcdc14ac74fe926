"""ColQwen3's variants on its stress checkpoint (`tiny_qwen3.build_stress_checkpoint_3`: the
trained-model activation traits of `StressTraits`, placed where Qwen3-VL's modules allow).

The exporter writes a variant only after it passed the gates every family shares
(`variants.GATES`, judged on `evaluation.gate_items`: queries from one word to the model's bound,
the long-query gate included; pages from the smallest to the full budget; mixed batches; the
ranking set). So one export with int8, int4 and fp16 either fails or holds all three; these tests
read its figures. What the random-weight tiny-3 variants show is in test_qwen3_reference.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import build_once

pytestmark = pytest.mark.slow
ALL = ("int8", "int4", "fp16")


def stress_checkpoint(tmp_path_factory):
    from colembed_export.tiny_qwen3 import build_stress_checkpoint_3

    return build_once(tmp_path_factory, "qwen3-stress", lambda folder: build_stress_checkpoint_3(
        folder / "tiny-3-stress", "tiny-3")) / "tiny-3-stress"


@pytest.fixture(scope="module")
def stress_export(tmp_path_factory):
    from colembed_export.exporter import export_model

    return export_model(stress_checkpoint(tmp_path_factory),
                        tmp_path_factory.mktemp("qwen3-stress-variants") / "model",
                        random_weights=True, variants=list(ALL))


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


@pytest.mark.parametrize("name", ALL)
def test_gates_met_on_the_stress_checkpoint(stress_export, name):
    """Each variant met every gate, the long queries' buckets included."""
    from colembed_export import variants as V

    figures = stress_export.manifest.checks[name]
    assert figures["finite"]
    assert not V.GATES[name].misses(figures), figures
    assert "queries 257+ tokens" in figures["buckets"], sorted(figures["buckets"])
    bound = max(row["tokens"] for n, row in figures["items"].items() if n.startswith("query: "))
    assert bound == 1291  # the long-query gate ran at the bound: 1280 image tokens + the prompt


def test_each_variant_serves_the_stress_checkpoint_near_fp32(stress_export):
    import colembed
    from colembed_export.verify import SAMPLE_QUERIES, sample_pages

    folder = stress_export.folder
    fp32 = colembed.load(folder)
    pages, queries = sample_pages()[:2], list(SAMPLE_QUERIES)
    want = fp32.embed_images(pages) + fp32.embed_queries(queries)
    for name in ALL:
        got = colembed.load(folder, variant=name)
        for g, w in zip(got.embed_images(pages) + got.embed_queries(queries), want):
            assert g.shape == w.shape and np.isfinite(g).all()
            cosine = np.sum(g * w, axis=1) / np.linalg.norm(g, axis=1) / np.linalg.norm(w, axis=1)
            assert cosine.mean() > 0.95, (name, cosine.mean())
