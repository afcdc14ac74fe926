"""Variants (int8, int4, fp16): written by the exporter on request, gated against fp32, loadable by name.

One export of the tiny fixture with all three variants (conftest's `exported_variants`, shared with
test_directml.py) serves the module; the stress checkpoint's are in test_variants_stress.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from colembed_export.variants import gates as E
from colembed_export.graphs import edits as G
from colembed_export.variants import recipes as R
from colembed_export.variants import write as V
from colembed.layout import BASE_VARIANT
from tests.fixtures.builds import variant_step

pytestmark = pytest.mark.heavy("tiny-variants")

ALL = ("int8", "int4", "fp16")


def _load_proto(folder: Path, file: str):
    import onnx

    return onnx.load(str(folder / file))


# ------------------------------------------------------------------------------ manifest / files
def test_manifest_lists_every_variant_with_its_check(exported_variants):
    from colembed.manifest import read_manifest

    folder = exported_variants.folder
    manifest = read_manifest(folder)
    assert set(manifest.variants) == {"fp32", *ALL}
    for name in ALL:
        for role in ("vision", "text"):
            entry = manifest.graph(name, role)
            assert entry.file in manifest.files, entry.file
            assert entry.data_file == entry.file + "_data"  # fp32 was external, so are variants
            assert entry.data_file in manifest.files
            assert entry.contract == manifest.graph("fp32", role).contract
        figures = manifest.checks[name]
        json.dumps(figures.to_dict())  # JSON-able
        assert figures["gate"] == V.GATES[name].to_dict()
        assert figures["tokens"] > 0
    assert exported_variants.check.keys() >= {"fp32", *ALL}
    # the int4 variant reuses the int8 vision graph (vision is compute-bound: see variants.py)
    assert manifest.graph("int4", "vision").file == manifest.graph("int8", "vision").file
    assert manifest.graph("int4", "text").file == "text.int4.onnx"
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no leftovers


@pytest.mark.parametrize("name", ALL)
def test_gates_recorded_and_met(exported_variants, name):
    figures = exported_variants.manifest.checks[name]
    gate = V.GATES[name]
    assert figures["mean_cosine"] >= gate.mean_cosine
    if gate.min_cosine is not None:
        assert figures["min_cosine"] >= gate.min_cosine


def test_no_reshape_allowzero_in_any_variant_graph(exported_variants):
    folder = exported_variants.folder
    for name in ALL:
        for role in ("vision", "text"):
            model = _load_proto(folder, exported_variants.manifest.graph(name, role).file)
            bad = [
                n.name
                for n in model.graph.node
                if n.op_type == "Reshape"
                for a in n.attribute
                if a.name == "allowzero" and a.i == 1
            ]
            assert not bad, (name, role, bad)


# ----------------------------------------------------------------------------------- recipes
def test_int8_is_dynamic_per_channel_signed(exported_variants):
    from onnx import TensorProto, numpy_helper

    model = _load_proto(exported_variants.folder, "text.int8.onnx")
    inits = {i.name: i for i in model.graph.initializer}
    integer = [n for n in model.graph.node if n.op_type == "MatMulInteger"]
    assert integer and not any(
        n.op_type == "MatMul" and n.input[1] in inits for n in model.graph.node
    )
    for node in integer:
        weight = inits[node.input[1]]
        assert weight.data_type == TensorProto.INT8
        zero_point = numpy_helper.to_array(inits[node.input[3]])
        assert zero_point.shape == (weight.dims[1],)  # one per output channel


def test_int4_graph_is_the_recipe_its_docstring_states(exported_variants):
    """Each weight-MatMul of the fp32 text graph is, in text.int4.onnx, what recipes.INT4_ROLE_BITS
    gives its module path (MatMulNBits of 4 or 8 bits, or the fp32 MatMul), every MatMulNBits
    with the recipe's block size, accuracy level and zero points; and the knobs are the ones
    recipes.py's docstring states and benchmarks/results/variants/variants-int4-recipes*.md measured (a
    change to a knob fails here until the docstring, docs/variants.md and this test follow)."""
    import onnx_ir as ir

    assert (R.INT4_BLOCK_SIZE, R.INT4_ACCURACY_LEVEL, R.INT4_SYMMETRIC) == (16, 4, False)
    assert R.INT4_DEFAULT_BITS == 4 and R.INT4_BLOCK_SIZE_8BIT == 128
    assert R.INT4_ROLE_BITS == (("projection", 32), ("self_attn", 8))

    folder = exported_variants.folder
    fp32 = ir.load(folder / "text.onnx")
    int4 = ir.load(folder / "text.int4.onnx")
    nodes = {n.name: n for n in int4.graph}
    seen = {4: 0, 8: 0, 32: 0}
    for matmul in R.weight_matmuls(fp32):
        bits = R.int4_bits(G.module_path(matmul), R.INT4_ROLE_BITS)
        seen[bits] += 1
        if bits == 32:
            assert nodes[matmul.name].op_type == "MatMul", G.module_path(matmul)
            continue
        node = nodes[f"{matmul.name}_q{bits}"]
        attrs = {k: a.value for k, a in node.attributes.items()}
        assert node.op_type == "MatMulNBits" and attrs["bits"] == bits, G.module_path(matmul)
        block = R.INT4_BLOCK_SIZE if bits == 4 else R.INT4_BLOCK_SIZE_8BIT
        assert attrs["block_size"] == R.fitting_block(attrs["K"], block)
        assert attrs["K"] % attrs["block_size"] == 0  # whole blocks (DirectML takes no others)
        assert attrs["accuracy_level"] == R.INT4_ACCURACY_LEVEL
        assert len(node.inputs) == (3 if R.INT4_SYMMETRIC else 4)  # zero points when asymmetric
    assert seen[4] and seen[8] and seen[32]  # MLP 4-bit, attention 8-bit, the projection fp32
    assert sum(n.op_type == "MatMulNBits" for n in int4.graph) == seen[4] + seen[8]


def test_fitting_block_halves_to_a_whole_number_of_blocks():
    assert R.fitting_block(8960, 128) == 128  # Qwen2-VL-2B's MLP width: whole blocks as asked
    assert R.fitting_block(96, 128) == 32 and R.fitting_block(80, 64) == 16
    assert R.fitting_block(40, 128) == 16  # no whole block above 16: 16, the kernel's smallest


def test_int4_role_bits_pick_the_first_fragment_found():
    rules = (("projection", 32), ("mlp.down_proj", 8))
    assert R.int4_bits("language_model.layers.3.mlp.down_proj", rules) == 8
    assert R.int4_bits("projection", rules) == 32
    assert R.int4_bits("language_model.layers.3.mlp.up_proj", rules) == R.INT4_DEFAULT_BITS
    assert R.int4_bits("language_model.layers.3.mlp.up_proj", (("", 8),)) == 8


@pytest.mark.parametrize("role", ["vision", "text"])
def test_fp16_keeps_io_norms_and_softmax_fp32(exported_variants, role):
    import onnx
    from onnx import TensorProto

    model = _load_proto(exported_variants.folder, f"{role}.fp16.onnx")
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
    }
    types.update({i.name: i.data_type for i in model.graph.initializer})
    for value in [*model.graph.input, *model.graph.output]:
        assert value.type.tensor_type.elem_type in (TensorProto.FLOAT, TensorProto.INT64), (
            value.name
        )
    kept = [
        n
        for n in model.graph.node
        if n.op_type in ("LayerNormalization", "Softmax", "ReduceMean", "Pow", "Sqrt")
    ]
    assert kept
    for node in kept:
        assert types[node.input[0]] == TensorProto.FLOAT, (node.op_type, node.name)
    half_matmuls = [
        n
        for n in model.graph.node
        if n.op_type == "MatMul" and types.get(n.input[1]) == TensorProto.FLOAT16
    ]
    assert half_matmuls  # the weights really are fp16
    import onnx_ir as ir

    graph = ir.from_proto(model).graph
    projection = {
        v.name
        for n in graph
        if any("projection" in s for s in G.scopes(n))
        for v in n.inputs
        if v is not None
    }
    assert not [
        v.name
        for v in graph.initializers.values()
        if v.dtype == ir.DataType.FLOAT
        and len(v.shape) == 2
        and min(v.shape) > 1
        and v.name not in projection
    ]


@pytest.mark.parametrize("role", ["vision", "text"])
def test_fp16_has_no_value_rounding_through_fp16(exported_variants, role):
    import onnx_ir as ir

    model = ir.load(exported_variants.folder / f"{role}.fp16.onnx")
    assert G.round_trip_casts(model) == []


def test_round_trip_casts_are_found():
    import onnx_ir as ir
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16, name="down"),
        helper.make_node("Cast", ["h"], ["y"], to=TensorProto.FLOAT, name="up"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    assert G.round_trip_casts(ir.from_proto(helper.make_model(graph))) == ["up"]


def test_finish_sorts_and_clears_allowzero_in_subgraphs():
    import onnx_ir as ir
    from onnx import TensorProto, helper

    def reshape(name, source="x"):
        return helper.make_node("Reshape", [source, "s"], [name], allowzero=1)

    branch = helper.make_graph(
        [reshape("y_then")],
        "then",
        [],
        [helper.make_tensor_value_info("y_then", TensorProto.FLOAT, None)],
    )
    other = helper.make_graph(
        [reshape("y_else")],
        "else",
        [],
        [helper.make_tensor_value_info("y_else", TensorProto.FLOAT, None)],
    )
    node_if = helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=other)
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("x", "s")]
    inputs.append(helper.make_tensor_value_info("c", TensorProto.BOOL, []))
    # out of order on purpose: z2 reads z before z is made
    graph = helper.make_graph(
        [reshape("z2", "z"), reshape("z"), node_if],
        "g",
        inputs,
        [helper.make_tensor_value_info("z2", TensorProto.FLOAT, None)],
    )
    model = ir.from_proto(helper.make_model(graph))
    assert G.finish(model) == 4
    assert [n.outputs[0].name for n in model.graph][:2] == ["z", "z2"]
    assert G.finish(model) == 0


def test_parse_variants():
    assert V.parse_variants("int8, int4,int8,fp32") == ["int8", "int4"]
    assert V.parse_variants(["FP16"]) == ["fp16"]
    from colembed.errors import ExportError

    with pytest.raises(ExportError, match="int3"):
        V.parse_variants("int8,int3")


# ---------------------------------------------------------------------------------- runtime
@pytest.mark.parametrize("name", ALL)
def test_load_by_name_matches_fp32(exported_variants, name):
    """Loading by name gives the graphs the gate judged: each sample item's figure again."""
    import colembed
    from colembed_export.pipeline.verify import SAMPLE_QUERIES, sample_pages

    folder = exported_variants.folder
    model = colembed.load(folder, variant=name)
    reference = colembed.load(folder)
    assert model.variant == name
    recorded = exported_variants.manifest.checks[name]["items"]
    for i, query in enumerate(SAMPLE_QUERIES):
        cos = E.token_cosines(model.embed_queries([query]), reference.embed_queries([query]))
        assert cos.mean() == pytest.approx(recorded[f"query: sample query {i}"]["mean"], abs=1e-6)
    for i, page in enumerate(sample_pages()):
        cos = E.token_cosines(
            model.embed_images([page], batch_size=1), reference.embed_images([page], batch_size=1)
        )
        label = f"page: sample page {i} {page.size[0]}x{page.size[1]}"
        assert cos.mean() == pytest.approx(recorded[label]["mean"], abs=1e-6)


def test_gate_figures_cover_lengths_pages_and_mixed_batches(exported_variants):
    """The recorded gate set reaches the query bound, the smallest and the full-budget page,
    both strips and mixed batches, with a bucket per length range and the worst item named."""
    figures = exported_variants.manifest.checks["int8"]
    items = figures["items"]
    bound = max(row["tokens"] for n, row in items.items() if n.startswith("query: "))
    assert bound == 779  # tiny's budget: 768 image tokens + the page prompt
    for label in (
        "page: smallest page 20x20",
        "page: full-budget letter page 1700x2200",
        "page: wide strip 2000x40",
        "page: tall strip 40x2000",
        "query in a mixed batch: sentence repeated to 779 tokens",
        "page in a mixed batch: wide strip 2000x40",
    ):
        assert label in items, sorted(items)
    assert set(figures["buckets"]) >= {
        "queries 1-16 tokens",
        "queries 257+ tokens",
        "pages 1-64 tokens",
        "pages 257+ tokens",
    }
    assert items[figures["worst_item"]]["min"] == pytest.approx(figures["min_cosine"], abs=1e-9)


def test_mixed_page_batches_pair_unlike_lengths():
    assert E.mixed_page_batches([5, 900, 40, 1, 300]) == [[1, 3], [4, 0, 2]]
    assert E.mixed_page_batches([7, 3]) == [[0, 1]]
    assert E.mixed_page_batches([7]) == [[0]]
    assert E.mixed_page_batches([]) == []


def test_gate_runs_without_arena_and_mixes_pages_in_pairs(exported_variants):
    """What bounds the gate's memory (docs/variants.md, "The variant step's memory"): its models
    keep no CPU arena, and its mixed page runs hold two or three pages each, every one beside a
    page of another length (the full-budget page beside the smallest), not every page at once;
    and a batch still leaves every page's vectors as they are alone."""
    import colembed

    model = colembed.load(exported_variants.folder, **E.GATE_LOAD)
    assert not any(s.options.enable_cpu_mem_arena for s in model._sessions.values())
    recorded = E.recording_feeds(model)
    pages = E.gate_pages(model)
    got = E._embed_gate_set(model, E.gate_queries(model)[:1], pages)  # one query: no query batch
    mask_name = model._contracts["text"].inputs[1].name
    runs = [f[mask_name].sum(axis=1) for f in recorded["text"] if f[mask_name].shape[0] > 1]
    tokens = [len(v) for v in got["pages"]]
    assert sorted(sorted(run.tolist()) for run in runs) == sorted(
        sorted(tokens[i] for i in batch) for batch in E.mixed_page_batches(tokens)
    )
    assert all(2 <= len(run) <= 3 and run.min() < run.max() for run in runs)
    assert any(run.max() == max(tokens) and run.min() == min(tokens) for run in runs)
    assert sum(len(run) for run in runs) == len(pages)
    cos = E.token_cosines(got["mixed_pages"], got["pages"])
    assert cos.min() > 0.9999


def test_unknown_variant_names_the_ones_there(exported_variants):
    import colembed
    from colembed.errors import ModelFolderError

    with pytest.raises(ModelFolderError, match="int8"):
        colembed.load(exported_variants.folder, variant="int3")


@pytest.mark.parametrize("name", ALL)
def test_ranking_gate_ran_on_clear_winners(exported_variants, name):
    ranking = exported_variants.manifest.checks[name]["ranking"]
    assert ranking["queries"] >= E.MIN_CLEAR_QUERIES
    assert ranking["top1_agreement"] >= V.GATES[name].top1_agreement


def test_ranking_set_has_clear_winners_and_agreement_can_fail(exported_variants):
    import colembed

    pages, queries = E.ranking_set()
    scores = E.embed_ranking_set(colembed.load(exported_variants.folder), pages, queries)
    clear = E.clear_winners(scores)
    assert clear.size >= E.MIN_CLEAR_QUERIES
    assert E.top1_agreement(scores, scores, clear)["top1_agreement"] == 1.0
    shuffled = scores[:, np.random.default_rng(0).permutation(scores.shape[1])]
    assert E.top1_agreement(shuffled, scores, clear)["top1_agreement"] < 0.5


# ------------------------------------------------------------------------------ gate failure
# The refusals below run the exporter's variant step alone over a staging copy of the session
# export's fp32 graphs (`variant_step`): the fp32 graphs are the same whoever traces them, and
# tracing them is most of an export's time. What the exporter itself does with a refusal (the
# steps before it, the folder committed and named in the error, no staging left) is
# test_exporter_refuses_a_variant_that_fails_only_long_queries's, through `export_model` whole.
def test_missed_gate_raises_and_writes_the_folder_without_the_variant(
    exported_variants, tmp_path, monkeypatch
):
    from colembed.errors import ExportError

    impossible = V.VariantSpec("int8", V.VARIANTS["int8"].recipes, V.Gate(mean_cosine=1.5))
    monkeypatch.setitem(V.VARIANTS, "int8", impossible)
    staging = tmp_path / "model"
    with pytest.raises(ExportError, match=r"int8: mean cosine 0\.99\d+ < 1\.5") as refused:
        variant_step(exported_variants.folder, staging, ["int8"])
    # (a spec without a fallback: one attempt) The refusal carries what was measured up to it (bench_export.py reports a refused variant).
    assert refused.value.checks["int8"]["mean_cosine"] < 1.5
    assert "buckets" in refused.value.checks["int8"]
    steps = [s["step"] for s in refused.value.steps]
    assert "variants: gate set through int8" in steps
    assert_left_without(refused.value, staging, refused=["int8"], kept=[])  # no staging left


def test_an_unjudgeable_ranking_is_refused_before_any_variant_is_made(
    exported_variants, tmp_path, monkeypatch
):
    """fp32's gate-set run comes first: when its ranking set has too few clear winners, no variant
    graph is made (at 4B size that was 9 minutes of graphs that could never be written)."""
    from colembed.errors import ExportError

    pages, queries = E.ranking_set()
    monkeypatch.setattr(E, "ranking_set", lambda: ([pages[0]] * len(pages), queries))
    made = []
    monkeypatch.setattr(V, "make_graph", lambda *a, **k: made.append(a) or 1 / 0)
    staging = tmp_path / "model"
    with pytest.raises(ExportError, match=r"clear-winner queries under fp32 \(< 16\)") as refused:
        variant_step(exported_variants.folder, staging, ["int8", "fp16"])
    assert made == []
    steps = [s["step"] for s in refused.value.steps]
    assert "variants: gate set through fp32" in steps
    assert not any(s.startswith("variants: make") for s in steps)
    assert "no variant was made (int8, fp16)" in str(refused.value)
    assert_left_without(refused.value, staging, refused=["int8", "fp16"], kept=[])


def assert_written_without(error, out, *, refused, kept):
    """A refusal through `export_model` keeps what passed: the error names the folder it wrote,
    which holds what `assert_left_without` says, and no staging folder is left beside it."""
    assert error.written == out
    assert f"written without them: {out} ({', '.join([BASE_VARIANT, *kept])})" in str(error)
    assert_left_without(error, out, refused=refused, kept=kept)


def assert_left_without(error, out, *, refused, kept):
    """A refusal keeps what passed: `out` holds the checked fp32 graphs and the `kept` variants
    (listed, loadable, with their checks), no file of a `refused` one, and nothing is left beside
    it (no staging or scratch folder)."""
    import colembed
    from colembed.manifest import read_manifest

    assert error.refused == refused and error.kept == kept
    manifest = read_manifest(out)
    assert sorted(manifest.variants) == sorted([BASE_VARIANT, *kept])
    assert sorted(manifest.checks) == sorted([BASE_VARIANT, *kept]) or sorted(
        manifest.checks
    ) == sorted(kept)  # fp32's check is absent when the export ran unchecked
    listed = {g.file for graphs in manifest.variants.values() for g in graphs.values()}
    for name in refused:
        assert not [f for f in out.iterdir() if f".{name}" in f.name and f.name not in listed]
    assert [p.name for p in out.parent.iterdir()] == [out.name]
    for name in [BASE_VARIANT, *kept]:
        model = colembed.load(out, variant=name)
        assert model.embed_queries(["a refused variant leaves the rest"])[0].shape[-1] > 0


def _flip_output_sign(model, prefix: str, sign) -> None:
    """Multiply the graph's first output by the +-1 factor the nodes `sign(graph, out, const)`
    compute (their last output, broadcast against the output): a variant wrong only where the
    factor is -1. The new nodes are named `prefix_<i>`; `const(label, array)` adds an
    initializer."""
    import onnx_ir as ir

    graph = model.graph
    out = graph.outputs[0]
    name, out.name = out.name, f"{out.name}_unbroken"

    def const(label, array):
        value = ir.Value(name=label, const_value=ir.tensor(np.asarray(array), name=label))
        graph.register_initializer(value)
        return value

    nodes = sign(graph, out, const)
    nodes.append(ir.node("Mul", [out, nodes[-1].outputs[0]]))
    nodes[-1].outputs[0].name = name
    nodes[-1].outputs[0].type, nodes[-1].outputs[0].shape = out.type, out.shape
    for i, node in enumerate(nodes):
        node.name = f"{prefix}_{i}"
        if i < len(nodes) - 1:
            node.outputs[0].name = f"{prefix}_{i}_out"
    graph.extend(nodes)
    graph.outputs[0] = nodes[-1].outputs[0]


def _break_tokens_past(model, position: int) -> None:
    """Flip the sign of every output vector at or past `position` (a variant that holds on short
    inputs and fails long ones, as per-tensor int8 did under trained-like activations)."""
    import onnx_ir as ir

    def sign(graph, out, const):
        nodes = [ir.node("Shape", [out], attributes={"start": 1, "end": 2})]
        nodes.append(ir.node("Squeeze", [nodes[-1].outputs[0]]))
        nodes.append(
            ir.node(
                "Range",
                [
                    const("zero", np.array(0, np.int64)),
                    nodes[-1].outputs[0],
                    const("one", np.array(1, np.int64)),
                ],
            )
        )
        nodes.append(
            ir.node("Less", [nodes[-1].outputs[0], const("limit", np.array(position, np.int64))])
        )
        nodes.append(
            ir.node(
                "Where",
                [
                    nodes[-1].outputs[0],
                    const("plus", np.array(1.0, np.float32)),
                    const("minus", np.array(-1.0, np.float32)),
                ],
            )
        )
        shape = const("shape", np.array([1, -1, 1], np.int64))
        nodes.append(ir.node("Reshape", [nodes[-1].outputs[0], shape]))
        return nodes

    _flip_output_sign(model, "break", sign)


@pytest.mark.slow  # runs the exporter
def test_exporter_refuses_a_variant_that_fails_only_long_queries(
    tiny_checkpoint, tmp_path, monkeypatch
):
    """The gate samples queries up to the bound: a variant right on every short query and page
    but wrong past 300 tokens is refused, naming the long queries; the folder is written with
    fp32 and the variant that passed (fp16), without the refused one."""
    from colembed.errors import ExportError
    from colembed_export.pipeline.exporter import export_model

    made = V.make_graph

    def broken(recipe, src, work, calibration, **options):
        model, figures = made(recipe, src, work, calibration, **options)
        if src.name.startswith("text") and recipe.startswith("int8"):
            _break_tokens_past(model, 300)
        return model, figures

    monkeypatch.setattr(V, "make_graph", broken)
    out = tmp_path / "model"
    with pytest.raises(ExportError) as refused:  # one code forced: no two-code attempt to judge too
        export_model(
            tiny_checkpoint, out, check=False, variants=["int8", "fp16"], int8_weight_passes=1
        )
    message = str(refused.value)
    assert "int8: min cosine -" in message and "sentence repeated to 450 tokens" in message
    assert "worst item '" in message  # a page past 300 tokens is broken too: either may be worst
    below = message.split("below it:")[1].split("\n")[0]
    assert "query: sentence repeated to 779 tokens" in below and "sample" not in below
    assert "64 tokens" not in below and "221 tokens" not in below
    assert "not written: int8:" in message and "fp16" not in message.split("written without")[0]
    assert "buckets" in refused.value.checks["int8"]  # what was measured up to the refusal
    steps = [s["step"] for s in refused.value.steps]  # every step run, the graphs' export too
    assert "export the text graph" in steps and "variants: gate set through int8" in steps
    assert_written_without(refused.value, out, refused=["int8"], kept=["fp16"])


def _break_token_ids(model, ids) -> None:
    """Flip the sign of the output vector of every token whose id is in `ids` (a variant that
    is wrong on one kind of token only, as int8 was on digits and spaces under trained-like
    activations)."""
    import onnx_ir as ir

    def sign(graph, out, const):
        input_ids = next(v for v in graph.inputs if v.name == "input_ids")
        nodes = [ir.node("Unsqueeze", [input_ids, const("last", np.array([-1], np.int64))])]
        ids_value = const("ids", np.asarray(ids, np.int64))
        nodes.append(ir.node("Equal", [nodes[-1].outputs[0], ids_value]))
        nodes.append(ir.node("Cast", [nodes[-1].outputs[0]], attributes={"to": ir.DataType.FLOAT}))
        nodes.append(
            ir.node(
                "ReduceMax",
                [nodes[-1].outputs[0], const("axis", np.array([-1], np.int64))],
                attributes={"keepdims": 1},
            )
        )
        minus_two = const("minus_two", np.array(-2.0, np.float32))
        nodes.append(ir.node("Mul", [nodes[-1].outputs[0], minus_two]))
        one = const("one_f", np.array(1.0, np.float32))
        nodes.append(ir.node("Add", [nodes[-1].outputs[0], one]))
        return nodes

    _flip_output_sign(model, "break_ids", sign)


def test_exporter_refuses_a_variant_wrong_only_on_digits(
    exported_variants, tiny_checkpoint, tmp_path, monkeypatch
):
    """The gate holds every kind of query token: a variant right on every word, space,
    punctuation mark and page but wrong on the ten digit tokens is refused, the miss naming the
    digits class and a digit as the worst token; no other class is named."""
    from tokenizers import Tokenizer

    from colembed.errors import ExportError

    tokenizer = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    digits = [tokenizer.token_to_id(str(d)) for d in range(10)]
    assert None not in digits
    made = V.make_graph

    def broken(recipe, src, work, calibration, **options):
        model, figures = made(recipe, src, work, calibration, **options)
        if src.name.startswith("text") and recipe.startswith("int8"):
            _break_token_ids(model, digits)
        return model, figures

    monkeypatch.setattr(V, "make_graph", broken)
    with pytest.raises(ExportError) as refused:  # the variant step alone, as the others above
        variant_step(exported_variants.folder, tmp_path / "model", ["int8"], int8_weight_passes=1)
    message = str(refused.value)
    classes = [line for line in message.splitlines() if "query tokens of class" in line]
    assert classes and all("class 'digits'" in line for line in classes), message
    worst = refused.value.checks["int8"]["worst_token"]
    assert worst["class"] == "digits" and worst["text"] in "0123456789", worst
    assert worst["cosine"] < 0 and repr(worst["text"]) in message
    rows = refused.value.checks["int8"]["token_classes"]
    assert rows["digits"]["min"] < 0
    assert all(row["min"] > 0.95 for kind, row in rows.items() if kind != "digits"), rows


# ----------------------------------------------------------------------------- int4, streamed
def test_streamed_int4_is_onnxruntimes_quantizer_bit_for_bit(exported_variants):
    """The weight-by-weight int4 writer gives the very MatMulNBits weights, scales and zero points
    onnxruntime's MatMulNBitsQuantizer (the whole-model path it replaces) gives."""
    import onnx
    import onnx_ir as ir
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from colembed_export.variants import recipes as R

    src = exported_variants.folder / "text.onnx"
    proto = onnx.load(str(src))
    old = MatMulNBitsQuantizer(
        proto,
        bits=4,
        block_size=R.INT4_BLOCK_SIZE,
        is_symmetric=False,
        accuracy_level=R.INT4_ACCURACY_LEVEL,
        op_types_to_quantize=("MatMul",),
        quant_axes=(("MatMul", 0),),
    )
    old.process()
    old_model = ir.from_proto(old.model.model)
    new_model = R.quantize_int4(src, role_bits=(), symmetric=False)  # the writer, every MatMul

    def nbits(model):
        found = {}
        for node in model.graph:
            if node.op_type == "MatMulNBits":
                found[node.inputs[0].name] = found.get(node.inputs[0].name, []) + [
                    (
                        {k: a.value for k, a in node.attributes.items()},
                        [v.const_value.numpy() for v in node.inputs[1:]],
                    )
                ]
        return found

    old_nodes, new_nodes = nbits(old_model), nbits(new_model)
    assert sum(map(len, new_nodes.values())) == sum(map(len, old_nodes.values())) > 0
    for activation, rows in old_nodes.items():
        for (old_attrs, old_arrays), (new_attrs, new_arrays) in zip(
            sorted(rows, key=lambda r: r[1][1].shape),
            sorted(new_nodes[activation], key=lambda r: r[1][1].shape),
        ):
            assert new_attrs == old_attrs
            for a, b in zip(old_arrays, new_arrays):
                np.testing.assert_array_equal(a.reshape(b.shape), b)


INT4_MEMORY_PROBE = """
import json, sys
from pathlib import Path
from colembed_export.measure import peak_rss_bytes, rss_bytes, _reset_peak
from colembed_export.variants.recipes import quantize_int4
import onnxruntime.capi._pybind_state, onnx_ir  # noqa: F401  (imported before the baseline)
before = rss_bytes()
_reset_peak()
model = quantize_int4(Path(sys.argv[1]))
print(json.dumps({"before": before, "peak": peak_rss_bytes()}))
"""


def test_int4_writer_holds_one_fp32_weight_at_a_time(tmp_path):
    """400 MB of fp32 weights: the int4 graph is made with less than half of that in memory
    (the int4 weights plus one mapped fp32 weight); the whole-model quantizer loaded all of it."""
    import json
    import subprocess
    import sys

    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    depth, width, count = 2048, 6144, 8
    nodes, weights, outputs = [], [], []
    for i in range(count):
        weights.append(
            numpy_helper.from_array(rng.standard_normal((depth, width), np.float32), f"w{i}")
        )
        nodes.append(helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"], name=f"mm{i}"))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, width]))
    graph = helper.make_graph(
        nodes,
        "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, depth])],
        outputs,
        initializer=weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    src = tmp_path / "wide.onnx"
    onnx.save(model, str(src), save_as_external_data=True, location="wide.onnx_data")
    del model, graph, weights
    fp32_bytes = depth * width * count * 4
    run = subprocess.run(
        [sys.executable, "-c", INT4_MEMORY_PROBE, str(src)],
        capture_output=True,
        text=True,
        check=True,
    )
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    assert figures["peak"] - figures["before"] < 0.5 * fp32_bytes, figures


# ------------------------------------------------------------------------- colembed check-variant
def test_check_variant_on_a_users_queries_and_pages(exported_variants, tmp_path, capsys):
    """`colembed check-variant` embeds the user's queries and pages (a PDF and an image, by the
    index's reader) with fp32 and the variant: per item, per token class, ranking agreement;
    --fail-below turns a low token into exit 1; a variant the folder lacks is a usage error."""
    from PIL import Image

    from colembed.cli import main

    queries = tmp_path / "queries.txt"
    queries.write_text(
        "What was the revenue in 2023?\n\nInvoice INV-2024-00317: $48,250.00\n"
        "表格中的数字是多少？\n",
        encoding="utf-8",
    )
    pages = tmp_path / "pages"
    pages.mkdir()
    Image.new("RGB", (200, 260), "white").save(pages / "blank.png")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (300, 220, 3), np.uint8)).save(
        pages / "two.pdf",
        save_all=True,
        append_images=[Image.fromarray(rng.integers(0, 256, (300, 220, 3), np.uint8))],
    )
    folder = str(exported_variants.folder)
    args = [
        "check-variant",
        folder,
        "--variant",
        "int8",
        "--queries",
        str(queries),
        "--pages",
        str(pages),
    ]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["item"] for r in report["pages"]] == [
        "blank.png page 1",
        "two.pdf page 1",
        "two.pdf page 2",
    ]
    assert len(report["queries"]) == 3 and report["ranking"]["queries"] == 3
    assert {"digits", "punctuation", "letters: CJK", "special"} <= set(report["token_classes"])
    assert all(0.95 < r["min"] <= 1.0 + 1e-6 for r in report["queries"] + report["pages"])
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "query tokens by kind:" in out and "digits" in out and "top-1 agreement" in out
    assert main([*args, "--fail-below", "1.5"]) == 1
    assert "below --fail-below 1.5" in capsys.readouterr().err
    assert main([*args[:3], "nope", *args[4:]]) == 2
    assert "'nope' is not a variant" in capsys.readouterr().err
