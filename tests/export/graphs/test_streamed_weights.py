"""Graph weights streamed from the checkpoint (export/graphs/streamed_weights.py): the same graphs
as the whole-model path, byte for byte, and every checkpoint tensor that does not match refused by
name.

The equality tests export the graphs both ways from one checkpoint: a tiny ColQwen2 written in
safetensors shards (`testing/sharded.py`, so the shard index is read too), colpali-engine's
ColQwen2.5 in two shards, and the session exports (streamed) of every other layout against a
whole-model export here: ColQwen2.5 in transformers' and colpali-engine's layouts, ColQwen3 in
colpali-engine's and TomoroAI's. Same
weights in, the same bytes of every initializer and external-data file out, the same nodes, the
same outputs on onnxruntime.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.fixtures.builds import build_once


@pytest.fixture(scope="module")
def sharded_tiny(tmp_path_factory):
    """The "tiny" ColQwen2 architecture, random, in four safetensors shards."""
    from colembed_export.testing.sharded import build_sharded_checkpoint

    def build(folder):
        build_sharded_checkpoint(folder / "tiny-sharded", "tiny", seed=3, shard_bytes=12_000_000)

    return build_once(tmp_path_factory, "ckpt-tiny-sharded", build) / "tiny-sharded"


def _graphs(folder: Path, out: Path, *, stream: bool, external_data: bool | None) -> Path:
    """Both graphs of `folder` exported into `out` by the exporter's graph step, streamed or from
    the whole loaded model."""
    from colembed_export.families import export_family
    from colembed_export.families.checkpoint import check_architecture
    from colembed_export.graphs.streamed_weights import StandInModel
    from colembed_export.measure import StepMeter
    from colembed_export.pipeline.exporter import export_graphs, model_facts

    family = export_family(check_architecture(folder).name)
    standin = StandInModel(folder) if stream else None
    config = standin.model.config if stream else family.load(folder).config
    out.mkdir()
    export_graphs(
        folder,
        family,
        model_facts(config, folder, family),
        out,
        opset=18,
        external_data=external_data,
        meter=StepMeter(lambda _: None),
        standin=standin,
    )
    return out


def _nodes(model) -> list[bytes]:
    """Each node without its metadata (torch records a process-wide trace counter there)."""
    found = []
    for node in model.graph.node:
        node = type(node).FromString(node.SerializeToString())
        del node.metadata_props[:]
        found.append(node.SerializeToString())
    return found


def _feeds(folder: Path) -> dict[str, list[np.ndarray]]:
    """The exporter's example inputs per role (drawn once: both graphs get the same)."""
    import torch

    from colembed_export.families import export_family
    from colembed_export.families.checkpoint import check_architecture
    from colembed_export.families.qwen2.graphs import example_inputs
    from colembed_export.graphs.streamed_weights import StandInModel
    from colembed_export.pipeline.exporter import model_facts

    family = export_family(check_architecture(folder).name)
    model = StandInModel(folder).model
    facts = model_facts(model.config, folder, family)
    torch.manual_seed(0)
    args = example_inputs(model, facts.preprocess, facts.vision_attention, facts.vision_extras)
    return {role: [a.numpy() for a in found] for role, found in args.items()}


def _run(path: Path, feeds: list[np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, dict(zip([i.name for i in session.get_inputs()], feeds)))


def assert_same_graphs(whole: Path, streamed: Path, checkpoint: Path) -> None:
    import onnx

    feeds = _feeds(checkpoint)
    for name in ("vision.onnx", "text.onnx"):
        a = onnx.load(str(whole / name), load_external_data=False)
        b = onnx.load(str(streamed / name), load_external_data=False)
        inits_a = [i.SerializeToString() for i in a.graph.initializer]
        inits_b = [i.SerializeToString() for i in b.graph.initializer]
        assert len(inits_a) == len(inits_b) > 0
        assert inits_a == inits_b, f"{name}: initializers differ"
        assert _nodes(a) == _nodes(b), f"{name}: nodes differ"
        data = whole / f"{name}_data"
        if data.exists():
            assert data.read_bytes() == (streamed / data.name).read_bytes(), data.name
        role = name.removesuffix(".onnx")
        outputs = _run(whole / name, feeds[role]), _run(streamed / name, feeds[role])
        assert len(outputs[0]) == len(outputs[1]) > 0
        for x, y in zip(*outputs):
            np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_streamed_graphs_equal_the_whole_model_export_colqwen2(sharded_tiny, tmp_path):
    whole = _graphs(sharded_tiny, tmp_path / "whole", stream=False, external_data=True)
    streamed = _graphs(sharded_tiny, tmp_path / "streamed", stream=True, external_data=True)
    assert (streamed / "text.onnx_data").stat().st_size > 0
    assert_same_graphs(whole, streamed, sharded_tiny)


def _assert_streamed_export(checkpoint: Path, exported: Path, tmp_path: Path) -> None:
    """A session export of `checkpoint` (streamed: `streaming_applies`, weights inline) against the
    whole-model path's graphs of the same checkpoint: the same initializers, byte for byte, and
    the same nodes."""
    import onnx

    from colembed_export.families import export_family
    from colembed_export.families.checkpoint import check_architecture
    from colembed_export.graphs.streamed_weights import streaming_applies

    assert streaming_applies(checkpoint, export_family(check_architecture(checkpoint).name)) is None
    whole = _graphs(checkpoint, tmp_path / "whole", stream=False, external_data=None)
    for name in ("vision.onnx", "text.onnx"):
        a = onnx.load(str(whole / name))
        b = onnx.load(str(exported / name))
        inits = [i.SerializeToString() for i in a.graph.initializer]
        assert len(inits) > 0
        assert inits == [i.SerializeToString() for i in b.graph.initializer], name
        assert _nodes(a) == _nodes(b), name


@pytest.mark.parametrize("session_export", ["exported_tiny_2_5_alt", "exported_tiny_2_5"])
def test_the_colqwen2_5_session_exports_streamed_equal_the_whole_model_export(
    session_export, request, tmp_path
):
    """ColQwen2.5 in transformers' layout (tiny-2.5-alt) and in colpali-engine's (tiny-2.5: the
    `qwen2_5_vl` config, `custom_text_proj`, keys renamed by the layout's map)."""
    report = request.getfixturevalue(session_export)
    _assert_streamed_export(Path(report.manifest.model.source), report.folder, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["colpali", "tomoro"])
def test_the_colqwen3_session_exports_streamed_equal_the_whole_model_export(
    layout, tmp_path_factory, tmp_path
):
    """ColQwen3 in colpali-engine's bare `qwen3_vl` layout (tiny-3) and in TomoroAI's (the same
    weights under `vlm.*` / `embedding_proj_layer`, an LM head the export never reads): DeepStack
    mergers, the position table and the projection's bias all streamed."""
    from tests.fixtures import qwen3

    if layout == "colpali":
        checkpoint = qwen3.checkpoint(tmp_path_factory, "tiny-3")
        exported = qwen3.exported(tmp_path_factory, "tiny-3")
    else:
        checkpoint = qwen3.tomoro_checkpoint(tmp_path_factory)
        exported = qwen3.tomoro_exported(tmp_path_factory)
    _assert_streamed_export(checkpoint, exported, tmp_path)


@pytest.mark.slow
def test_the_colqwen3_5_session_export_streamed_equals_the_whole_model_export(
    tmp_path_factory, tmp_path
):
    """ColQwen3.5 (keys without a `model.` prefix, mapped onto the tower and colembed's text
    stack): every DeltaNet projection, the full-attention layers' gated queries, the position
    table and the projection streamed; the conv kernels and the norms read whole. One preset:
    the key map does not depend on the widths, and the alt preset interleaves both layer kinds
    (the other's streamed export is checked against the reference in test_reference.py)."""
    from tests.fixtures import colqwen3_5

    checkpoint = colqwen3_5.checkpoint(tmp_path_factory, "tiny-3.5-alt")
    exported = colqwen3_5.exported(tmp_path_factory, "tiny-3.5-alt")
    _assert_streamed_export(checkpoint, exported, tmp_path)


@pytest.mark.slow
def test_a_sharded_colpali_checkpoint_streams_and_an_absent_head_is_never_read(
    tmp_path_factory, tmp_path
):
    """colpali-engine's pre-4.52 ColQwen2.5 in two shards with an index streams to the same bytes;
    0.3.12's headless form of untied embeddings streams without the LM head, and a graph that
    read the absent head would be refused, not written from an uninitialised stand-in."""
    import onnx_ir as ir

    from colembed_export.graphs.streamed_weights import StandInModel, StreamedWeightsError
    from colembed_export.testing.tiny_qwen2_5 import to_colpali_layout
    from tests.fixtures.qwen2_5 import checkpoint

    source = checkpoint(tmp_path_factory, "tiny-2.5", "transformers")  # untied embeddings
    folder = to_colpali_layout(source, tmp_path / "sharded", pre_4_52=True, shards=2)
    assert "lm_head.weight" in (folder / "model.safetensors.index.json").read_text()
    assert (folder / "model.safetensors.index.json").is_file()
    whole = _graphs(folder, tmp_path / "whole", stream=False, external_data=True)
    streamed = _graphs(folder, tmp_path / "streamed", stream=True, external_data=True)
    assert_same_graphs(whole, streamed, folder)

    standin = StandInModel(to_colpali_layout(source, tmp_path / "headless"))
    head = standin.model.vlm.lm_head.weight
    assert head.data_ptr() != standin.model.vlm.get_input_embeddings().weight.data_ptr()
    value = ir.Value(name="head", const_value=ir.tensor(head.detach().numpy()))
    graph = ir.Graph([], [], nodes=[], initializers=[value])
    with pytest.raises(StreamedWeightsError, match="does not store"):
        standin.stream_initializers(ir.Model(graph, ir_version=10), graph=standin.model.vlm.lm_head)


def test_which_checkpoints_are_streamed(tiny_checkpoint, tmp_path, tmp_path_factory):
    """Every family and layout streams from safetensors; a folder without them does not."""
    from colembed_export.families import export_family
    from colembed_export.graphs.streamed_weights import streaming_applies
    from tests.fixtures import qwen3
    from tests.fixtures.qwen2_5 import checkpoint

    assert streaming_applies(tiny_checkpoint, export_family("colqwen2")) is None
    for layout in ("transformers", "colpali"):
        folder = checkpoint(tmp_path_factory, "tiny-2.5", layout)
        assert streaming_applies(folder, export_family("colqwen2.5")) is None, layout
    for folder in (
        qwen3.checkpoint(tmp_path_factory, "tiny-3"),
        qwen3.tomoro_checkpoint(tmp_path_factory),
    ):
        assert streaming_applies(folder, export_family("colqwen3")) is None, folder
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    assert "model.safetensors" in streaming_applies(no_weights, export_family("colqwen2"))


def test_colqwen3_5_streams_under_its_own_key_map(tmp_path_factory, tmp_path):
    """ColQwen3.5 streams (the plan names the streamed steps), every 2-D parameter a stand-in
    named by its checkpoint key (no `model.` prefix), the rest read whole; a release's `mtp.*`
    head is left out as the loader leaves it, a key under another prefix is refused by name."""
    import torch

    from colembed_export.families import export_family
    from colembed_export.graphs.streamed_weights import (
        StandInModel,
        StreamedWeightsError,
        streaming_applies,
    )
    from colembed_export.pipeline.plan import plan_export
    from tests.fixtures import colqwen3_5

    family = export_family("colqwen3.5")
    folder = colqwen3_5.checkpoint(tmp_path_factory, "tiny-3.5")
    assert streaming_applies(folder, family) is None
    steps = [s.name for s in plan_export(folder, streamed=True, check=True).steps]
    assert steps[:2] == ["graphs, streamed", "check: torch reference, layer by layer"]

    standin = StandInModel(folder, family)
    names = {s.name for s in standin.standins.values()}
    params = dict(standin.model.named_parameters())
    matrices = {n for n, p in params.items() if p.ndim == 2}
    assert names == matrices and {p.data_ptr() for p in params.values()} >= set(standin.standins)
    proj = "text.language_model.layers.0.linear_attn.in_proj_qkv.weight"
    assert (
        standin.tensors.where[proj][1] == "language_model.layers.0.linear_attn.in_proj_qkv.weight"
    )
    conv = "text.language_model.layers.0.linear_attn.conv1d.weight"
    assert params[conv].data_ptr() not in standin.standins
    assert torch.equal(params[conv], standin.tensors.read(conv))

    mtp = _edited_checkpoint(
        folder, tmp_path / "mtp", lambda t: {**t, "mtp.fc.weight": torch.ones(2, 2)}
    )
    assert StandInModel(mtp, family).tensors.where.keys() == standin.tensors.where.keys()
    key = "custom_text_proj.weight"
    moved = _edited_checkpoint(
        folder,
        tmp_path / "moved",
        lambda t: {("model." if k == key else "") + k: v for k, v in t.items()},
    )
    with pytest.raises(StreamedWeightsError, match=f"model.{key}"):
        StandInModel(moved, family)


def _edited_checkpoint(source: Path, out: Path, edit) -> Path:
    """A copy of `source` whose single safetensors file went through `edit(tensors) -> tensors`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    tensors = edit(load_file(out / "model.safetensors"))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


QKV = "vlm.model.visual.blocks.0.attn.qkv.weight"


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda t: {**t, QKV: t[QKV][:-1]}, f"{QKV}: shape"),
        (lambda t: {**t, QKV: t[QKV].double()}, f"{QKV}: dtype F64"),
        (lambda t: {**t, QKV: t[QKV].to(__import__("torch").int32)}, f"{QKV}: dtype I32"),
        (lambda t: {k: v for k, v in t.items() if k != QKV}, f"missing {QKV}"),
        (
            lambda t: {**t, "vlm.extra.weight": t[QKV].clone()},
            "unexpected vlm.extra.weight",
        ),
    ],
    ids=["shape", "float64", "int32", "missing", "unexpected"],
)
def test_a_tensor_that_does_not_match_is_refused_by_name(tiny_checkpoint, tmp_path, edit, expected):
    from colembed_export.graphs.streamed_weights import StandInModel, StreamedWeightsError

    folder = _edited_checkpoint(tiny_checkpoint, tmp_path / "edited", edit)
    with pytest.raises(StreamedWeightsError) as refused:
        StandInModel(folder)
    assert expected in str(refused.value)
    assert "1 tensor(s)" in str(refused.value)


def test_half_precision_checkpoints_widen_exactly(tiny_checkpoint, tmp_path):
    """A bf16 checkpoint's tensors read as the strict loader's fp32 values, bit for bit."""
    import torch

    from colembed_export.families.checkpoint import load_strict
    from colembed_export.graphs.streamed_weights import CheckpointTensors

    folder = _edited_checkpoint(
        tiny_checkpoint,
        tmp_path / "bf16",
        lambda t: {k: v.to(torch.bfloat16) for k, v in t.items()},
    )
    loaded = dict(load_strict(folder).named_parameters())
    tensors = CheckpointTensors(folder)
    assert tensors.describe(QKV)[1] == "BF16"
    for name in (QKV, "vlm.model.language_model.norm.weight", "embedding_proj_layer.weight"):
        assert torch.equal(tensors.read(name), loaded[name].detach()), name


def test_a_graph_reading_part_of_a_weight_is_refused(tiny_checkpoint):
    """A stand-in read as a slice (not the weight or its transpose) cannot come from the file."""
    import onnx_ir as ir

    from colembed_export.graphs.streamed_weights import StandInModel, StreamedWeightsError

    standin = StandInModel(tiny_checkpoint)
    visual = standin.model.vlm.model.visual
    weight = visual.blocks[0].attn.qkv.weight.detach().numpy()
    value = ir.Value(name="part", const_value=ir.tensor(weight[1:]))
    graph = ir.Graph([], [], nodes=[], initializers=[value])
    with pytest.raises(StreamedWeightsError, match=f"part of {QKV}"):
        standin.stream_initializers(ir.Model(graph, ir_version=10), graph=visual)


def test_no_two_stand_ins_hold_equal_contents(tiny_checkpoint, monkeypatch):
    """Stand-ins are uninitialised memory, often zeros: the exporter's passes merge equal
    initializers, which would leave one stand-in unread. Each holds a distinct first element,
    even when the allocator hands out zeroed memory."""
    import torch

    from colembed_export.graphs.streamed_weights import StandInModel

    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).zero_())
    standin = StandInModel(tiny_checkpoint)
    firsts = [
        float(p.detach().view(-1)[0])
        for p in standin.model.parameters()
        if p.data_ptr() in standin.standins
    ]
    assert len(firsts) > 10 and len(set(firsts)) == len(firsts)


def test_an_unread_weight_is_refused(tiny_checkpoint):
    """Every stand-in of the traced module must be written from the file: one the graph holds
    in another form (a copy, a product) would be written as the stand-in's garbage."""
    import onnx_ir as ir

    from colembed_export.graphs.streamed_weights import StandInModel, StreamedWeightsError

    standin = StandInModel(tiny_checkpoint)
    visual = standin.model.vlm.model.visual
    copy = visual.blocks[0].attn.qkv.weight.detach().numpy().copy()
    value = ir.Value(name="copied", const_value=ir.tensor(copy))
    graph = ir.Graph([], [], nodes=[], initializers=[value])
    with pytest.raises(StreamedWeightsError, match=QKV):
        standin.stream_initializers(ir.Model(graph, ir_version=10), graph=visual)


def test_the_sharded_builder_writes_a_checkpoint_transformers_loads(sharded_tiny):
    from colembed_export.families.checkpoint import load_strict

    index = json.loads((sharded_tiny / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in sharded_tiny.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    model = load_strict(sharded_tiny)
    assert set(index["weight_map"]) == {n for n, _ in model.named_parameters()}
