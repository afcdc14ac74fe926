"""ColQwen3 test fixtures: tiny checkpoints, their exports, and the pinned reference's outputs.

The pinned reference runs in its own environment (`colembed_export.testing.reference_env`, made
on first use); its script writes its outputs to an .npz per checkpoint, built once per run
(`conftest.build_once`).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from colembed_export.testing.reference_env import reference_python

PRESETS = ("tiny-3", "tiny-3-alt")
SEEDS = {"tiny-3": 0, "tiny-3-alt": 1}


def checkpoint(tmp_path_factory, preset: str) -> Path:
    from colembed_export.testing.tiny_qwen3 import build_checkpoint_3
    from conftest import build_once

    return build_once(tmp_path_factory, f"qwen3-{preset}",
                      lambda folder: build_checkpoint_3(folder / preset, preset,
                                                        seed=SEEDS[preset])) / preset


def reference(tmp_path_factory, preset: str) -> dict[str, np.ndarray]:
    """What colpali-engine 0.3.18 on transformers 5.24 gives for `preset`'s checkpoint."""
    from conftest import build_once

    folder = checkpoint(tmp_path_factory, preset)

    def run(out: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        subprocess.run([str(reference_python()), "-m", "colembed_export.families.qwen3.reference",
                        str(folder), str(out / "reference.npz")], check=True, env=env)

    path = build_once(tmp_path_factory, f"qwen3-reference-{preset}", run) / "reference.npz"
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


VARIANTS = {"tiny-3": ("int8", "int4", "fp16"), "tiny-3-alt": ()}


def exported(tmp_path_factory, preset: str) -> Path:
    """`preset` exported with the check on; tiny-3 also with its int8, int4 and fp16 variants
    (each gated against fp32 by the exporter)."""
    from colembed_export.pipeline.exporter import export_model
    from conftest import build_once

    folder = checkpoint(tmp_path_factory, preset)
    return build_once(tmp_path_factory, f"qwen3-export-{preset}",
                      lambda out: export_model(folder, out / "model", random_weights=True,
                                               variants=VARIANTS[preset])) / "model"


@pytest.fixture(scope="session", params=PRESETS)
def qwen3_preset(request):
    return request.param
