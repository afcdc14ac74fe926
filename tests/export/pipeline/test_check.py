"""The export check judges each tensor at its own scale: it passes correct exports of checkpoints
with trained-size image features and still refuses a graph that computes the wrong thing."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import colembed
from colembed.errors import ExportError
from colembed_export.pipeline.exporter import export_model
from colembed_export.pipeline.verify import (
    SAMPLE_QUERIES,
    Comparison,
    max_abs_diff,
    reference_outputs,
    relative_diff,
    sample_pages,
)

pytestmark = pytest.mark.heavy("tiny")

# Scaling the merger's output by 2500 brings the tiny checkpoint's image features to ~1000 (trained
# towers reach hundreds to thousands on high-norm tokens), where fp32 rounding alone differs by
# ~1.5e-4 absolute: an absolute bound of 1e-4 on the features refused this correct export.
FEATURE_SCALE = 2500.0
PARITY_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def large_feature_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint with the merger's last Linear scaled: image features reach ~300."""
    from safetensors.numpy import load_file, save_file

    folder = shutil.copytree(tiny_checkpoint, tmp_path_factory.mktemp("ckpt") / "large-features")
    weights = load_file(folder / "model.safetensors")
    for name in ("weight", "bias"):
        weights[f"vlm.model.visual.merger.mlp.2.{name}"] *= FEATURE_SCALE
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_judgement_scales_with_the_tensor():
    rng = np.random.default_rng(0)
    want = (rng.standard_normal((64, 32)) * 300).astype(np.float32)
    rounded = want + (rng.standard_normal(want.shape) * 3e-4).astype(np.float32)
    assert max_abs_diff(rounded, want) > 1e-4  # an absolute bound would refuse fp32 rounding
    assert relative_diff(rounded, want) < 1e-5
    wrong = want.copy()
    wrong[3] *= 1.01  # one token off by 1%
    assert relative_diff(wrong, want) > 1e-3
    assert relative_diff(want[:3], want) == float("inf")  # a shape mismatch never passes
    assert not Comparison("x", float("nan"), 1e-4, "relative").ok


@pytest.mark.slow
def test_large_image_features_export_and_match(large_feature_checkpoint, tmp_path):
    from colembed_export.families.checkpoint import load_strict

    report = export_model(large_feature_checkpoint, tmp_path / "out")
    check = report.manifest.checks["fp32"]
    assert check["max_abs_diff"] <= PARITY_TOLERANCE
    assert check["max_relative_feature_diff"] <= check["feature_tolerance"]

    model = colembed.load(report.folder)
    reference = reference_outputs(load_strict(large_feature_checkpoint), large_feature_checkpoint)
    pages = sample_pages()
    feature_diffs = [
        max_abs_diff(g, w) for g, w in zip(model.image_features(pages), reference.image_features)
    ]
    assert max(float(np.max(np.abs(w))) for w in reference.image_features) > 500
    assert max(feature_diffs) > PARITY_TOLERANCE  # the regime the old absolute check refused
    for got, want in zip(model.embed_images(pages), reference.pages):
        assert max_abs_diff(got, want) <= PARITY_TOLERANCE
    for got, want in zip(model.embed_queries(list(SAMPLE_QUERIES)), reference.queries):
        assert max_abs_diff(got, want) <= PARITY_TOLERANCE


@pytest.mark.slow
def test_wrong_vision_graph_is_refused_with_every_figure(
    large_feature_checkpoint, tmp_path, monkeypatch
):
    """A plausible export bug (the patch embedding reading channels as BGR) is refused, at the
    large feature scale too: the relative bound does not loosen the check."""
    from colembed_export.families.qwen2 import graphs

    original_init = graphs.ImageGraph.__init__

    def bgr_patch_embedding(self, visual):
        original_init(self, visual)
        weight = self.patch_weight  # (3 channels * 2 * 14 * 14, width), channel-major rows
        self.patch_weight = weight.reshape(3, -1, weight.shape[-1]).flip(0).reshape(weight.shape)

    monkeypatch.setattr(graphs.ImageGraph, "__init__", bgr_patch_embedding)
    with pytest.raises(ExportError) as caught:
        export_model(large_feature_checkpoint, tmp_path / "out")
    message = str(caught.value)
    assert "nothing was written" in message
    for i in range(len(sample_pages())):
        assert f"FAIL page {i} image features" in message and f"FAIL page {i} embeddings" in message
    # Queries never touch the image graph: reported with their figures, and passing.
    assert all(f"ok   query {i} embeddings" in message for i in range(len(SAMPLE_QUERIES)))
    assert list(tmp_path.iterdir()) == []


def test_check_one_session_at_a_time_gives_the_figures_of_both_open(exported_tiny, tiny_checkpoint):
    """The check runs the image graph's session, closes it, then the text graph's: its figures in
    the session export's manifest are those of the runtime with both sessions open (`load`, the
    check's session options), run as the check ran before, to the bit."""
    from colembed_export.families.checkpoint import load_strict
    from colembed_export.pipeline.verify import CHECK_SESSION_CONFIG

    reference = reference_outputs(load_strict(tiny_checkpoint), tiny_checkpoint)
    both = colembed.load(exported_tiny.folder, session_config=CHECK_SESSION_CONFIG)
    pages = sample_pages()
    features = both.image_features(pages)
    got_pages = both.embed_images(pages, batch_size=len(pages))
    got_queries = both.embed_queries(list(SAMPLE_QUERIES))
    want = {}
    for i in range(len(pages)):
        want[f"page {i} image features"] = relative_diff(features[i], reference.image_features[i])
        want[f"page {i} embeddings"] = max_abs_diff(got_pages[i], reference.pages[i])
    for i, got in enumerate(got_queries):
        want[f"query {i} embeddings"] = max_abs_diff(got, reference.queries[i])
    check = exported_tiny.manifest.checks["fp32"]
    assert check["comparisons"] == want
    assert check["max_abs_diff"] == max(v for k, v in want.items() if "features" not in k)
