"""The torch reference run layer by layer from the checkpoint (export/pipeline/offloaded.py): the
same outputs as the whole loaded model, bit for bit, on every streamed family and layout, and the
stand-in model left as it was for the graphs' trace. The ColQwen3.5 checkpoints are made in the
reference's environment (tests/fixtures/colqwen3_5.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


def _both_references(folder: Path):
    from colembed_export.families import export_family
    from colembed_export.families.checkpoint import check_architecture
    from colembed_export.graphs.streamed_weights import StandInModel
    from colembed_export.pipeline.offloaded import offloaded_reference

    family = export_family(check_architecture(folder).name)
    whole = family.run_reference(family.prepare_reference(family.load(folder)), folder)
    standin = StandInModel(folder, family)
    return whole, offloaded_reference(standin, family, folder), standin


def _assert_identical(whole, offloaded) -> None:
    for field in ("image_features", "pages", "queries"):
        got, want = getattr(offloaded, field), getattr(whole, field)
        assert len(got) == len(want) > 0, field
        for a, b in zip(got, want):
            assert a.shape == b.shape, field
            assert np.array_equal(a, b), f"{field}: max abs diff {np.max(np.abs(a - b))}"


def test_the_offloaded_reference_equals_the_whole_model_colqwen2(tiny_checkpoint):
    """Bit for bit, and afterwards every weight is its placeholder again (the same tensor the
    streamed writer maps back to the checkpoint) with no hook left."""
    whole, offloaded, standin = _both_references(tiny_checkpoint)
    _assert_identical(whole, offloaded)
    held = {p.data_ptr() for p in standin.model.parameters()}
    assert set(standin.standins) <= held
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in standin.model.modules())


@pytest.mark.parametrize("layout", ["colpali", "transformers"])
def test_the_offloaded_reference_equals_the_whole_model_colqwen2_5(layout, tmp_path_factory):
    from tests.fixtures.qwen2_5 import checkpoint

    preset = "tiny-2.5" if layout == "colpali" else "tiny-2.5-alt"
    whole, offloaded, _ = _both_references(checkpoint(tmp_path_factory, preset, layout))
    _assert_identical(whole, offloaded)


@pytest.mark.parametrize("layout", ["colpali", "tomoro"])
def test_the_offloaded_reference_equals_the_whole_model_colqwen3(layout, tmp_path_factory):
    from tests.fixtures import qwen3

    folder = (
        qwen3.checkpoint(tmp_path_factory, "tiny-3")
        if layout == "colpali"
        else qwen3.tomoro_checkpoint(tmp_path_factory)
    )
    whole, offloaded, _ = _both_references(folder)
    _assert_identical(whole, offloaded)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-3.5", "tiny-3.5-alt"])
def test_the_offloaded_reference_equals_the_whole_model_colqwen3_5(preset, tmp_path_factory):
    """colembed's Qwen3.5 text stack (DeltaNet projections as separate matrices, the conv
    kernels read whole) and the tower without DeepStack, bit for bit; no hook left after."""
    from tests.fixtures import colqwen3_5

    whole, offloaded, standin = _both_references(colqwen3_5.checkpoint(tmp_path_factory, preset))
    _assert_identical(whole, offloaded)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in standin.model.modules())


def test_a_half_precision_checkpoint_is_widened_as_the_whole_load_widens_it(
    tiny_checkpoint, tmp_path
):
    """A BF16 checkpoint: each module's weights widened to fp32 on read, the same values the strict
    loader's `dtype=torch.float32` gives."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bf16"
    shutil.copytree(tiny_checkpoint, folder)
    tensors = load_file(folder / "model.safetensors")
    save_file(
        {k: v.to(torch.bfloat16) for k, v in tensors.items()},
        folder / "model.safetensors",
        metadata={"format": "pt"},
    )
    whole, offloaded, _ = _both_references(folder)
    _assert_identical(whole, offloaded)


@pytest.mark.slow
def test_the_check_runs_the_offloaded_reference_and_passes(cli_export):
    """A streamed export's check: the reference from the stand-in run layer by layer (no whole
    load), the graphs within the bound, the figures in the manifest. The export is the CLI's
    default one (conftest's `cli_export`: the tiny checkpoint, random weights, streamed), whose
    progress lines name every step as it starts."""
    from colembed.manifest import read_manifest

    folder, code, _, stderr = cli_export
    assert code == 0, stderr
    steps = [line.removeprefix("[colembed] ") for line in stderr.splitlines()]
    assert "run the torch reference layer by layer from the checkpoint" in steps
    assert "load the checkpoint and run the torch reference" not in steps
    figures = read_manifest(folder).checks["fp32"]
    assert 0 <= figures["max_abs_diff"] <= figures["tolerance"]


def test_the_check_sessions_compute_within_rounding_of_a_user_s(exported_tiny):
    """Prepacking off (the check's sessions) only reorders the GEMMs' sums: the outputs differ
    from a user's session by fp32 rounding, a hundredth of the check's bound at most, so the
    check judges the graphs users run."""
    import colembed
    from colembed_export.constants import EMBEDDING_TOLERANCE
    from colembed_export.pipeline.verify import (
        CHECK_SESSION_CONFIG,
        SAMPLE_QUERIES,
        max_abs_diff,
        sample_pages,
    )

    user = colembed.load(exported_tiny.folder)
    check = colembed.load(exported_tiny.folder, session_config=CHECK_SESSION_CONFIG)
    pages, queries = sample_pages(), list(SAMPLE_QUERIES)
    pairs = [
        *zip(check.embed_images(pages), user.embed_images(pages)),
        *zip(check.embed_queries(queries), user.embed_queries(queries)),
    ]
    figures = [max_abs_diff(got, want) for got, want in pairs]
    assert len(figures) == len(pages) + len(queries)
    assert max(figures) <= EMBEDDING_TOLERANCE / 100, figures
