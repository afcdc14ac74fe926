"""A variant's new weights wait in a scratch file, not in memory, until its graph is saved
(graphs/edits.py `spilled_initializers`, used by variants/write.py for every recipe): the files
written are the same bytes as with every new weight held in memory."""

from __future__ import annotations

import json

import pytest


def _fp32_file(folder, role: str) -> str:
    manifest = json.loads((folder / "colembed_manifest.json").read_text())
    return manifest["variants"]["fp32"][role]["file"]


@pytest.mark.parametrize("recipe", ["int8", "int4", "fp16"])
def test_spilled_variant_weights_write_the_same_bytes(exported_tiny, recipe, tmp_path):
    import onnx_ir as ir

    from colembed_export.graphs.edits import finish, spilled_initializers
    from colembed_export.variants.gates import calibration_feeds
    from colembed_export.variants.recipes import CALIBRATED_RECIPES, make_graph
    from colembed_export.variants.write import save_graph

    folder = exported_tiny.folder
    calibration = calibration_feeds(folder)["text"] if recipe in CALIBRATED_RECIPES else None
    src = folder / _fp32_file(folder, "text")
    written = {}
    for spill in (False, True):
        out = tmp_path / ("spilled" if spill else "in-memory")
        out.mkdir()
        scratch = tmp_path / f"{out.name}.spill"
        with spilled_initializers(scratch, min_bytes=0) if spill else _nothing():
            model, _ = make_graph(recipe, src, tmp_path, calibration)
            finish(model)
            lazy = [
                v.name
                for v in model.graph.initializers.values()
                if isinstance(v.const_value, ir.LazyTensor)
            ]
            if spill:  # every new weight is on disk, none was left in memory
                assert lazy and scratch.stat().st_size > 0
            else:
                assert not lazy
            save_graph(model, out, "text.variant.onnx", external=True)
            del model
        assert not scratch.exists()  # the scratch file goes with the context
        written[spill] = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    assert sorted(written[True]) == ["text.variant.onnx", "text.variant.onnx_data"]
    assert written[True] == written[False]


def _nothing():
    import contextlib

    return contextlib.nullcontext()
