"""Question: Where, node by node, does the int8 text graph lose the page prompt's text tokens?
Answer: layer 1's attention scores (spread ~6000 logits): int8's ~1% error flips its argmax
Note: benchmarks/results/variants/variants-int8-pages-2b-heldout.md

    python -m benchmarks.experiments.variants_int8_trace FP32_FOLDER [--pages NAMES] \
        [--all | --summary | --scores] [--keep q_proj,k_proj] [--passes 2] [--recipe fp16] \
        [--vision]

Writes the int8 text graph of an fp32 export folder with the exporter's recipe (or an arm of
it: `--keep` module paths left fp32, `--passes` weight codes, `--recipe fp16`), records the
fp32 text graph's feeds for gate pages (vision fp32; `--vision`: the int8 vision graph's
features feed the variant's text graph), then runs both text graphs with every intermediate
tensor exposed and compares each tensor the two graphs share (everything but the rewritten
MatMuls) per token: cosine and relative error, for the image tokens and the text tokens apart.
The first node where the text tokens' cosine falls is where the error arises. `--summary`: the
final embeddings only; `--scores`: the fp32 attention scores' spread and top-1/top-2 gaps.
The variant graphs are written into FP32_FOLDER (`--out`, text.trace.onnx; vision.trace.onnx).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np


def int8_text_graph(
    folder: Path,
    calibration: list[dict],
    out: str,
    recipe: str = "int8",
    src: str = "text.onnx",
    **arm: Any,
) -> str:
    from colembed_export.graphs.edits import finish
    from colembed_export.variants.recipes import convert_fp16, quantize_int8
    from colembed_export.variants.write import save_graph

    if recipe == "fp16":  # the reference rounding: fp16 weights, fp32 activations
        model, info = convert_fp16(folder / src, calibration)
        info["fp32_outlier_channels"] = {}
    else:
        model, info = quantize_int8(folder / src, calibration=calibration, **arm)
    finish(model)
    save_graph(model, folder, out, external=True)
    print("int8 recipe:", {k: v for k, v in info.items() if k != "fp32_outlier_channels"})
    print("fp32 outlier channels:", info["fp32_outlier_channels"], file=sys.stderr)
    return out


def intermediates(path: Path) -> list[str]:
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    return [o for n in proto.graph.node for o in n.output if o]


def run_all(path: Path, names: list[str], feed: dict) -> dict[str, np.ndarray]:
    from colembed_export.graphs.edits import _probe

    with _probe(path, lambda graph: list(names)) as (session, outs):
        return dict(zip(outs, session.run(outs, feed)))


def per_token(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a = a.reshape(-1, a.shape[-1]).astype(np.float64)
    b = b.reshape(-1, b.shape[-1]).astype(np.float64)
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    cos = np.sum(a * b, axis=1) / np.maximum(na * nb, 1e-30)
    rel = np.linalg.norm(a - b, axis=1) / np.maximum(nb, 1e-30)
    return cos, rel


def attention_scores(path: Path, feed: dict) -> list[dict]:
    """Per text attention (GroupQueryAttention, causal) of the fp32 graph at `path` on `feed`:
    the scores' spread (max - median logit of a query token's row) and the top-1 minus top-2
    logit gap, over every head and every query token at position > 0: how far a relative error
    in q or k may move a score before the softmax's winner changes."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    nodes = [n for n in proto.graph.node if n.op_type == "GroupQueryAttention"]
    names = [n for node in nodes for n in node.input[:2]]
    values = run_all(path, names, feed)
    rows = []
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        heads, kv = attrs["num_heads"], attrs["kv_num_heads"]
        q, k = (values[n][0].astype(np.float64) for n in node.input[:2])
        tokens, dim = q.shape[0], q.shape[1] // heads
        scale = attrs.get("scale") or dim**-0.5
        spread, gaps = [], []
        for h in range(heads):
            g = h // (heads // kv)
            s = q[:, h * dim : (h + 1) * dim] @ k[:, g * dim : (g + 1) * dim].T * scale
            for t in range(1, tokens):
                row = np.sort(s[t, : t + 1])[::-1]
                spread.append(row[0] - np.median(row))
                gaps.append(row[0] - row[1])
        spread, gaps = np.array(spread), np.array(gaps)
        rows.append(
            {
                "attention": node.output[0],
                "spread_max": float(spread.max()),
                "spread_median": float(np.median(spread)),
                "gap_below_1pct_of_spread": float(np.mean(gaps < 0.01 * spread)),
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--pages", default="sample page 2,smallest page")
    parser.add_argument("--graph", default=None, help="an int8 text graph already written")
    parser.add_argument("--show", type=int, default=60)
    parser.add_argument("--all", action="store_true", help="every shared tensor, not only changes")
    parser.add_argument("--summary", action="store_true", help="the final embeddings only")
    parser.add_argument("--scores", action="store_true", help="the fp32 attention scores' spread")
    parser.add_argument("--keep", default="", help="module-path fragments kept fp32 (an arm)")
    parser.add_argument("--passes", type=int, default=1, help="int8 codes per weight")
    parser.add_argument("--recipe", default="int8", choices=("int8", "fp16"))
    parser.add_argument(
        "--vision", action="store_true", help="the variant's text graph reads int8 vision features"
    )
    parser.add_argument("--out", default="text.trace.onnx", help="the int8 text graph's file")
    args = parser.parse_args()

    import colembed
    from colembed_export.variants.gates import calibration_feeds, gate_pages, recording_feeds

    folder = args.folder
    wanted = [p.strip() for p in args.pages.split(",")]
    runtime = colembed.load(folder, verify=False)
    feeds = calibration_feeds(folder)
    calibration = feeds["text"]
    if args.scores:
        recorded = recording_feeds(runtime)
        pages = [(n, p) for n, p in gate_pages(runtime) if any(n.startswith(w) for w in wanted)]
        for _, page in pages:
            runtime.embed_images([page], batch_size=1)
        runtime.embed_queries(["What was the quarterly revenue of ACME Corp. in 2023?"])
        names = [n for n, _ in pages] + ["query"]
        print("| item | attention | score spread max | median | gaps < 1% of spread |")
        for name, feed in zip(names, recorded["text"]):
            for row in attention_scores(folder / "text.onnx", feed):
                print(
                    f"| {name} | {row['attention']} | {row['spread_max']:.1f} | "
                    f"{row['spread_median']:.1f} | {row['gap_below_1pct_of_spread']:.3f} |"
                )
        return 0
    keep = [k for k in args.keep.split(",") if k]
    graph = args.graph or int8_text_graph(
        folder, calibration, args.out, args.recipe, keep=keep, weight_passes=args.passes
    )
    pages = [(n, p) for n, p in gate_pages(runtime) if any(n.startswith(w) for w in wanted)]
    recorded = recording_feeds(runtime)
    for _, page in pages:
        runtime.embed_images([page], batch_size=1)
    image_id = runtime.config.image_token_id
    fp32_names = intermediates(folder / "text.onnx")
    int8_names = set(intermediates(folder / graph))
    shared = [n for n in fp32_names if n in int8_names]
    if args.summary:
        shared = ["embeddings"]
    if args.vision:
        vision = int8_text_graph(
            folder,
            feeds["vision"],
            "vision.trace.onnx",
            src="vision.onnx",
            keep=keep,
            weight_passes=args.passes,
        )
    for i, ((name, _), feed) in enumerate(zip(pages, recorded["text"])):
        ids = feed["input_ids"][0]
        want = run_all(folder / "text.onnx", shared, feed)
        if args.vision:
            features = run_all(folder / vision, ["image_features"], recorded["vision"][i])
            shape = feed["image_features"].shape  # one page: its rows, in order
            feed = dict(feed, image_features=features["image_features"].reshape(shape))
        got = run_all(folder / graph, shared, feed)
        tokens = ids.size
        image = ids == image_id if image_id is not None else np.zeros(tokens, bool)
        print(f"\n## {name}: {tokens} tokens, {int(image.sum())} image tokens")
        print("| tensor | shape | text min cos | image min cos | text max rel | image max rel |")
        shown = 0
        last = 1.0
        for n in shared:
            a, b = got[n], want[n]
            if a.dtype.kind != "f" or a.shape != b.shape or a.ndim < 2:
                continue
            if a.reshape(-1, a.shape[-1]).shape[0] != tokens:
                continue
            cos, rel = per_token(a, b)
            tmin = float(cos[~image].min()) if (~image).any() else 1.0
            imin = float(cos[image].min()) if image.any() else 1.0
            if args.all or abs(tmin - last) > 2e-4 or shown < 5:
                print(
                    f"| {n} | {tuple(a.shape)} | {tmin:.5f} | {imin:.5f} | "
                    f"{float(rel[~image].max()):.4f} | "
                    f"{float(rel[image].max()) if image.any() else 0:.4f} |"
                )
                shown += 1
                last = tmin
            if shown >= args.show:
                break
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
