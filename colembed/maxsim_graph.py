"""The MaxSim scorer graph (`maxsim.onnx`): its contract, and a torch-free builder.

    score[q, n] = sum over real tokens i of query q of  max over real tokens j of doc n of  Q[q,i] . D[n,j]

Inputs (padded batches; a mask is 1 at a real token, 0 at padding, int64 like attention masks):
    query_vectors  float32            (queries, query_tokens, dim)
    query_mask     int64              (queries, query_tokens)
    doc_vectors    float32 | float16  (documents, doc_tokens, dim)
    doc_mask       int64              (documents, doc_tokens)
Output:
    scores         float32            (queries, documents)

Semantics (deliberately unlike the reference `score_retrieval`, which zero-pads): a padded document
position never wins a max and a padded query position adds nothing, whatever finite values the
padded rows hold (the runtime pads with zeros; NaN/inf in padding is not supported: ReduceMax does
not propagate NaN consistently, and the runtime rejects NaN/inf before it gets here). Products are
accumulated in fp32; an fp16 document graph casts the documents to fp32 first. A document whose
mask is all zero scores -inf against every query that has a real token (the runtime never sends
one: it rejects empty documents).

How the mask is applied (measured on a 2-core AVX-512 Xeon, 750-token pages, dim 128): a bias of
0 at real and -inf at padded document positions, added where it is cheapest. `Where(mask, S,
-inf)` over the similarities S, or `Where` over the documents, ran at 2-3 ns per element (ORT's
broadcasting Where is not vectorised) and made the graph 1.2x-3x slower. So an `If` on the shapes
picks one of two exact formulations:
- more query rows than dims (e.g. 32 queries): append 1 to every query row and the bias to every
  document row; the GEMM itself then yields -inf at padded positions (one pass over the documents,
  which are smaller than S here; 220 vs 178 GFLOP/s);
- otherwise (e.g. one query): a plain GEMM, then `Add` of the (N, Ld) bias broadcast over S (one
  pass over S, which is smaller than the documents here; 59 vs 23 GFLOP/s).

Everything here is plain `onnx.helper` at opset 18 (no torch). `onnx` is needed only to *build* the
graph (it is not a runtime dependency of colembed, and is imported lazily); onnxruntime runs it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .contracts import GraphContract, TensorSpec
from .layout import MAXSIM_FILE

MAXSIM_OPSET = 18
MAXSIM_IR_VERSION = 8  # the lowest IR version that carries opset 18: loads on older onnxruntimes
DOC_DTYPES = ("float32", "float16")


def maxsim_contract(doc_dtype: str = "float32") -> GraphContract:
    """The scorer's inputs and outputs. Symbolic dims with the same name must agree."""
    if doc_dtype not in DOC_DTYPES:
        raise ValueError(f"doc_dtype must be one of {DOC_DTYPES}, got {doc_dtype!r}")
    return GraphContract(
        role="scorer",
        inputs=(
            TensorSpec("query_vectors", "float32", ("queries", "query_tokens", "dim")),
            TensorSpec("query_mask", "int64", ("queries", "query_tokens")),
            TensorSpec("doc_vectors", doc_dtype, ("documents", "doc_tokens", "dim")),
            TensorSpec("doc_mask", "int64", ("documents", "doc_tokens")),
        ),
        outputs=(TensorSpec("scores", "float32", ("queries", "documents")),),
    )


MAXSIM_CONTRACT = maxsim_contract("float32")
MAXSIM_FP16_CONTRACT = maxsim_contract("float16")


def _onnx() -> Any:
    try:
        import onnx
    except ImportError as e:
        raise ImportError(
            "building the MaxSim scorer graph needs the `onnx` package, which colembed does not "
            "install by default: pip install onnx (or pip install 'colembed[export]'). Scoring "
            "without a graph still works: colembed.score uses numpy."
        ) from e
    return onnx


def build_maxsim_model(*, doc_dtype: str = "float32") -> Any:
    """The scorer as an `onnx.ModelProto` (checked with `onnx.checker`, full shape inference)."""
    onnx = _onnx()
    from onnx import TensorProto, helper

    contract = maxsim_contract(doc_dtype)
    elem = {
        "float32": TensorProto.FLOAT,
        "float16": TensorProto.FLOAT16,
        "int64": TensorProto.INT64,
    }

    def value_info(spec: TensorSpec) -> Any:
        return helper.make_tensor_value_info(spec.name, elem[spec.dtype], list(spec.dims))

    def const(name: str, dtype: int, dims: list[int], values: list[Any]) -> Any:
        return helper.make_tensor(name, dtype, dims, values)

    initializers = [
        const("axis_1", TensorProto.INT64, [1], [1]),
        const("axis_2", TensorProto.INT64, [1], [2]),
        const("minus_one", TensorProto.INT64, [1], [-1]),
        const("dim_axis", TensorProto.INT64, [], [2]),
        const("zero", TensorProto.FLOAT, [], [0.0]),
        const("minus_inf", TensorProto.FLOAT, [], [float("-inf")]),
        const("one", TensorProto.FLOAT, [1], [1.0]),
    ]
    nodes = _scorer_nodes(helper, TensorProto, contract, doc_dtype)
    graph = helper.make_graph(
        nodes,
        "colembed_maxsim",
        [value_info(s) for s in contract.inputs],
        [value_info(s) for s in contract.outputs],
        initializers,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", MAXSIM_OPSET)],
        producer_name="colembed.maxsim_graph",
        doc_string="MaxSim late-interaction scores with padding masked (colembed).",
    )
    model.ir_version = MAXSIM_IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return model


def _scorer_nodes(helper: Any, TensorProto: Any, contract: GraphContract, doc_dtype: str) -> list:
    """The main graph's nodes: the 0 / -inf document bias, the If picking the GEMM formulation,
    the max over document tokens and the masked sum over query tokens."""
    node = helper.make_node
    # the graph's own tensor names come from the contract (spelled once, there)
    queries, query_mask, docs, doc_mask = (spec.name for spec in contract.inputs)
    (scores,) = (spec.name for spec in contract.outputs)
    nodes = []
    if doc_dtype == "float16":
        nodes.append(node("Cast", [docs], ["doc_vectors_f32"], to=TensorProto.FLOAT))
        docs = "doc_vectors_f32"
    nodes += [
        node("Cast", [doc_mask], ["doc_real"], to=TensorProto.BOOL),  # (N, Ld)
        node("Cast", [query_mask], ["query_real"], to=TensorProto.BOOL),  # (Q, Lq)
        node("Where", ["doc_real", "zero", "minus_inf"], ["doc_bias"]),  # (N, Ld)
        node("Shape", [query_mask], ["query_shape"]),  # [Q, Lq]
        node("Shape", [doc_mask], ["doc_shape"]),  # [N, Ld]
        node("Concat", ["minus_one", "doc_shape"], ["sims_shape"], axis=0),  # [-1, N, Ld]
        node("Reshape", ["doc_bias", "minus_one"], ["doc_bias_flat"]),  # (N*Ld,)
        # Which formulation: the bias inside the GEMM (a pass over the documents) when there are
        # more query rows than dims, else the bias added to the similarities (a pass over those).
        node("ReduceProd", ["query_shape"], ["query_rows_count"], keepdims=0),
        node("Shape", [docs], ["docs_shape"]),
        node("Gather", ["docs_shape", "dim_axis"], ["dim_count"], axis=0),
        node("Greater", ["query_rows_count", "dim_count"], ["bias_in_gemm"]),
        node(
            "If",
            ["bias_in_gemm"],
            ["sims"],
            then_branch=_bias_in_gemm_branch(helper, TensorProto, queries, docs),
            else_branch=_bias_added_branch(helper, TensorProto, queries, docs),
        ),  # (Q*Lq, N*Ld)
        # outside the If: a Reshape inside a branch made onnxruntime copy S (measured, 7%)
        node("Reshape", ["sims", "sims_shape"], ["sims_3"]),  # (Q*Lq, N, Ld)
        node("ReduceMax", ["sims_3", "minus_one"], ["best"], keepdims=0),  # (Q*Lq, N)
        node("Concat", ["query_shape", "minus_one"], ["best_shape"], axis=0),  # [Q, Lq, -1]
        node("Reshape", ["best", "best_shape"], ["best_3"]),  # (Q, Lq, N)
        node("Unsqueeze", ["query_real", "axis_2"], ["query_real_3"]),  # (Q, Lq, 1)
        node("Where", ["query_real_3", "best_3", "zero"], ["best_real"]),  # (Q, Lq, N)
        node("ReduceSum", ["best_real", "axis_1"], [scores], keepdims=0),  # (Q, N)
    ]
    return nodes


def _bias_in_gemm_branch(helper: Any, tp: Any, queries: str, docs: str) -> Any:
    """Many query rows: append 1 to every query row and the 0 / -inf bias to every document row,
    so the GEMM returns -inf at padded positions (costs one pass over the documents)."""
    node = helper.make_node
    nodes = [
        node("Unsqueeze", ["doc_bias", "axis_2"], ["g_doc_bias_3"]),  # (N, Ld, 1)
        node("Concat", [docs, "g_doc_bias_3"], ["g_doc_aug"], axis=2),  # (N, Ld, d+1)
        node("Flatten", ["g_doc_aug"], ["g_doc_rows"], axis=2),  # (N*Ld, d+1)
        node("Concat", ["query_shape", "axis_1"], ["g_ones_shape"], axis=0),  # [Q, Lq, 1]
        node("Expand", ["one", "g_ones_shape"], ["g_query_ones"]),  # (Q, Lq, 1)
        node("Concat", [queries, "g_query_ones"], ["g_query_aug"], axis=2),  # (Q, Lq, d+1)
        node("Flatten", ["g_query_aug"], ["g_query_rows"], axis=2),  # (Q*Lq, d+1)
        node("Gemm", ["g_query_rows", "g_doc_rows"], ["g_sims"], transB=1),  # (Q*Lq, N*Ld)
    ]
    out = helper.make_tensor_value_info("g_sims", tp.FLOAT, None)
    return helper.make_graph(nodes, "bias_in_gemm", [], [out])


def _bias_added_branch(helper: Any, tp: Any, queries: str, docs: str) -> Any:
    """Few query rows: plain GEMM, then the 0 / -inf bias added to the (small) similarities."""
    node = helper.make_node
    nodes = [
        node("Flatten", [docs], ["a_doc_rows"], axis=2),  # (N*Ld, d)
        node("Flatten", [queries], ["a_query_rows"], axis=2),  # (Q*Lq, d)
        node("Gemm", ["a_query_rows", "a_doc_rows"], ["a_sims_raw"], transB=1),  # (Q*Lq, N*Ld)
        node("Add", ["a_sims_raw", "doc_bias_flat"], ["a_sims"]),  # + (N*Ld,)
    ]
    out = helper.make_tensor_value_info("a_sims", tp.FLOAT, None)
    return helper.make_graph(nodes, "bias_added", [], [out])


def maxsim_model_bytes(*, doc_dtype: str = "float32") -> bytes:
    """The serialised scorer, for `onnxruntime.InferenceSession(bytes)` without touching disk."""
    return build_maxsim_model(doc_dtype=doc_dtype).SerializeToString()


def write_maxsim_graph(path: str | os.PathLike[str], *, doc_dtype: str = "float32") -> Path:
    """Write the scorer graph to `path` (a file, or a folder that gets `maxsim.onnx`)."""
    path = Path(path)
    if path.is_dir():
        path = path / MAXSIM_FILE
    data = maxsim_model_bytes(doc_dtype=doc_dtype)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path
