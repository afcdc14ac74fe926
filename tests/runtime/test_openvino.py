"""The OpenVINO path: graphs in OpenVINO's form, exact to onnxruntime fp32, and the provider.

- Why the form: OpenVINO's ONNX front end reads the exported vision rotary (com.microsoft
  RotaryEmbedding with a (1,) position offset) as a row index, and refuses GroupQueryAttention as
  exported (`test_*_fp32_graphs_*`, on the real fp32 graphs of the tiny checkpoint).
- Parity: each family's `openvino` variant on OpenVINO (f32) against the fp32 graphs on
  onnxruntime, per token, pages and queries alone and in mixed batches, within the export's
  parity bound (every family: ColQwen2, ColQwen2.5 windowed, ColQwen3 with DeepStack).
- The variants: written by the exporter's variant step (real write_variants runs on copies of the
  session's fp32 exports), each gated against fp32 on OpenVINO, the manifest saying where.
- Selection: providers="openvino" / "auto", the variant each picks, options, threads, the cache.

Skipped as a whole when the OpenVINO runtime is not installed (the `openvino` extra; the `test`
extra installs it, so CI runs this file).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tests.fixtures.builds import PARITY_TOLERANCE, base_staging, build_once
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.fixtures.samples import PAGES, QUERIES

ov = pytest.importorskip(
    "openvino",
    reason="the OpenVINO runtime is not installed (the "
    "openvino extra: pip install 'colembed[openvino]')",
)

import colembed  # noqa: E402
from colembed import provider_choice  # noqa: E402
from colembed.errors import ExportError, ProviderError  # noqa: E402
from colembed.sessions import CPU, OPENVINO, resolve_providers  # noqa: E402

OPENVINO_ALL = ["openvino", "openvino-bf16", "openvino-int8"]
NO_CACHE = [("openvino", {"cache_dir": ""})]


def _with_openvino_variants(tmp_path_factory, key: str, source: Path, variants: list[str]):
    """`source` (an fp32 export) copied with `variants` written and gated by the exporter's
    variant step; (folder, {variant: figures})."""
    from colembed_export.variants.write import write_variants

    def build(folder):
        graphs, write_manifest = base_staging(source, folder / "model")
        results = write_variants(folder / "model", graphs, variants, write_manifest=write_manifest)
        (folder / "results.json").write_text(json.dumps(results, default=str))

    folder = build_once(tmp_path_factory, key, build)
    return folder / "model", json.loads((folder / "results.json").read_text())


@pytest.fixture(scope="module")
def colqwen2_openvino(exported_tiny, tmp_path_factory):
    return _with_openvino_variants(
        tmp_path_factory, "openvino-tiny", exported_tiny.folder, OPENVINO_ALL
    )


@pytest.fixture(scope="module")
def colqwen2_5_openvino(exported_tiny_2_5_alt, tmp_path_factory):
    return _with_openvino_variants(
        tmp_path_factory, "openvino-tiny-2.5-alt", exported_tiny_2_5_alt.folder, ["openvino"]
    )


@pytest.fixture(scope="module")
def colqwen3_openvino(tmp_path_factory):
    from tests.fixtures.qwen3 import exported

    return _with_openvino_variants(
        tmp_path_factory,
        "openvino-tiny-3-alt",
        exported(tmp_path_factory, "tiny-3-alt"),
        ["openvino"],
    )


@pytest.fixture(scope="module", params=["colqwen2", "colqwen2.5", "colqwen3"])
def family_openvino(request):
    return request.param, request.getfixturevalue(
        {
            "colqwen2": "colqwen2_openvino",
            "colqwen2.5": "colqwen2_5_openvino",
            "colqwen3": "colqwen3_openvino",
        }[request.param]
    )


# ------------------------------------------------------------------------ why a form of its own
def _with_output(src: Path, dst: Path, node_op: str) -> str:
    """`src` saved as `dst` with the first `node_op` node's output as an extra graph output."""
    import onnx

    model = onnx.load(str(src))
    node = next(n for n in model.graph.node if n.op_type == node_op)
    model.graph.output.append(
        onnx.helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None)
    )
    onnx.save(model, str(dst))
    return node.output[0]


def _vision_feeds(folder: Path):
    model = colembed.load(folder, verify=False)
    from colembed_export.variants.gates import recording_feeds

    recorded = recording_feeds(model)
    model.embed_images([PAGES[next(iter(PAGES))]])
    return recorded["vision"][0]


def _openvino_gap(probe: Path, reference: Path, name: str, feeds) -> float:
    """max |OpenVINO f32 on `probe` - onnxruntime on `reference`| on the output `name`."""
    import onnxruntime as ort

    want = ort.InferenceSession(str(reference), providers=[CPU]).run([name], feeds)[0]
    compiled = ov.Core().compile_model(str(probe), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    assert np.abs(want).max() > 0.1  # something to compare
    return float(np.abs(compiled(feeds)[compiled.output(name)] - want).max())


def test_fp32_vision_rotary_means_another_thing_on_openvino(colqwen2_openvino, tmp_path):
    """The exported vision rotary (a (1,) position offset) on OpenVINO: every token read row 0
    of the tables (no rotation), far off onnxruntime's output; the OpenVINO form's whole vision
    graph agrees with the fp32 graph on onnxruntime to float rounding."""
    folder, _ = colqwen2_openvino
    feeds = _vision_feeds(folder)
    probe = tmp_path / "vision-rotary.onnx"
    name = _with_output(folder / "vision.onnx", probe, "RotaryEmbedding")
    assert _openvino_gap(probe, probe, name, feeds) > 1e-2
    assert (
        _openvino_gap(
            folder / "vision.openvino.onnx", folder / "vision.onnx", "image_features", feeds
        )
        < 1e-5
    )


def test_openvino_cache_corrupts_its_fused_text_rotary(tmp_path):
    """Why the OpenVINO form decomposes the text rotary too (data/openvino_ops.json,
    `compiled_cache`): one com.microsoft RotaryEmbedding with per-token ids, as the text graph
    has it, is exact when compiled, wrong when read back from the compiled-model cache. When an
    OpenVINO release fixes it, this fails: drop the rule then."""
    import onnx
    from onnx import TensorProto, helper

    heads, head_dim, batch, tokens = 4, 16, 2, 12
    spec = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "t", heads * head_dim]),
        helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "t"]),
        helper.make_tensor_value_info("cos", TensorProto.FLOAT, ["r", head_dim // 2]),
        helper.make_tensor_value_info("sin", TensorProto.FLOAT, ["r", head_dim // 2]),
    ]
    node = helper.make_node(
        "RotaryEmbedding",
        ["x", "ids", "cos", "sin"],
        ["y"],
        domain="com.microsoft",
        num_heads=heads,
        interleaved=0,
    )
    model = helper.make_model(
        helper.make_graph(
            [node], "rotary", spec, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
        ),
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
    )
    path = tmp_path / "rotary.onnx"
    onnx.save(model, str(path))
    rng = np.random.default_rng(0)
    feeds = {
        "x": rng.standard_normal((batch, tokens, heads * head_dim), dtype=np.float32),
        "ids": np.arange(batch * tokens).reshape(batch, tokens),
        "cos": rng.standard_normal((batch * tokens, head_dim // 2), dtype=np.float32),
        "sin": rng.standard_normal((batch * tokens, head_dim // 2), dtype=np.float32),
    }
    import onnxruntime as ort

    want = ort.InferenceSession(str(path), providers=[CPU]).run(None, feeds)[0]
    config = {"INFERENCE_PRECISION_HINT": "f32", "CACHE_DIR": str(tmp_path / "cache")}
    fresh, cached = (ov.Core().compile_model(str(path), "CPU", config) for _ in range(2))
    assert np.abs(fresh(feeds)[fresh.outputs[0]] - want).max() < 1e-5
    assert not np.abs(cached(feeds)[cached.outputs[0]] - want).max() < 1e-2


def test_fp32_text_graph_is_refused_by_openvino(colqwen2_openvino):
    folder, _ = colqwen2_openvino
    with pytest.raises(RuntimeError, match="GroupQueryAttention"):
        ov.Core().read_model(str(folder / "text.onnx"))
    ov.Core().read_model(str(folder / "text.openvino.onnx"))


def test_the_rule_data_names_what_the_fp32_graphs_need(colqwen2_openvino):
    """data/openvino_ops.json, checked: the fp32 graphs' problem nodes are named (the offset
    rotaries, GroupQueryAttention), the OpenVINO form has none."""
    from colembed_export.graphs.openvino import openvino_problems

    folder, _ = colqwen2_openvino
    vision, text = (
        openvino_problems(folder / "vision.onnx"),
        openvino_problems(folder / "text.onnx"),
    )
    assert vision and all("RotaryEmbedding" in p and "offset" in p for p in vision)
    assert any("GroupQueryAttention" in p and "not converted" in p for p in text)
    assert any("RotaryEmbedding" in p and "cache" in p and "offset" not in p for p in text)
    for graph in (
        "vision.openvino.onnx",
        "text.openvino.onnx",
        "vision.openvino-int8.onnx",
        "text.openvino-int8.onnx",
    ):
        assert openvino_problems(folder / graph) == []


def test_the_exporter_refuses_a_graph_not_in_openvino_form(exported_tiny, tmp_path, monkeypatch):
    """The variant step checks every OpenVINO graph it writes against the rule data: a recipe
    that left the offset rotary is refused before any gate runs."""
    from colembed_export.graphs import openvino_form
    from colembed_export.variants.write import write_variants

    monkeypatch.setattr(openvino_form, "to_openvino_form", lambda model: {})
    graphs, write_manifest = base_staging(exported_tiny.folder, tmp_path / "staging")
    with pytest.raises(ExportError, match="not in OpenVINO's form.*offset"):
        write_variants(tmp_path / "staging", graphs, ["openvino"], write_manifest=write_manifest)


# ------------------------------------------------------------------------------------ parity
def _max_diff(got, want) -> float:
    assert [g.shape for g in got] == [w.shape for w in want]
    return max(float(np.abs(g - w).max()) if g.size else 0.0 for g, w in zip(got, want))


def test_openvino_f32_matches_onnxruntime_fp32_per_token(family_openvino):
    """Every family's openvino variant on OpenVINO f32 within the export's parity bound of the
    fp32 graphs on onnxruntime: pages on different grids and queries, alone and batched."""
    family, (folder, _) = family_openvino
    reference = colembed.load(folder, verify=False)
    model = colembed.load(folder, providers=NO_CACHE, verify=False)
    assert model.variant == "openvino" and model.providers == [OPENVINO]
    assert {s.precision for s in model._sessions.values()} == {"f32"}
    pages = list(PAGES.values())[:4]
    diffs = {
        "pages": _max_diff(
            model.embed_images(pages, batch_size=1), reference.embed_images(pages, batch_size=1)
        ),
        "pages batched": _max_diff(
            model.embed_images(pages, batch_size=4), reference.embed_images(pages, batch_size=1)
        ),
        "queries": _max_diff(
            model.embed_queries(QUERIES, batch_size=1),
            reference.embed_queries(QUERIES, batch_size=1),
        ),
        "queries batched": _max_diff(
            model.embed_queries(QUERIES, batch_size=6),
            reference.embed_queries(QUERIES, batch_size=1),
        ),
    }
    print(f"{family}: OpenVINO f32 vs onnxruntime fp32, max abs per token {diffs}")
    assert max(diffs.values()) <= PARITY_TOLERANCE


def test_openvino_graphs_have_no_problems_and_the_gate_says_where(family_openvino):
    from colembed.manifest import read_manifest
    from colembed_export.graphs.openvino import openvino_problems

    _, (folder, results) = family_openvino
    manifest = read_manifest(folder)
    for variant, figures in results.items():
        check = manifest.checks[variant] if variant in manifest.checks else figures
        assert "misses" not in figures, figures.get("misses")
        ran_on = figures["ran_on"]
        assert ran_on["providers"] == [OPENVINO] and ran_on["openvino"] == ov.__version__
        assert set(ran_on["precision_compiled"]) == {"vision", "text"}
        assert check is not None
        for role in ("vision", "text"):
            assert openvino_problems(folder / manifest.graph(variant, role).file) == []
    assert results["openvino"]["min_cosine"] >= 0.9999


def test_reduced_precision_variants_gated_on_openvino(colqwen2_openvino):
    """openvino-bf16 runs the openvino graph files at bf16 precision (what the plugin compiled is
    recorded: f32 on a CPU without bf16 arithmetic); openvino-int8 holds NNCF's int8 weights."""
    from colembed.manifest import read_manifest

    folder, results = colqwen2_openvino
    manifest = read_manifest(folder)
    assert manifest.graph("openvino-bf16", "vision").file == "vision.openvino.onnx"
    bf16 = colembed.load(folder, variant="openvino-bf16", providers=NO_CACHE, verify=False)
    compiled = {s.precision for s in bf16._sessions.values()}
    assert compiled == set(results["openvino-bf16"]["ran_on"]["precision_compiled"].values())
    assert compiled <= {"bf16", "f32"}
    int8 = results["openvino-int8"]
    assert int8["openvino_int8_weights"]["vision"] > 0 and int8["openvino_int8_weights"]["text"] > 0
    for name in ("openvino-bf16", "openvino-int8"):
        assert results[name]["mean_cosine"] >= 0.99 and results[name]["min_cosine"] >= 0.95


def test_openvino_int8_weights_reach_nncf_by_reference(exported_tiny, monkeypatch):
    """NNCF gets the graph with its weights left in the external data file (read from there as
    it compresses them), never serialised into the ModelProto: protobuf cannot serialise one above
    2 GiB, and a 2B graph at full depth holds 2.7 GB (image) and 6.2 GB (text) of weights. The
    compressed graph is the same: int8 weights before every weight MatMul."""
    import nncf
    import onnx

    from colembed_export.graphs.openvino_form import openvino_int8_graph

    def external(proto):
        """Names of the initializers whose bytes are in an external data file."""
        return {
            t.name for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
        }

    src = exported_tiny.folder / "vision.onnx"
    in_file = external(onnx.load(src, load_external_data=False))
    assert in_file  # the fixture's large weights are in vision.onnx_data
    handed = []
    compress = nncf.compress_weights

    def spy(model, **kwargs):
        handed.append(external(model))
        return compress(model, **kwargs)

    monkeypatch.setattr(nncf, "compress_weights", spy)
    model, figures = openvino_int8_graph(src)
    assert handed == [in_file]
    assert figures["openvino_int8_weights"] > 0
    dequantized = [n for n in model.graph if n.op_type == "DequantizeLinear"]
    assert len(dequantized) == figures["openvino_int8_weights"]
    assert all(n.inputs[0].const_value.dtype.name in ("UINT8", "INT8") for n in dequantized)


# ----------------------------------------------------------------------- provider selection
def test_provider_names_and_options():
    assert resolve_providers("openvino") == [OPENVINO]
    assert resolve_providers([("OpenVINO", {"precision": "bf16"})]) == [
        (OPENVINO, {"precision": "bf16"})
    ]
    with pytest.raises(ProviderError, match="alone"):
        resolve_providers(["openvino", "cpu"])
    with pytest.raises(ProviderError, match="not a dict"):
        resolve_providers([("openvino", ["bf16"])])


def test_openvino_runs_its_variants_only(colqwen2_openvino):
    folder, _ = colqwen2_openvino
    with pytest.raises(ProviderError, match="not made for OpenVINO"):
        colembed.load(folder, variant="fp32", providers="openvino", verify=False)
    with pytest.raises(ProviderError, match="made for OpenVINO"):
        colembed.load(folder, variant="openvino", providers="cpu", verify=False)
    with pytest.raises(ProviderError, match="options"):
        colembed.load(folder, providers=[("openvino", {"precison": "bf16"})], verify=False)
    with pytest.raises(ProviderError, match="precision"):
        colembed.load(folder, providers=[("openvino", {"precision": "int4"})], verify=False)


def test_threads_and_the_compiled_model_cache(colqwen2_openvino, tmp_path):
    folder, _ = colqwen2_openvino
    cache = tmp_path / "cache"
    model = colembed.load(
        folder, providers=[("openvino", {"cache_dir": str(cache)})], threads=1, verify=False
    )
    for session in model._sessions.values():
        assert int(session.compiled.get_property("INFERENCE_NUM_THREADS")) == 1
    assert any(cache.iterdir())  # the compiled graphs, read back by the next load
    again = colembed.load(
        folder, providers=[("openvino", {"cache_dir": str(cache)})], threads=1, verify=False
    )
    reference = colembed.load(folder, verify=False)
    page = [PAGES[next(iter(PAGES))]]
    for loaded in (model, again):
        assert (
            _max_diff(loaded.embed_queries(QUERIES[:3]), reference.embed_queries(QUERIES[:3]))
            <= PARITY_TOLERANCE
        )
        assert (
            _max_diff(loaded.embed_images(page), reference.embed_images(page)) <= PARITY_TOLERANCE
        )


def test_openvino_missing_is_a_clear_error(monkeypatch):
    from colembed import sessions

    monkeypatch.setattr(sessions, "openvino_installed", lambda: False)
    with pytest.raises(ProviderError, match=r"colembed\[openvino\]"):
        resolve_providers("openvino")
    assert resolve_providers("auto", auto_openvino=True) == [CPU]


def test_auto_takes_openvino_only_where_measured_faster(colqwen2_openvino, tmp_path, monkeypatch):
    """ "auto" is onnxruntime's CPU provider until `colembed doctor --measure` recorded OpenVINO's
    exact variant as the faster one for this folder on this machine; then OpenVINO runs
    "openvino". A record for another folder or an unreadable one changes nothing."""
    monkeypatch.setenv("COLEMBED_CACHE_DIR", str(tmp_path))
    folder, _ = colqwen2_openvino
    assert colembed.load(folder, providers="auto", verify=False).providers == [CPU]
    provider_choice.remember(folder, {"provider": OPENVINO, "variant": "openvino"})
    model = colembed.load(folder, providers="auto", verify=False)
    assert model.providers == [OPENVINO] and model.variant == "openvino"
    (tmp_path / provider_choice.RECORD_FILE).write_text("{not json")
    assert colembed.load(folder, providers="auto", verify=False).providers == [CPU]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    content=st.one_of(
        st.binary(max_size=200),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=8),
            lambda inner: st.lists(inner, max_size=3)
            | st.dictionaries(st.text(max_size=8), inner, max_size=3),
            max_leaves=8,
        ).map(lambda v: json.dumps(v).encode()),
    )
)
def test_a_hostile_choice_record_is_no_measurement(content, tmp_path_factory, monkeypatch):
    """Whatever the record file holds, `measured` returns None or a well-formed choice."""
    home = tmp_path_factory.mktemp("choice")
    monkeypatch.setenv("COLEMBED_CACHE_DIR", str(home))
    (home / "m").mkdir()
    (home / "m" / "colembed_manifest.json").write_text("{}")
    (home / provider_choice.RECORD_FILE).write_bytes(content)
    found = provider_choice.measured(home / "m")
    assert found is None or all(isinstance(found[f], str) for f in provider_choice.FIELDS)


def test_fastembed_and_the_index_take_openvino(colqwen2_openvino, tmp_path):
    """FastEmbed's `providers=["openvino"]` and the index's `providers` run the OpenVINO
    variant; the vectors are the fp32 ones within the parity bound."""
    from colembed.fastembed import ColQwen2
    from colembed.index import Index

    folder, _ = colqwen2_openvino
    embedder = ColQwen2(
        "colqwen2", specific_model_path=str(folder), providers=["openvino"], local_files_only=True
    )
    assert embedder.model.variant == "openvino" and embedder.model.providers == [OPENVINO]
    reference = colembed.load(folder, verify=False).embed_queries(QUERIES[:2])
    assert _max_diff(list(embedder.embed_text(QUERIES[:2])), reference) <= PARITY_TOLERANCE
    with Index(tmp_path / "db", model=str(folder), providers="openvino") as index:
        assert index.model.providers == [OPENVINO] and index.model.variant == "openvino"


def test_cli_takes_providers_for_the_index(tmp_path):
    from colembed.cli import build_parser

    for command in (["index", "x.pdf"], ["search", "q"], ["serve"]):
        args = build_parser().parse_args(
            [*command, "--db", str(tmp_path), "--providers", "openvino"]
        )
        assert args.providers == "openvino"


def test_doctor_measures_and_reports_the_fastest(colqwen2_openvino, tmp_path, monkeypatch):
    """`colembed doctor --measure`: every variant on every provider that runs it here, each with
    its fidelity to CPU fp32 and gate; the fastest exact one is recorded for "auto"."""
    from colembed.doctor import measure

    monkeypatch.setenv("COLEMBED_CACHE_DIR", str(tmp_path))
    folder, _ = colqwen2_openvino
    report = measure(folder, threads=1, repeats=1)
    ran = {(r["provider"], r["variant"]) for r in report["candidates"]}
    assert ran == {(CPU, "fp32"), *((OPENVINO, v) for v in OPENVINO_ALL)}
    for row in report["candidates"]:
        assert row["page_s"] > 0 and row["query_s"] > 0
        assert row["fidelity_vs_cpu_fp32"]["finite"]
    exact = report["fastest_exact"]
    assert exact["variant"] in ("fp32", "openvino")
    assert provider_choice.measured(folder)["provider"] == exact["provider"]
