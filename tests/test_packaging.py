"""The wheel a user installs: the model list inside it is real JSON (no symlink that a Windows
checkout turns into a text file), and the version is colembed's one `__version__`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import colembed
from colembed import registry

ROOT = Path(__file__).resolve().parents[1]


def test_models_json_is_a_regular_file_in_the_package():
    path = registry.models_json_path()
    assert path.parent == Path(colembed.__file__).parent
    assert path.is_file() and not path.is_symlink()
    assert not (ROOT / "models.json").exists()  # one copy, no second one to drift


@pytest.mark.slow
def test_wheel_ships_models_json_and_one_version(tmp_path):
    # built from a copy: setuptools writes build/ and *.egg-info next to the sources
    source = shutil.copytree(ROOT, tmp_path / "src", ignore=shutil.ignore_patterns(
        ".venv", ".git", "build", "*.egg-info", "__pycache__", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(tmp_path / "dist")], check=True,
                   timeout=300)
    (wheel,) = (tmp_path / "dist").glob("colembed-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        models = json.loads(archive.read("colembed/models.json"))
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        lines = archive.read(metadata).decode().splitlines()
    assert [m["model"] for m in models["models"]] == [e.model for e in registry.known_models()]
    assert f"Version: {colembed.__version__}" in lines
    requires = [line for line in lines if line.startswith("Requires-Dist: onnxruntime")]
    assert len(requires) == 2 and all("sys_platform" in line for line in requires)
