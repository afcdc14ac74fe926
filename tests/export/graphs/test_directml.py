"""DirectML readiness without Windows: every variant's graphs against DirectML's registered kernels.

The kernel list (export/graphs/data/directml_kernels.json) is onnxruntime's own generated table; the check
must pass for every graph of every variant and must fail when an op DirectML lacks is added.
Placement and parity on a real GPU are `colembed doctor`'s job (README, "DirectML").
"""

from __future__ import annotations

import pytest

from colembed_export.graphs import directml as D

pytestmark = pytest.mark.heavy("tiny-variants")

ALL = ("fp32", "int8", "int4", "fp16")


@pytest.fixture(scope="module")
def folder(exported_variants):
    """The session's export with every variant (conftest), shared with test_variants.py."""
    return exported_variants.folder


def _graph_files(folder, variant):
    from colembed.manifest import read_manifest

    manifest = read_manifest(folder)
    return [g.file for g in manifest.variants[variant].values()] + [manifest.scorer.file]


@pytest.mark.parametrize("variant", ALL)
def test_every_graph_of_every_variant_runs_on_directml_kernels(folder, variant):
    import onnx

    for file in _graph_files(folder, variant):
        uses = D.graph_uses(onnx.load(str(folder / file), load_external_data=False))
        assert uses and all(u.dtype != "?" for u in uses if u.op in ("MatMul", "MatMulNBits"))
        assert D.directml_problems(folder / file) == [], file


def test_the_list_is_data_with_its_source():
    table = D.kernel_table()
    assert "OperatorKernels.md" in table["source"] and table["source_commit"].count("@") == 1
    ops = table["kernels"]["ai.onnx"]
    assert len(ops) > 150 and ops["Reshape"][0] == [21, "ALL"]
    assert table["kernels"]["com.microsoft"]["MatMulNBits"] == [[1, "NBITS"]]


def test_int4_uses_the_four_input_asymmetric_matmulnbits(folder):
    import onnx

    model = onnx.load(str(folder / "text.int4.onnx"), load_external_data=False)
    inits = {i.name: i for i in model.graph.initializer}
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert nbits
    for node in nbits:
        assert len(node.input) == 4 and inits[node.input[3]].data_type == onnx.TensorProto.UINT8
    bits = {a.i for n in nbits for a in n.attribute if a.name == "bits"}
    assert bits == {4, 8}  # the recipe's MLP 4-bit and attention 8-bit, both DirectML's


def test_the_matmulnbits_rule_is_data_with_its_source():
    rule = D.kernel_table()["node_rules"]["com.microsoft:MatMulNBits"]
    assert rule["bits"] == [4, 8] and rule["inputs"] == ["A", "B", "scales", "zero_points"]
    assert rule["k_multiple_of_block"] and "DmlOperatorMatMulNBits.cpp" in rule["source"]


@pytest.mark.parametrize(
    "op, inputs, source, roles",
    [
        (
            "RotaryEmbedding",
            ["x", "pos", "cos", "sin"],
            "DmlOperatorRotaryEmbedding.cpp",
            ("vision", "text"),
        ),
        (
            "GroupQueryAttention",
            ["x", "k", "v", "", "", "seqlens", "total"],
            "DmlOperatorGroupQueryAttention.cpp",
            ("text",),
        ),
    ],
)
def test_the_fused_ops_rules_name_an_input_directml_would_misread(
    folder, op, inputs, source, roles
):
    """com.microsoft.RotaryEmbedding (both graphs' rotary) and GroupQueryAttention (the text
    attention) run on DirectML only with (batch, sequence, hidden) inputs: a rank-4 input, which
    the CPU kernels also take, is named, and so is one whose rank the graph does not declare.
    Every variant's graphs use the op with rank-3 inputs (the export above and this check)."""
    import onnx
    from onnx import helper

    rules = D.kernel_table()["node_rules"]
    rule = rules[f"com.microsoft:{op}"]
    assert rule["input_rank"] == 3 and source in rule["source"]
    node = helper.make_node(op, inputs, ["y"], domain="com.microsoft", name="fused")
    attrs = {}
    assert D.node_rule_problems(node, attrs, rules, {"x": 3}) == []
    assert (
        "rank 4; DirectML's kernel reads rank 3 only"
        in D.node_rule_problems(node, attrs, rules, {"x": 4})[0]
    )
    assert "rank unknown" in D.node_rule_problems(node, attrs, rules, {})[0]
    from colembed.manifest import read_manifest

    manifest = read_manifest(folder)
    for variant in ALL:
        for role in roles:
            model = onnx.load(
                str(folder / manifest.variants[variant][role].file), load_external_data=False
            )
            fused = [n for n in model.graph.node if n.op_type == op]
            ranks = D.declared_ranks(model.graph)
            assert fused and all(ranks[n.input[0]] == 3 for n in fused), (variant, role)


@pytest.mark.parametrize(
    "edit, said",
    [
        ({"bits": 2}, "2 bits"),
        ({"drop_zero_points": True}, "takes exactly A, B, scales, zero_points"),
        ({"block_size": 48}, "not a whole number of blocks of 48"),
    ],
)
def test_a_matmulnbits_form_directml_refuses_fails_the_check(folder, tmp_path, edit, said):
    """One int4 MatMulNBits node edited into a form DirectML's kernel does not take (other bits,
    no zero points, a padded last block) is named by the check; the unedited graph passes
    (above)."""
    import onnx

    model = onnx.load(str(folder / "text.int4.onnx"))
    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    for attr in node.attribute:
        if attr.name in edit:
            attr.i = edit[attr.name]
    if edit.get("drop_zero_points"):
        del node.input[3]
    path = tmp_path / "edited.onnx"
    onnx.save(model, str(path))
    problems = [p for p in D.directml_problems(path) if node.name in p]
    assert len(problems) == 1 and said in problems[0], problems


def _with_node(folder, tmp_path, make_node, opset=None):
    """A copy of the fp16 text graph with one more node reading its first input."""
    import onnx

    model = onnx.load(str(folder / "text.fp16.onnx"))
    node, outputs = make_node(model)
    model.graph.node.append(node)
    model.graph.output.extend(outputs)
    if opset is not None:
        for entry in model.opset_import:
            if entry.domain in ("", "ai.onnx"):
                entry.version = opset
    path = tmp_path / "edited.onnx"
    onnx.save(model, str(path))
    return path


def test_an_op_directml_lacks_fails_the_check(folder, tmp_path):
    from onnx import TensorProto, helper

    def det(model):
        features = model.graph.input[-1].name  # image_features, fp32 (rows, hidden)
        node = helper.make_node("Det", [features], ["det_out"], name="injected_det")
        return node, [helper.make_tensor_value_info("det_out", TensorProto.FLOAT, None)]

    problems = D.directml_problems(_with_node(folder, tmp_path, det))
    assert problems == ["ai.onnx:Det (since 11), e.g. node 'injected_det'"]


def test_a_type_directml_lacks_fails_the_check(folder, tmp_path):
    from onnx import TensorProto, helper

    def double_add(model):
        features = model.graph.input[-1].name
        cast = helper.make_node("Cast", [features], ["as_double"], to=TensorProto.DOUBLE, name="c")
        add = helper.make_node("Add", ["as_double", "as_double"], ["sum_out"], name="double_add")
        model.graph.node.append(cast)
        return add, [helper.make_tensor_value_info("sum_out", TensorProto.DOUBLE, None)]

    problems = D.directml_problems(_with_node(folder, tmp_path, double_add))
    assert problems == ["ai.onnx:Add (since 14) on double, e.g. node 'double_add'"]


def test_opset_above_20_and_allowzero_fail_the_check(folder, tmp_path):
    from onnx import helper

    def allowzero(model):
        ids = model.graph.input[0].name
        node = helper.make_node("Reshape", [ids, ids], ["reshaped"], allowzero=1, name="rz")
        return node, []

    problems = D.directml_problems(_with_node(folder, tmp_path, allowzero, opset=21))
    assert problems[0] == "default-domain opset 21 > 20"
    assert "Reshape 'rz' has allowzero=1" in problems[1]


def test_directml_sessions_get_their_options(tmp_path, monkeypatch):
    """onnxruntime-directml is Windows-only: the session it would get is recorded instead (the
    graph is never read: the recorder stands in for onnxruntime's session), and
    two threads calling `run` on it at once are seen one at a time by onnxruntime (DirectML allows
    one Run per session at a time); on the CPU provider the same two calls overlap."""
    import threading

    import onnxruntime as ort

    from colembed import sessions

    seen = {}

    class Recorder:
        """onnxruntime's session as DirectML would be given it: its options, and how many
        `run` calls are inside it at once (each waits, up to 2 s, for the other to enter)."""

        def __init__(self, path, sess_options, providers):
            seen["options"], seen["providers"] = sess_options, providers
            self.providers, self.inside, self.most = providers, 0, 0
            self.count, self.both_inside = threading.Lock(), threading.Event()

        def get_providers(self):
            return list(self.providers)

        def run(self, output_names, feeds, run_options=None):
            with self.count:
                self.inside += 1
                self.most = max(self.most, self.inside)
                if self.inside == 2:
                    self.both_inside.set()
            self.both_inside.wait(timeout=2)
            with self.count:
                self.inside -= 1
            return []

    def most_runs_at_once(session):
        threads = [threading.Thread(target=session.run, args=({},)) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return session.session.most

    monkeypatch.setattr(ort, "InferenceSession", Recorder)
    graph = str(tmp_path / "text.fp16.onnx")
    session = sessions.Session(graph, [sessions.DIRECTML, sessions.CPU])
    options = seen["options"]
    assert seen["providers"] == [sessions.DIRECTML, sessions.CPU]
    assert options.enable_mem_pattern is False
    assert options.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
    assert options.get_session_config_entry("ep.dml.enable_dynamic_graph_fusion") == "1"
    assert most_runs_at_once(session) == 1
    cpu = sessions.Session(graph, [sessions.CPU])
    assert most_runs_at_once(cpu) == 2


def test_auto_picks_fp16_on_directml_unless_a_variant_is_named(folder, monkeypatch):
    from colembed import model, sessions

    monkeypatch.setattr(sessions, "available_providers", lambda: [sessions.DIRECTML, sessions.CPU])
    assert model.default_variant(folder, "auto") == "fp16"
    assert model.default_variant(folder, None) == "fp32"
    monkeypatch.setattr(sessions, "available_providers", lambda: [sessions.CPU])
    assert model.default_variant(folder, "auto") == "fp32"


def test_doctor_reports_placement_and_parity(folder, capsys):
    """What a Windows user runs (README); here on the CPU provider, where every node must land."""
    import json

    from colembed.cli import main

    assert main(["doctor", str(folder), "--providers", "cpu", "--variant", "fp16"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out[: out.rindex("}") + 1])
    for role in ("vision", "text"):
        placed = report["placement"][role]
        assert placed["providers"]["CPUExecutionProvider"] > 10
        assert placed["off_first_provider"] == {}
    assert report["parity_vs_cpu_fp32"]["min_token_cosine"] > 0.999
    assert "every node placed there" in out
