"""The wheel a user installs: the model list inside it is the top-level `models.json` byte for
byte (one source, shipped by setup.py's build step, no symlink that a Windows checkout turns into
a text file), and the version is colembed's one `__version__`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import colembed
from colembed import registry

ROOT = Path(__file__).resolve().parents[2]
TOP_LEVEL = ROOT / "models.json"


def test_models_json_has_one_source_at_the_top_level():
    assert TOP_LEVEL.is_file() and not TOP_LEVEL.is_symlink()
    # no second copy in the package to drift from it (the wheel's copy is made at build time)
    assert not (ROOT / "colembed" / "models.json").exists()
    # a source checkout reads that very file
    assert registry.models_json_path().resolve() == TOP_LEVEL.resolve()
    assert [e.model for e in registry.known_models()] == [
        m["model"] for m in json.loads(TOP_LEVEL.read_text(encoding="utf-8"))["models"]
    ]


@pytest.mark.slow
def test_sdist_and_wheel_ship_models_json_and_one_version(tmp_path):
    # built from a copy: setuptools writes build/ and *.egg-info next to the sources
    source = shutil.copytree(
        ROOT,
        tmp_path / "src",
        ignore=shutil.ignore_patterns(
            ".venv",
            ".git",
            "build",
            "dist",
            "*.egg-info",
            "__pycache__",
            ".pytest_cache",
            ".hypothesis",
        ),
    )
    # the sdist, as `python -m build` makes it first, then the wheel built from the unpacked sdist
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])",
            str(tmp_path / "sdist"),
        ],
        cwd=source,
        check=True,
        timeout=300,
        capture_output=True,
    )
    (sdist,) = (tmp_path / "sdist").glob("colembed-*.tar.gz")
    with tarfile.open(sdist) as archive:
        archive.extractall(tmp_path / "unpacked", filter="data")
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    assert (unpacked / "models.json").read_bytes() == TOP_LEVEL.read_bytes()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(unpacked),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("colembed-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        shipped = archive.read("colembed/models.json")
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        lines = archive.read(metadata).decode().splitlines()
    assert shipped == TOP_LEVEL.read_bytes()
    assert [n for n in names if n.endswith("models.json")] == ["colembed/models.json"]
    assert f"Version: {colembed.__version__}" in lines
    requires = [line for line in lines if line.startswith("Requires-Dist: onnxruntime")]
    assert len(requires) == 2 and all("sys_platform" in line for line in requires)


def test_the_model_class_is_colqwenmodel_and_the_old_name_is_an_alias():
    import colembed
    import colembed.model

    assert colembed.ColQwenModel is colembed.model.ColQwenModel
    assert colembed.ColQwenModel.__name__ == "ColQwenModel"
    assert colembed.ColQwen2Model is colembed.ColQwenModel
    assert colembed.model.ColQwen2Model is colembed.ColQwenModel
    assert {"ColQwenModel", "ColQwen2Model"} <= set(colembed.__all__)
