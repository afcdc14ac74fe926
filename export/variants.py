"""Reduced-precision variants of the checked fp32 graphs: written, checked against fp32, recorded.

The exporter calls `write_variants` after the fp32 graphs passed their check against torch. Each
variant is a pair of graph files derived from the fp32 ones, selected at load time by name
(`colembed.load(folder, variant="int8")`) through the manifest:

| variant | vision graph                               | text graph                                        |
|---------|--------------------------------------------|---------------------------------------------------|
| int8    | dynamic int8, per-channel MatMul weights   | dynamic int8, per-channel MatMul weights          |
| int4    | the int8 vision graph (same file)          | MatMulNBits 4-bit weight-only, accuracy level 4,  |
|         |                                            | block 16; token-embedding table stays fp32        |
| fp16    | fp16 weights and compute, fp32 islands     | fp16 weights and compute, fp32 islands            |

Why these choices (measured on the Qwen2-VL-2B-width benchmark model, see benchmarks/README.md):

- int8: onnxruntime's dynamic quantisation (`quantize_dynamic`) turns each MatMul with a constant
  weight into DynamicQuantizeLinear + MatMulInteger, which the CPU graph optimiser fuses into
  `DynamicQuantizeMatMul`. Activations are always uint8 there; signed int8 weights (u8s8) run the
  VNNI `vpdpbusd` kernels on AVX512-VNNI / AVX-VNNI machines and are the right default on CPU
  (`INT8_WEIGHT_TYPE`). Attention's activation x activation MatMuls stay fp32.
- int4 is for the language model, where the work is memory-bound for queries (a few dozen
  tokens against 1.3 B weights) and 4-bit weights cut the bytes read per token by 8x. The vision
  tower is compute-bound (about 5.3 TFLOP per page), where 4 bits save nothing over int8 compute
  but cost accuracy, so the int4 variant reuses the int8 vision graph file.
- fp16 targets DirectML (GPU): weights and most compute in fp16; graph inputs/outputs stay fp32
  (`keep_io_types`); normalisations (LayerNorm, RMSNorm), Softmax, the language model's attention
  (Qwen2's q.k overflows fp16), its rotary tables (positions in the thousands lose integer
  precision in fp16), the residual adds and the final projection + L2 normalisation stay fp32, with
  Casts inserted at the borders. Nodes are picked by the module path the torch exporter records in
  each node's metadata (`pkg.torch.onnx.name_scopes`).

Every variant is gated against fp32 on the exporter's sample pages and queries: per-token cosine
between the variant's and fp32's embeddings, mean and min over all tokens (`GATES`). A variant
that misses its gate raises ExportError naming the variant and its figures; the exporter then
removes the staging folder, so nothing is written. Random-weight checkpoints lack the outlier
channels of trained weights: passing these gates is necessary, not sufficient.

Every written graph has `Reshape(allowzero=1)` cleared (DirectML rejects it, graphs.md) and is
saved with external data (`<graph file>_data`) when the fp32 graph was or when it exceeds the
protobuf limit. This module imports onnx and onnxruntime's quantisation tools, never torch.
"""

from __future__ import annotations

import ast
import heapq
import logging
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from colembed.errors import ExportError
from colembed.manifest import GraphEntry

log = logging.getLogger("colembed_export")

# Signed int8 weights: u8 activations x s8 weights is the VNNI fast path on x86 (measured in
# benchmarks/README.md, "int8 weight type"); QUInt8 weights run the slower u8u8 kernels.
INT8_WEIGHT_TYPE = "QInt8"
# Block 16 with the token-embedding table left fp32: on the realistic-width 2+2-layer model the
# mean/min per-token cosine to fp32 was 0.9814/0.920 with block 32 + 4-bit embeddings, 0.9835/0.940
# with fp32 embeddings, 0.9855/0.944 with block 16; the gate is 0.98 mean, so take the margin.
INT4_BLOCK_SIZE = 16
INT4_ACCURACY_LEVEL = 4  # int8 activations in the MatMulNBits kernel (VNNI), weights 4-bit
# protobuf cannot serialise 2 GiB; stay well below it when deciding on external data.
EXTERNAL_DATA_THRESHOLD = 1 << 30

# Module-path fragments (from the torch exporter's name scopes) whose nodes stay fp32 in fp16.
FP16_KEEP_SCOPES = ("norm", "ln_q", "rotary_emb", "projection")
RESIDUAL_OWNER = re.compile(r".*\.(layers|blocks)\.\d+")  # an Add owned by a layer is residual
FP16_KEEP_OPS = ("LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
                 "SkipSimplifiedLayerNormalization", "RMSNormalization", "Softmax",
                 "ReduceL2", "ReduceMean", "Pow", "Sqrt", "Reciprocal", "Range", "CumSum",
                 "Cos", "Sin",
                 # the vision tower's fused attention: fp32 softmax inside, and onnxruntime's CPU
                 # kernel (where the variant is checked) takes fp32 only
                 "MultiHeadAttention")


@dataclass(frozen=True)
class Gate:
    """Per-token cosine similarity to fp32 a variant must reach (min_cosine None: not gated)."""

    mean_cosine: float
    min_cosine: float | None = None

    def misses(self, figures: dict[str, Any]) -> list[str]:
        misses = []
        if not figures["mean_cosine"] >= self.mean_cosine:
            misses.append(f"mean cosine {figures['mean_cosine']:.5f} < {self.mean_cosine}")
        if self.min_cosine is not None and not figures["min_cosine"] >= self.min_cosine:
            misses.append(f"min cosine {figures['min_cosine']:.5f} < {self.min_cosine}")
        return misses

    def to_dict(self) -> dict[str, Any]:
        return {"mean_cosine": self.mean_cosine, "min_cosine": self.min_cosine}


@dataclass(frozen=True)
class VariantSpec:
    """Which recipe makes each role's graph, and the gate against fp32."""

    name: str
    recipes: dict[str, str]  # role -> recipe ("int8", "int4", "fp16")
    gate: Gate


# fp16 gate: fp16 keeps 11 significant bits, so honest rounding over a few dozen layers moves a
# token's direction by ~1e-3 relative (cosine 1 - 1e-6 ... 1 - 1e-4: measured 0.99999+ on the
# fixtures). A cosine below 0.999 (mean) / 0.99 (any token) means an overflow or a lost small
# value somewhere, which is exactly the failure fp16 must be stopped for.
GATES = {
    "int8": Gate(mean_cosine=0.99, min_cosine=0.95),
    "int4": Gate(mean_cosine=0.98),
    "fp16": Gate(mean_cosine=0.999, min_cosine=0.99),
}

VARIANTS: dict[str, VariantSpec] = {
    "int8": VariantSpec("int8", {"vision": "int8", "text": "int8"}, GATES["int8"]),
    "int4": VariantSpec("int4", {"vision": "int8", "text": "int4"}, GATES["int4"]),
    "fp16": VariantSpec("fp16", {"vision": "fp16", "text": "fp16"}, GATES["fp16"]),
}


# ------------------------------------------------------------------------------------ helpers
def clear_reshape_allowzero_proto(model: Any) -> int:
    """Set `allowzero=0` on every Reshape of an onnx ModelProto (subgraphs too). Returns the count.

    The onnx-proto twin of `onnx_io.clear_reshape_allowzero` (which works on onnx_ir models).
    """
    from onnx import AttributeProto

    cleared = 0

    def walk(graph) -> None:
        nonlocal cleared
        for node in graph.node:
            if node.op_type == "Reshape" and node.domain in ("", "ai.onnx"):
                for attr in node.attribute:
                    if attr.name == "allowzero" and attr.i == 1:
                        attr.i = 0
                        cleared += 1
            for attr in node.attribute:
                if attr.type == AttributeProto.GRAPH:
                    walk(attr.g)
                elif attr.type == AttributeProto.GRAPHS:
                    for sub in attr.graphs:
                        walk(sub)

    walk(model.graph)
    return cleared


def topological_sort(graph: Any) -> None:
    """Reorder `graph.node` so every node follows its producers (the fp16 converter appends the
    input Casts at the end; onnx.checker and some providers require sorted graphs)."""
    produced_by: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for name in node.output:
            produced_by[name] = i

    def node_inputs(node: Any) -> set[str]:
        names = set(node.input)
        for attr in node.attribute:  # names a subgraph reads from the outer scope
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                for inner in sub.node:
                    names |= node_inputs(inner)
        return names

    deps = [{produced_by[n] for n in node_inputs(node) if n in produced_by} for node in graph.node]
    users: list[list[int]] = [[] for _ in graph.node]
    for i, d in enumerate(deps):
        for j in d:
            users[j].append(i)
    pending = [len(d) for d in deps]
    ready = [i for i, count in enumerate(pending) if count == 0]
    heapq.heapify(ready)  # lowest original index first: keeps the exporter's order where it can
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users[i]:
            pending[u] -= 1
            if pending[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(graph.node):
        raise ExportError("variant graph has a cycle; cannot sort it")
    nodes = [graph.node[i] for i in order]
    del graph.node[:]
    graph.node.extend(nodes)


def _save(model: Any, folder: Path, file: str, external: bool) -> tuple[str, str | None]:
    """Write `model` as `folder/file` (+ `file_data` when external); returns (file, data_file)."""
    import onnx

    path = folder / file
    data_name = file + "_data"
    for stale in (path, folder / data_name):
        if stale.exists():
            stale.unlink()
    size = model.ByteSize() if not external else 0
    if not external and size > EXTERNAL_DATA_THRESHOLD:
        external = True
    if external:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data_name, size_threshold=1024, convert_attribute=False)
    else:
        onnx.save_model(model, str(path))
    try:
        onnx.checker.check_model(str(path), full_check=False)
    except onnx.checker.ValidationError as e:
        raise ExportError(f"{file}: onnx.checker rejected the variant graph: {e}") from e
    return file, (data_name if external else None)


def _quiet_quantisers() -> None:
    # matmul_nbits_quantizer logs one INFO line per node; the dynamic quantiser warns about
    # pre-processing (symbolic shape inference), which does not apply to MatMul-only quantisation.
    for name in ("onnxruntime.quantization.matmul_nbits_quantizer", "root"):
        logging.getLogger(name).setLevel(logging.ERROR)


# ------------------------------------------------------------------------------------ recipes
def quantize_int8(src: Path, work: Path, *, weight_type: str = INT8_WEIGHT_TYPE) -> Any:
    """Dynamic int8: every MatMul with a constant weight, per output channel. Returns ModelProto."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out = work / f"{src.stem}.int8-tmp.onnx"
    quantize_dynamic(src, out, per_channel=True, weight_type=getattr(QuantType, weight_type),
                     op_types_to_quantize=["MatMul"], use_external_data_format=True,
                     extra_options={"MatMulConstBOnly": True})
    return onnx.load(str(out))


def quantize_int4(src: Path, *, block_size: int = INT4_BLOCK_SIZE,
                  accuracy_level: int = INT4_ACCURACY_LEVEL, gather: bool = False) -> Any:
    """4-bit weight-only MatMulNBits (+ the token-embedding Gather as GatherBlockQuantized)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(str(src))
    op_types = ("MatMul", "Gather") if gather else ("MatMul",)
    quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=block_size, is_symmetric=False,
                                     accuracy_level=accuracy_level, op_types_to_quantize=op_types,
                                     quant_axes=(("MatMul", 0), ("Gather", 1)))
    quantizer.process()
    return quantizer.model.model


def _scopes(node: Any) -> list[str]:
    """The torch module path of a node, outermost first, ending with the op's own name."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            try:
                value = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                return []
            return [str(v) for v in value] if isinstance(value, list) else []
    return []


def fp16_keep_nodes(model: Any, role: str) -> list[str]:
    """Names of the nodes that stay fp32 in the fp16 variant (see the module docstring)."""
    keep = []
    for node in model.graph.node:
        scopes = _scopes(node)
        if len(scopes) < 2:
            continue
        modules, owner = scopes[:-1], scopes[-2]
        if any(fragment in module for module in modules for fragment in FP16_KEEP_SCOPES):
            keep.append(node.name)  # norms, rotary tables, the projection
        elif RESIDUAL_OWNER.fullmatch(owner) and node.op_type == "Add":
            keep.append(node.name)  # residual stream
        elif role == "text" and (owner == "" or owner.endswith("self_attn")):
            keep.append(node.name)  # glue + L2 normalisation; rotary, q.k, softmax, p.v
    return keep


def convert_fp16(src: Path, role: str) -> Any:
    """fp16 weights and compute, fp32 inputs/outputs and fp32 islands. Returns ModelProto."""
    import onnx
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    keep = fp16_keep_nodes(onnx.load(str(src), load_external_data=False), role)
    model = convert_float_to_float16(str(src), keep_io_types=True,
                                     op_block_list=list(DEFAULT_OP_BLOCK_LIST) + list(FP16_KEEP_OPS),
                                     node_block_list=keep)
    # The converter leaves some value_info with fp32 types on now-fp16 tensors; onnxruntime
    # re-infers them, strict shape inference rejects them. Drop them all.
    del model.graph.value_info[:]
    return model


def _make_graph(recipe: str, role: str, src: Path, work: Path) -> Any:
    if recipe == "int8":
        return quantize_int8(src, work)
    if recipe == "int4":
        return quantize_int4(src)
    if recipe == "fp16":
        return convert_fp16(src, role)
    raise ExportError(f"unknown recipe {recipe!r}")


# --------------------------------------------------------------------------------- comparison
def token_cosines(got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> np.ndarray:
    """Per-token cosine similarity between two lists of (tokens, dim) arrays (all tokens, flat)."""
    values = []
    for i, (a, b) in enumerate(zip(got, want)):
        if a.shape != b.shape:
            raise ExportError(f"item {i}: variant gives shape {a.shape}, fp32 {b.shape}")
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        norms = np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1)
        values.append(np.sum(a64 * b64, axis=1) / np.maximum(norms, 1e-30))
    return np.concatenate(values) if values else np.zeros(0)


def cosine_figures(got_pages, want_pages, got_queries, want_queries) -> dict[str, Any]:
    pages = token_cosines(got_pages, want_pages)
    queries = token_cosines(got_queries, want_queries)
    both = np.concatenate([pages, queries])
    return {
        "mean_cosine": float(both.mean()),
        "min_cosine": float(both.min()),
        "pages_mean_cosine": float(pages.mean()),
        "pages_min_cosine": float(pages.min()),
        "queries_mean_cosine": float(queries.mean()),
        "queries_min_cosine": float(queries.min()),
        "tokens": int(both.size),
    }


def maxsim_scores(queries: Sequence[np.ndarray], pages: Sequence[np.ndarray]) -> np.ndarray:
    """(queries, pages) exact MaxSim scores, by colembed's own scorer."""
    from colembed.scoring import score

    return score(list(queries), list(pages))


def topk_agreement(variant_scores: np.ndarray, fp32_scores: np.ndarray, k: int = 5,
                   tie: float = 0.0) -> dict[str, Any]:
    """Share of queries whose top-k pages agree with fp32's.

    `same_set` / `same_order`: exactly the same k pages (in the same order). `within_ties`: the
    same, except that pages whose fp32 score lies within `tie` (relative, e.g. 0.005) of fp32's
    k-th score count as interchangeable: every page the variant ranks in its top k scores at
    least `s_k - tie*|s_k|` under fp32, and every page scoring above `s_k + tie*|s_k|` under fp32
    is in the variant's top k. With tie 0 it is `same_set`.
    """
    top_v = np.argsort(-variant_scores, axis=1, kind="stable")[:, :k]
    top_f = np.argsort(-fp32_scores, axis=1, kind="stable")[:, :k]
    same_set = [set(a) == set(b) for a, b in zip(top_v, top_f)]
    same_order = [list(a) == list(b) for a, b in zip(top_v, top_f)]
    within = []
    for row, (tv, tf) in enumerate(zip(top_v, top_f)):
        kth = fp32_scores[row, tf[-1]]
        band = tie * abs(kth)
        sure = set(np.flatnonzero(fp32_scores[row] > kth + band))
        within.append(bool(np.all(fp32_scores[row, tv] >= kth - band)) and sure <= set(tv))
    gaps = np.sort(fp32_scores, axis=1)[:, ::-1]
    return {"k": k, "queries": len(same_set), "same_set": float(np.mean(same_set)),
            "same_order": float(np.mean(same_order)), "tie": tie,
            "within_ties": float(np.mean(within)),
            "median_fp32_gap_k": float(np.median(gaps[:, k - 1] - gaps[:, k]))}


def synthetic_retrieval_set(pages: int = 100, queries: int = 20, *, size: tuple[int, int] = (112, 140),
                            seed: int = 0) -> tuple[list[Any], list[str]]:
    """`pages` small same-size page images with rendered text, and `queries` that quote them.

    Page i shows a title ("Report 17: harbour freight"), a few body lines drawn from a word list
    and a coloured chart bar, on its own paper tint; query j quotes the title and first line of
    page `j * pages // queries`. Pages differ visibly (tint, ink, layout) because a random-weight
    model only tells pages apart by what it sees, not by what the text means: that keeps fp32's
    score margins well above quantisation noise, so a top-k comparison tests the variant rather
    than ties. All pages share one size (one grid), so the image graph batches them.
    """
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    words = ("harbour freight invoice revenue tax energy rail audit salary budget forecast river "
             "clinic grain steel vaccine solar port tariff loan credit wind copper cotton wheat "
             "coffee tourism census school bridge").split()
    images, texts = [], []
    for i in range(pages):
        title = f"Report {i}: {words[i % len(words)]} {words[(3 * i + 1) % len(words)]}"
        lines = [" ".join(rng.choice(words, 3)) for _ in range(5)]
        paper = tuple(int(c) for c in rng.integers(150, 256, 3))
        ink = tuple(int(c) for c in rng.integers(0, 110, 3))
        image = Image.new("RGB", size, paper)
        draw = ImageDraw.Draw(image)
        x0 = int(rng.integers(2, 20))
        draw.text((x0, 4), title, fill=ink)
        for row, line in enumerate(lines):
            draw.text((x0, 22 + 14 * row), line, fill=ink)
        bar = tuple(int(c) for c in rng.integers(0, 256, 3))
        top = int(rng.integers(size[1] // 2, size[1] - 24))
        draw.rectangle([4, top, 4 + int(rng.integers(20, size[0] - 8)), top + 16], fill=bar)
        images.append(image)
        texts.append((title, lines))
    query_texts = [f"{texts[j * pages // queries][0]} {texts[j * pages // queries][1][0]}"
                   for j in range(queries)]
    return images, query_texts


# ----------------------------------------------------------------------------------- entry
def parse_variants(variants: Sequence[str] | str) -> list[str]:
    """Normalise "int8,int4" / ["int8", "int4"] to a de-duplicated list; unknown names raise."""
    if isinstance(variants, str):
        variants = variants.split(",")
    names: list[str] = []
    for raw in variants:
        name = raw.strip().lower()
        if not name or name == "fp32":
            continue
        if name not in VARIANTS:
            raise ExportError(f"unknown variant {raw!r}; known: {sorted(VARIANTS)} (fp32 is always "
                              "written)")
        if name not in names:
            names.append(name)
    return names


def write_variants(
    staging: Path,
    graphs: dict[str, GraphEntry],
    variants: Sequence[str],
    *,
    write_manifest: Callable[[dict[str, dict[str, GraphEntry]]], None],
    progress: Callable[[str], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Write each variant's graphs into `staging`, list them in the manifest, gate them vs fp32.

    `graphs` are the checked fp32 entries by role. Returns {variant: figures} for the manifest's
    `checks`; raises ExportError (naming the variant and its figures) when a gate is missed.
    """
    import colembed

    from .verify import SAMPLE_QUERIES, sample_pages

    say = progress or (lambda message: log.info(message))
    names = parse_variants(variants)
    if not names:
        return {}
    staging = Path(staging)
    _quiet_quantisers()
    entries: dict[str, dict[str, GraphEntry]] = {}
    written: dict[tuple[str, str], GraphEntry] = {}  # (role, recipe) -> entry; files are shared
    work = Path(tempfile.mkdtemp(prefix=".variants-", dir=staging.parent))
    try:
        for name in names:
            spec = VARIANTS[name]
            entries[name] = {}
            for role, fp32 in graphs.items():
                recipe = spec.recipes[role]
                if (role, recipe) not in written:
                    say(f"writing the {role} graph of the {name} variant ({recipe})")
                    model = _make_graph(recipe, role, staging / fp32.file, work)
                    topological_sort(model.graph)
                    cleared = clear_reshape_allowzero_proto(model)
                    file, data_file = _save(model, staging, f"{role}.{recipe}.onnx",
                                            external=fp32.data_file is not None)
                    del model
                    log.info("wrote %s (cleared %d Reshape allowzero)", file, cleared)
                    written[(role, recipe)] = GraphEntry(file=file, data_file=data_file,
                                                         opset=fp32.opset, contract=fp32.contract)
                entries[name][role] = written[(role, recipe)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_manifest(entries)

    say("checking the variants against fp32")
    pages, queries = sample_pages(), list(SAMPLE_QUERIES)
    reference = colembed.load(staging, verify=False)
    want_pages = reference.embed_images(pages, batch_size=len(pages))
    want_queries = reference.embed_queries(queries)
    del reference
    results: dict[str, dict[str, Any]] = {}
    failures = []
    for name in names:
        model = colembed.load(staging, variant=name, verify=False)
        figures = cosine_figures(model.embed_images(pages, batch_size=len(pages)), want_pages,
                                 model.embed_queries(queries), want_queries)
        del model
        gate = VARIANTS[name].gate
        figures.update({"gate": gate.to_dict(), "recipes": dict(VARIANTS[name].recipes),
                        "pages": len(pages), "queries": len(queries)})
        results[name] = figures
        say(f"{name}: per-token cosine to fp32 mean {figures['mean_cosine']:.5f}, "
            f"min {figures['min_cosine']:.5f}")
        for miss in gate.misses(figures):
            failures.append(f"{name}: {miss} (mean {figures['mean_cosine']:.5f}, "
                            f"min {figures['min_cosine']:.5f} over {figures['tokens']} tokens)")
    if failures:
        raise ExportError("variant check failed against fp32; nothing was written:\n  "
                          + "\n  ".join(failures))
    return results


__all__ = [
    "GATES",
    "VARIANTS",
    "Gate",
    "VariantSpec",
    "clear_reshape_allowzero_proto",
    "convert_fp16",
    "cosine_figures",
    "maxsim_scores",
    "parse_variants",
    "quantize_int4",
    "quantize_int8",
    "synthetic_retrieval_set",
    "token_cosines",
    "topk_agreement",
    "write_variants",
]
