"""Which attentions int8 cannot hold: their scores, measured on the fp32 graph's calibration feeds.

An int8 recipe moves a score (q . k / sqrt(d)) by about 1e-3 of its row's spread (max minus median
logit of a query token's row), through its own q/k projections and through every int8 product
upstream of them. Where a row spreads over thousands of logits and its winner leads by a few,
that error changes the softmax's winner and the token's embedding with it. `sharp_attentions`
measures each text attention's spread on the calibration feeds; the int8 recipes keep what feeds
an attention spreading past SHARP_SCORE_SPREAD in fp32: every MatMul its scores depend on
(`score_feeders`: its q and k projections and the layers before it) and, when it is that sharp
on pages, the vision graph (`vision_stays_fp32`).
Inputs: the fp32 text graph's path and its calibration feeds; the attentions are onnxruntime's
GroupQueryAttention nodes the text graphs are written with (causal, right-padded, q and k
already rotated). Imports numpy and onnx; onnxruntime through graphs.edits' probe.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

# An attention spreading past this many logits (max minus median of a query token's row, on any
# calibration feed) is sharp: at int8's ~1e-3 relative score error a score moves by ~1 logit, as
# far as near-tied winners lie apart. The held-out 2B-width stress pages spread 6,000-8,700 and
# lose tokens to int8 (cosine 0.70); the default stress pages spread 53-144 and hold (0.9975)
# (benchmarks/results/variants/variants-int8-pages-2b-heldout.md).
SHARP_SCORE_SPREAD = 1000.0
ATTENTION_OPS = ("GroupQueryAttention",)


@dataclass(frozen=True)
class SharpAttention:
    """A text attention's widest score spread on the calibration feeds, and whether that was on
    a feed with image tokens (a page: the keys come from the vision graph's features)."""

    path: str  # the attention's module path (graphs.edits.module_path)
    spread: float  # the largest max-minus-median row spread, in logits
    on_pages: bool
    limit: float  # the spread it passed (SHARP_SCORE_SPREAD when measured)


def attention_nodes(proto_graph: Any) -> list[Any]:
    return [n for n in proto_graph.node if n.op_type in ATTENTION_OPS]


def row_spreads(q: np.ndarray, k: np.ndarray, heads: int, kv_heads: int, scale: float) -> float:
    """The largest max-minus-median logit of one item's causal score rows (q: tokens x heads*d,
    k: tokens x kv_heads*d), every head, every row past the first."""
    tokens = q.shape[0]
    if tokens < 2:
        return 0.0
    dim = q.shape[1] // heads
    future = np.triu(np.ones((tokens, tokens), bool), 1)
    widest = 0.0
    for h in range(heads):
        g = h // (heads // kv_heads)
        s = (q[:, h * dim : (h + 1) * dim] @ k[:, g * dim : (g + 1) * dim].T) * scale
        s[future] = np.nan
        rows = s[1:]
        widest = max(widest, float(np.max(np.nanmax(rows, axis=1) - np.nanmedian(rows, axis=1))))
    return widest


def sharp_attentions(
    src: Path, calibration: Sequence[dict[str, Any]], limit: float | None = None
) -> list[SharpAttention]:
    """The attentions of the fp32 text graph at `src` whose score rows spread past `limit` logits
    (default SHARP_SCORE_SPREAD, read when called) on any of the `calibration` feeds (each item's
    real tokens: `attention_mask`), widest first."""
    import onnx

    limit = SHARP_SCORE_SPREAD if limit is None else limit

    from ..graphs.edits import _probe

    proto = onnx.load(str(src), load_external_data=False)
    nodes = attention_nodes(proto.graph)
    if not nodes:
        return []
    scope = {n.name: _module_path(n) for n in nodes}
    widest: dict[str, tuple[float, bool]] = {}
    with _probe(src, lambda graph: [x for n in nodes for x in n.input[:2]]) as (session, outs):
        for feed in calibration:
            values = dict(zip(outs, session.run(outs, feed)))
            mask = feed.get("attention_mask")
            page = any(
                "image" in name and np.asarray(v).size for name, v in feed.items()
            )  # the feed carries image features: a page
            for node in nodes:
                attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
                heads, kv = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
                q, k = values[node.input[0]], values[node.input[1]]
                scale = float(attrs.get("scale") or (q.shape[-1] // heads) ** -0.5)
                for b in range(q.shape[0]):
                    real = q.shape[1] if mask is None else int(np.asarray(mask)[b].sum())
                    spread = row_spreads(
                        q[b, :real].astype(np.float64),
                        k[b, :real].astype(np.float64),
                        heads,
                        kv,
                        scale,
                    )
                    old, old_page = widest.get(node.name, (0.0, False))
                    widest[node.name] = (
                        max(old, spread),
                        old_page or (page and spread > limit),
                    )
    found = [
        SharpAttention(scope[name], round(spread, 1), on_pages, limit)
        for name, (spread, on_pages) in widest.items()
        if spread > limit
    ]
    return sorted(found, key=lambda a: -a.spread)


def _module_path(proto_node: Any) -> str:
    """graphs.edits.module_path for an onnx proto node (the scopes in its metadata)."""
    import ast

    from ..graphs.edits import SCOPE_KEY

    raw = next((p.value for p in proto_node.metadata_props if p.key == SCOPE_KEY), "")
    try:
        found = ast.literal_eval(raw) if raw else []
    except (ValueError, SyntaxError):
        found = []
    return (
        str(found[-2] or found[-1])
        if isinstance(found, list) and len(found) > 1
        else proto_node.name
    )


def vision_stays_fp32(sharp: Sequence[SharpAttention]) -> bool:
    """Whether an int8 variant keeps its vision graph fp32: when a text attention is sharp on
    pages, its keys there are built from the vision features, whose int8 error moves the scores
    as much as an int8 q/k would (page text tokens' min cosine 0.78-0.89 with those q/k fp32 and
    int8 features, >= 0.998 with fp32 features: variants-int8-pages-2b-heldout.md)."""
    return any(a.on_pages for a in sharp)


def score_feeders(
    model: Any, attention_paths: Sequence[str], matmuls: Sequence[Any]
) -> dict[str, str]:
    """{module path of a weight MatMul (of `matmuls`): the attention it feeds} for every one the
    scores of the attentions at `attention_paths` in `model` (onnx_ir) depend on: walking back
    from each attention's query and key inputs through the whole graph (its q and k projections
    and every earlier layer; not its v nor what follows it). Measured: with only the sharp
    attention's q/k fp32 the held-out pages stay lost (min 0.885), with everything feeding them
    fp32 they hold (variants-int8-sharp-attention.md)."""
    from ..graphs.edits import module_path

    weights = {id(n) for n in matmuls}
    found: dict[str, str] = {}
    for node in model.graph:
        path = module_path(node)
        if node.op_type not in ATTENTION_OPS or path not in attention_paths:
            continue
        todo = [v.producer() for v in node.inputs[:2] if v is not None and v.producer()]
        seen: set[int] = set()
        while todo:
            up = todo.pop()
            if id(up) in seen:
                continue
            seen.add(id(up))
            if id(up) in weights:
                found.setdefault(module_path(up), path)
            todo += [v.producer() for v in up.inputs if v is not None and v.producer()]
    return found
