"""The pinned ColQwen3 reference's own Python environment, made once and reused.

The reference (colpali-engine 0.3.18 `ColQwen3` on transformers 5.24, docs/reference-colqwen3.md)
cannot share the export environment (transformers 4.57.1 is ColQwen2's reference), so
`reference_python()` makes `.venv-qwen3-reference/` beside the checkout's `.venv` (git-ignored):
transformers 5.24 and what it needs, colpali-engine --no-deps (its metadata pulls torchvision),
colembed editable --no-deps; torch, numpy, pillow and safetensors are seen through a .pth from
this environment. `COLEMBED_QWEN3_REFERENCE_PYTHON` names an existing interpreter instead. Built
under a file lock, so parallel test workers share one. Used by the tests and the embedding
benchmark's torch rows; needs the package registry on first use.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout this package is installed from
REFERENCE_VENV = REPO / ".venv-qwen3-reference"
REFERENCE_PACKAGES = (
    "torch==2.13.0",
    "transformers==5.24.0",
    "tokenizers",
    "safetensors",
    "pillow",
    "numpy",
)
REFERENCE_NO_DEPS = ("colpali-engine==0.3.18",)


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

    own = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
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
            subprocess.run(
                [sys.executable, "-m", "venv", "--clear", str(REFERENCE_VENV)], check=True
            )
            _share_site_packages(python)
            _pip(python, *REFERENCE_PACKAGES)
            _pip(python, "--no-deps", *REFERENCE_NO_DEPS)
            _pip(python, "--no-deps", "-e", str(REPO))
            ready.write_text("\n".join(REFERENCE_PACKAGES + REFERENCE_NO_DEPS) + "\n")
    return python


def run_reference(
    module: str, *args: str, python: str | Path | None = None, env: dict | None = None
) -> None:
    """`python -m module *args` in the pinned reference's environment (`reference_python()` unless
    `python` names another interpreter), on this checkout's `colembed` and `colembed_export`.

    The caller's `PYTHONPATH` is left out: a folder on it would put this environment's packages
    (transformers 4.57.1) ahead of the reference's own. In its place goes a folder holding only
    links to this checkout's two packages, so a reference environment made from another checkout
    (`COLEMBED_QWEN3_REFERENCE_PYTHON`) runs this one's scripts, not its own."""
    import tempfile

    run_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with tempfile.TemporaryDirectory(prefix="colembed-reference-path-") as folder:
        for name, source in (("colembed", REPO / "colembed"), ("colembed_export", REPO / "export")):
            Path(folder, name).symlink_to(source, target_is_directory=True)
        run_env["PYTHONPATH"] = folder
        run_env.update(env or {})
        subprocess.run(
            [str(python or reference_python()), "-m", module, *map(str, args)],
            check=True,
            env=run_env,
        )
