"""ColQwen3 test fixtures: tiny checkpoints, their exports, and the pinned reference's outputs.

The pinned reference (colpali-engine 0.3.18 `ColQwen3` + `ColQwen3Processor` on transformers 5.24,
docs/reference-colqwen3.md) cannot share the test environment (transformers 4.57.1 is ColQwen2's
reference), so `reference_python()` makes a second virtual environment once and reuses it:

    .venv-qwen3-reference/   (beside the repository's .venv; git-ignored)
        transformers==5.24.0 and what it needs beyond this environment; torch==2.13.0, numpy,
        pillow and safetensors are this environment's, seen through a .pth (_share_site_packages)
        colpali-engine==0.3.18 --no-deps   (its metadata pulls torchvision, which breaks this torch)
        colembed (editable, --no-deps)     (for colembed_export.families.qwen3.reference and sample pages)

`COLEMBED_QWEN3_REFERENCE_PYTHON` points at an existing interpreter instead. Building it needs the
package registry (as the README's test command does); it is built under a file lock, so xdist
workers share one. The reference script writes its outputs to an .npz per checkpoint, built once
per run (`conftest.build_once`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
REFERENCE_VENV = REPO / ".venv-qwen3-reference"
REFERENCE_PACKAGES = ("torch==2.13.0", "transformers==5.24.0", "tokenizers", "safetensors",
                      "pillow", "numpy")
REFERENCE_NO_DEPS = ("colpali-engine==0.3.18",)
PRESETS = ("tiny-3", "tiny-3-alt")
SEEDS = {"tiny-3": 0, "tiny-3-alt": 1}


def _pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "-q", *args], check=True)


def _share_site_packages(python: Path) -> None:
    """Let the reference environment see this one's packages, behind its own.

    A second torch is ~1 GB to download and install (minutes on a fresh machine); torch,
    numpy, pillow and safetensors are the same versions in both. A `.pth` line appends this
    interpreter's site-packages to the new environment's path, so pip finds what already
    satisfies a requirement and installs only what differs (transformers 5.24 and what it
    needs) into the new environment, whose own site-packages comes first on its path. pip never
    uninstalls from outside its environment, so this one's transformers 4.57.1 stays as it is.
    """
    import sysconfig

    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    Path(own, "zz_colembed_test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")


def reference_python() -> Path:
    """The interpreter of the pinned reference's environment, created on first use."""
    given = os.environ.get("COLEMBED_QWEN3_REFERENCE_PYTHON")
    if given:
        return Path(given)
    from filelock import FileLock

    python = REFERENCE_VENV / "bin" / "python"
    ready = REFERENCE_VENV / "colembed-reference-ready"
    with FileLock(str(REFERENCE_VENV) + ".lock"):
        if not ready.exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(REFERENCE_VENV)],
                           check=True)
            _share_site_packages(python)
            _pip(python, *REFERENCE_PACKAGES)
            _pip(python, "--no-deps", *REFERENCE_NO_DEPS)
            _pip(python, "--no-deps", "-e", str(REPO))
            ready.write_text("\n".join(REFERENCE_PACKAGES + REFERENCE_NO_DEPS) + "\n")
    return python


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
