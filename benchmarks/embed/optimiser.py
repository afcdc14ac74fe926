"""bench_embed's optimiser report: onnxruntime's transformer optimiser on the fp32 graphs (which
fusions fire, op counts before/after and after the session's own level-ALL optimisation, graph time
before/after), informative only: the shipped graphs are not passed through it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]  # the benchmarks folder

from colembed.layout import BASE_VARIANT, MANIFEST_NAME  # noqa: E402
from colembed.sessions import Session  # noqa: E402
from benchmarks.shared.common import timed as _timed  # noqa: E402


def optimiser_report(folder: Path, threads: int, page_tokens: int) -> dict[str, Any]:
    """onnxruntime.transformers.optimizer on the fp32 graphs: fusions, op counts, graph time."""
    import collections
    import logging
    import tempfile

    import numpy as np
    import onnx
    from onnxruntime.transformers import optimizer

    from colembed.contracts import colqwen2_contracts
    from colembed.preprocess.config import PreprocessConfig

    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    arch = manifest["architecture"]
    config = PreprocessConfig.from_dict(manifest["preprocess"])
    contracts = colqwen2_contracts(
        patch_dim=config.patch_dim,
        vision_head_dim=config.vision_head_dim,
        text_hidden=arch["text_hidden"],
        embedding_dim=manifest["embedding_dim"],
    )
    rng = np.random.default_rng(0)
    report: dict[str, Any] = {}
    patches = page_tokens * config.merge_size**2
    tokens = page_tokens + 20
    index = np.zeros((1, tokens), np.int64)
    index[0, 5 : 5 + page_tokens] = np.arange(1, page_tokens + 1)
    feeds = {
        "vision": contracts["vision"].feeds(
            rng.standard_normal((1, patches, config.patch_dim), dtype=np.float32),
            np.ones((patches, config.vision_head_dim), np.float32),
            np.zeros((patches, config.vision_head_dim), np.float32),
        ),
        "text": contracts["text"].feeds(
            np.full((1, tokens), config.pad_token_id, np.int64),
            np.ones((1, tokens), np.int64),
            np.broadcast_to(np.arange(tokens), (3, 1, tokens)).copy(),
            index,
            rng.standard_normal((page_tokens, arch["text_hidden"]), dtype=np.float32),
        ),
    }
    model_types = {"vision": "clip", "text": "bert"}  # the fusion sets that match our patterns
    with tempfile.TemporaryDirectory(prefix="colembed-opt-") as tmp:
        for role in ("vision", "text"):
            src = folder / manifest["variants"][BASE_VARIANT][role]["file"]
            before = collections.Counter(
                n.op_type for n in onnx.load(str(src), load_external_data=False).graph.node
            )
            opt_path = Path(tmp) / f"{role}.opt.onnx"
            session_path = Path(tmp) / f"{role}.ort-all.onnx"
            optimised = optimizer.optimize_model(
                str(src),
                model_type=model_types[role],
                num_heads=0,
                hidden_size=0,
                opt_level=0,
                use_gpu=False,
            )
            fused = {k: v for k, v in optimised.get_fused_operator_statistics().items() if v}
            optimised.save_model_to_file(str(opt_path), use_external_data_format=True)
            after = collections.Counter(n.op_type for n in optimised.model.graph.node)
            del optimised
            timing = {}
            for label, path in (("exported", src), ("transformer_optimiser", opt_path)):
                session = Session(
                    path,
                    threads=threads,
                    save_optimized=session_path if label == "exported" else None,
                )
                feed = feeds[role]
                session.run(feed)
                timing[label] = min(_timed(lambda s=session, f=feed: s.run(f)) for _ in range(3))
                del session
            in_session = collections.Counter(
                n.op_type for n in onnx.load(str(session_path), load_external_data=False).graph.node
            )
            report[role] = {
                "model_type": model_types[role],
                "fusions": fused,
                "op_counts_exported": dict(before),
                "op_delta_transformer_optimiser": _delta(before, after),
                "op_delta_ort_session_all": _delta(before, in_session),
                "graph_s": timing,
                "tokens": page_tokens,
            }
    return report


def _delta(before, after) -> dict[str, int]:
    return {
        k: after[k] - before[k] for k in sorted(set(before) | set(after)) if after[k] != before[k]
    }
