"""The int8 recipe's outlier smoothing costs no speed: it changes constants, never the graph.

SmoothQuant's scales are folded into the producing norm's weight and the consuming MatMuls' rows
(graph_edits.smooth_activation_outliers). These checks hold that on both families' session
exports: the smoothed and the plain int8 graphs run the same ops in the same order after
onnxruntime's own optimisation (every quantised MatMul still fuses into DynamicQuantizeMatMul /
MatMulIntegerToFloat), and the smoothed fp32 function is the exported one.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

FAMILIES = ["exported_tiny", "exported_tiny_2_5"]


def _graph(folder, role: str) -> str:
    return json.loads((folder / "colembed_manifest.json").read_text())["variants"]["fp32"][role][
        "file"
    ]


def _optimised_ops(path, tmp_path) -> list[tuple[str, str, int]]:
    """(op, domain, inputs) of each node as onnxruntime's CPU session optimises the graph."""
    import onnx

    from colembed.sessions import Session

    out = tmp_path / f"{path.stem}.optimised.onnx"
    Session(path, threads=1, save_optimized=out)
    return [
        (n.op_type, n.domain, len(n.input))
        for n in onnx.load(str(out), load_external_data=False).graph.node
    ]


@pytest.fixture(scope="module")
def calibrations(request):
    """{fixture: (folder, the exporter's calibration feeds per role)}, built once per family."""
    from colembed_export.variants.gates import calibration_feeds

    found = {}
    for name in FAMILIES:
        folder = request.getfixturevalue(name).folder
        found[name] = (folder, calibration_feeds(folder))
    return found


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("role", ["vision", "text"])
def test_smoothed_int8_runs_the_plain_recipes_ops(calibrations, family, role, tmp_path):
    from colembed_export.graphs.edits import finish
    from colembed_export.variants.recipes import quantize_int8
    from colembed_export.variants.write import save_graph

    folder, calibration = calibrations[family]
    src = folder / _graph(folder, role)
    ops, weights = {}, {}
    for label, feeds in (("smoothed", calibration[role]), ("plain", None)):
        work = tmp_path / label
        work.mkdir()
        model, _ = quantize_int8(src, work, calibration=feeds, scheme="tensor")
        finish(model)
        weights[label] = {
            name: v.const_value.numpy().copy()
            for name, v in model.graph.initializers.items()
            if v.const_value is not None and name.endswith("_w_int8")
        }
        save_graph(model, work, f"{role}.int8.onnx", external=False)
        ops[label] = _optimised_ops(work / f"{role}.int8.onnx", work)
    assert ops["smoothed"] == ops["plain"]
    fused = {op for op, _, _ in ops["plain"]}
    # the streamed quantiser writes quantize_dynamic's nodes: onnxruntime fuses every one
    assert (
        fused & {"DynamicQuantizeMatMul", "MatMulIntegerToFloat"} and "MatMulInteger" not in fused
    )
    assert weights["smoothed"].keys() == weights["plain"].keys()
    assert any(
        not np.array_equal(weights["smoothed"][k], weights["plain"][k]) for k in weights["plain"]
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_smoothing_keeps_the_fp32_function(calibrations, family, tmp_path):
    """Smoothed fp32 text graph (before quantisation) = the exported one within float rounding."""
    import onnx_ir as ir

    from colembed.sessions import Session
    from colembed_export.graphs.edits import smooth_activation_outliers

    folder, calibration = calibrations[family]
    src = folder / _graph(folder, "text")
    model = ir.load(src)
    assert smooth_activation_outliers(model, src, calibration["text"], alpha=0.5) > 0
    smoothed = tmp_path / "text.smoothed.onnx"
    ir.save(model, smoothed, external_data=smoothed.name + "_data")
    feeds = calibration["text"][0]
    (want,) = Session(src, threads=1).run(feeds)
    (got,) = Session(smoothed, threads=1).run(feeds)
    assert np.abs(got - want).max() < 1e-4


def test_calibration_probes_read_weights_unpacked_and_measure_the_same(calibrations, monkeypatch):
    """A calibration probe's session skips onnxruntime's weight prepacking (graph_edits.
    PROBE_PREPACKING: its weights stay the file's mapped pages instead of a packed anonymous copy)
    and measures what a prepacking session measures (the MatMuls' outputs here)."""
    import onnx

    from colembed_export.graphs import edits as G

    folder, feeds = calibrations["exported_tiny"]
    src = folder / _graph(folder, "text")
    with G._probe(src, lambda graph: [graph.input[0].name]) as (session, _):
        options = session.get_session_options()
        assert options.get_session_config_entry("session.disable_prepacking") == "1"
    graph = onnx.load(str(src), load_external_data=False).graph
    weights = {i.name for i in graph.initializer}
    names = [n.output[0] for n in graph.node if n.op_type == "MatMul" and n.input[1] in weights][:6]
    assert len(names) == 6
    unpacked = G.channel_maxima(src, names, feeds["text"])
    monkeypatch.setattr(G, "PROBE_PREPACKING", True)
    packed = G.channel_maxima(src, names, feeds["text"])
    for name in names:
        np.testing.assert_allclose(unpacked[name], packed[name], rtol=1e-5)


def test_matmuls_kept_fp32_behind_a_smoothed_norm_keep_the_fp32_function(calibrations, tmp_path):
    """A MatMul the int8 recipe leaves fp32 (`quantize_int8(keep=)`) still reads its norm's output
    divided by the SmoothQuant factors, so its weight takes them too: with every MatMul kept, the
    graph computes the exported function."""
    from colembed.sessions import Session
    from colembed_export.graphs.edits import finish
    from colembed_export.variants.recipes import quantize_int8
    from colembed_export.variants.write import save_graph

    folder, calibration = calibrations["exported_tiny"]
    src = folder / _graph(folder, "text")
    model, info = quantize_int8(src, tmp_path, calibration=calibration["text"], keep=("",))
    assert info["smoothed"] > 0 and info["int8_matmuls"]["row"] == 0
    assert len(info["fp32_matmuls"]) == info["int8_matmuls"]["fp32"] > 0
    finish(model)
    save_graph(model, tmp_path, "text.kept.onnx", external=False)
    feeds = calibration["text"][0]
    (want,) = Session(src, threads=1).run(feeds)
    (got,) = Session(tmp_path / "text.kept.onnx", threads=1).run(feeds)
    assert np.abs(got - want).max() < 1e-4
