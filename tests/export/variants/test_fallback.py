"""The exporter writes the fastest int8 recipe that holds: one int8 code per weight, and two only
when the gate refuses one (export/variants/write.py `write_variants`, recipes.py `recipe_attempts`).

Real writes and real gate runs on the tiny fixture's fp32 graphs (conftest's `exported_variants`,
copied without its variants): the refusal between the two recipes is made by a gate threshold set
between the two recipes' figures on this checkpoint, not by a mocked verdict.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import pytest

from colembed.errors import ExportError
from tests.fixtures.builds import base_staging
from colembed_export.variants import recipes as R
from colembed_export.variants import write as V


def _fp32_staging(exported_variants, tmp_path: Path):
    """A staging copy of the fixture's fp32 folder (no variant files), its fp32 graph entries, a
    `write_manifest` as the exporter's (every file present described), and the steps run."""
    staging = tmp_path / "staging"
    graphs, write_manifest = base_staging(exported_variants.folder, staging)
    steps: list[str] = []

    @contextlib.contextmanager
    def step(name):
        steps.append(name)
        yield

    return staging, graphs, write_manifest, step, steps


def _worst_mean(figures) -> float:
    """The lowest mean the gate holds against: overall or any bucket's."""
    return min(figures["mean_cosine"], *(row["mean"] for row in figures["buckets"].values()))


def _makes(steps, recipe):
    return [s for s in steps if s.startswith("variants: make ") and s.endswith(f"({recipe})")]


def test_one_code_held_so_two_were_never_built(exported_variants, tmp_path):
    """The committed gate, the tiny checkpoint: one code per weight passes, the two-code graphs
    are never made, and the check records the recipe written (the fixture's export says the same
    through export_model)."""
    staging, graphs, write_manifest, step, steps = _fp32_staging(exported_variants, tmp_path)
    results = V.write_variants(staging, graphs, ["int8"], write_manifest=write_manifest, step=step)
    figures = results["int8"]
    assert figures["recipes"] == {"vision": "int8", "text": "int8"}
    assert figures["int8_weight_passes"] == 1 and "refused_attempts" not in figures
    assert len(_makes(steps, "int8")) == 2 and not _makes(steps, "int8x2")
    assert not any("next recipe" in s for s in steps)
    assert not list(staging.glob("*int8x2*"))
    exported = exported_variants.manifest.checks["int8"]
    assert exported["recipes"] == {"vision": "int8", "text": "int8"}
    assert exported["int8_weight_passes"] == 1 and exported.get("refused_attempts") is None
    assert exported_variants.manifest.graph("int8", "text").file == "text.int8.onnx"


def test_a_refused_code_falls_back_to_two_codes_written_and_recorded(
    exported_variants, tmp_path, monkeypatch
):
    """A gate whose mean threshold sits halfway between one code's worst mean on this checkpoint
    and 1 (two codes cut the loss ~8x here: mean 0.99986 -> 0.99998): the gate refuses one code,
    the exporter builds two, gates them against the same fp32 run, writes them and records the
    refused attempt's verdict with its worst item; the one-code files are gone."""
    from colembed.manifest import read_manifest

    one_code = exported_variants.manifest.checks["int8"]
    threshold = 1.0 - (1.0 - _worst_mean(one_code)) / 2
    gate = R.Gate(mean_cosine=threshold, min_cosine=R.GATES["int8"].min_cosine)
    monkeypatch.setitem(R.VARIANTS, "int8", dataclasses.replace(R.VARIANTS["int8"], gate=gate))
    staging, graphs, write_manifest, step, steps = _fp32_staging(exported_variants, tmp_path)
    said: list[str] = []
    results = V.write_variants(
        staging, graphs, ["int8"], write_manifest=write_manifest, progress=said.append, step=step
    )
    figures = results["int8"]
    assert figures["recipes"] == {"vision": "int8x2", "text": "int8x2"}
    assert figures["int8_weight_passes"] == 2 and not gate.misses(figures)
    [refused] = figures["refused_attempts"]
    assert refused["recipes"] == {"vision": "int8", "text": "int8"}
    assert refused["int8_weight_passes"] == 1 and refused["misses"]
    assert refused["mean_cosine"] < threshold <= figures["mean_cosine"]
    assert refused["worst_item"] in one_code["items"]
    assert sum(s == "variants: gate set through fp32" for s in steps) == 1  # one fp32 run
    assert sum(s == "variants: gate set through int8" for s in steps) == 2
    assert len(_makes(steps, "int8")) == 2 and len(_makes(steps, "int8x2")) == 2
    # written, listed, and nothing of the refused attempt left behind
    manifest = read_manifest(staging)
    assert {manifest.graph("int8", r).file for r in ("vision", "text")} == {
        "vision.int8x2.onnx",
        "text.int8x2.onnx",
    }
    assert not list(staging.glob("*.int8.onnx*"))
    assert set(manifest.files) == {p.name for p in staging.iterdir() if p.is_file()} - {
        "colembed_manifest.json"
    }
    # the progress and the CLI's line say which recipe was written and why
    assert any(
        "one int8 code per weight refused by the gate" in m and "trying two" in m for m in said
    )
    line = V.summary("int8", figures)
    assert "two int8 codes per weight" in line and "one int8 code per weight refused" in line
    assert repr(refused["worst_item"]) in line


def test_forced_recipes_and_bad_counts():
    assert R.recipe_attempts("int8") == [
        {"vision": "int8", "text": "int8"},
        {"vision": "int8x2", "text": "int8x2"},
    ]
    assert R.recipe_attempts("int8", 2) == [{"vision": "int8x2", "text": "int8x2"}]
    assert R.recipe_attempts("int8", 1) == [{"vision": "int8", "text": "int8"}]
    assert R.recipe_attempts("int4", 2) == [{"vision": "int8x2", "text": "int4"}]
    assert R.recipe_attempts("fp16") == [{"vision": "fp16", "text": "fp16"}]
    with pytest.raises(ExportError, match="int8 weight passes must be one of"):
        R.recipe_attempts("int8", 3)


def test_export_refuses_a_bad_weight_count_before_any_work(tmp_path):
    from colembed_export.pipeline.exporter import export_model

    with pytest.raises(ExportError, match="int8 weight passes must be one of"):
        export_model(
            tmp_path / "no-such-checkpoint",
            tmp_path / "out",
            variants=["int8"],
            int8_weight_passes=3,
        )
    assert not (tmp_path / "out").exists()
