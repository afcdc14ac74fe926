"""The README's first command: `colembed demo` runs offline, end to end, and says its weights are random."""

from __future__ import annotations

import numpy as np
import pytest

from colembed_export.demo import run_demo


@pytest.mark.slow  # runs the exporter
def test_demo_runs_end_to_end_and_labels_random_weights(tmp_path, capsys):
    result = run_demo(tmp_path / "demo", progress=lambda message: None)
    printed = capsys.readouterr().out
    assert "RANDOM WEIGHTS" in printed and "random_weights=True" in printed
    scores = np.array(result["scores"])
    assert scores.shape == (2, 2) and np.isfinite(scores).all()
    assert "(23, 128) float32" in printed  # "Query: What was the revenue in 2023?" + 10 augmentation tokens
