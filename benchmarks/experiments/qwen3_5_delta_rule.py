"""Question: Can Qwen3.5's Gated DeltaNet layer run exactly as an ONNX graph of standard ops?
Answer: yes: within 2.6e-6 of transformers 5.24 per token to 4,000 tokens, DirectML ops only
Note: benchmarks/results/experiments/qwen3_5-delta-rule.md

One Qwen3.5 linear-attention layer at Qwen3.5-0.8B's widths (hidden 1024, 16 key and 16 value
heads of 128, conv kernel 4; `--widths 4b`: hidden 2560, 16 key / 32 value heads) with random
weights, three ways on the same weights and inputs:

- the reference: transformers 5.24's `Qwen3_5GatedDeltaNet` without a cache (its torch fallback:
  causal conv1d, `torch_chunk_gated_delta_rule`), in the reference environment;
- `colembed_export.families.qwen3_5.delta_net.GatedDeltaNet` in torch (eager);
- that module exported by torch.onnx.export (dynamo, opset 18, dynamic batch and length) and run on
  onnxruntime CPU.

    python -m benchmarks.experiments.qwen3_5_delta_rule \
        --reference-python .venv-qwen3-reference/bin/python

Each length runs as a right-padded batch of two (the full length, and a shorter row whose padding
holds random values) and the shorter row alone: printed are the max abs differences on real tokens,
and whether padding changed a real token's output. The graph's ops are checked against DirectML's
kernel list (export/graphs/directml.py). Times: one row at `--time-lengths` tokens, best of
`--repeats` runs, in `--rounds` rounds of reference, onnxruntime and this module in turn, with
the load average.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.shared.common import load_average, machine_info, write_results
from benchmarks.shared.machine import markdown_header
from colembed_export.testing.reference_env import run_reference
from colembed_export.testing.tiny_qwen3_5 import random_delta_net

ROOT = Path(__file__).resolve().parents[2]

# Qwen3.5-0.8B's and -4B's published text configs (docs/reference-colqwen3_5.md lists the
# sources): the same DeltaNet heads and kernel; the 4B (the 4.5B retrievers' backbone) is wider and
# has twice as many value heads as key heads.
_DELTA_NET = dict(
    linear_num_key_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
)
WIDTHS = {
    "0.8b": dict(hidden_size=1024, linear_num_value_heads=16, **_DELTA_NET),
    "4b": dict(hidden_size=2560, linear_num_value_heads=32, **_DELTA_NET),
}


def export_layer(layer, path: Path) -> None:
    import torch

    # Two groups of chunks or more: torch.export fixes a dimension that is 1 in the example.
    hidden = torch.randn(2, 600, layer.out_proj.out_features)
    mask = torch.ones(2, 600, dtype=torch.int64)
    batch, length = torch.export.Dim("batch"), torch.export.Dim("length")
    torch.onnx.export(
        layer,
        (hidden, mask),
        str(path),
        input_names=["hidden_states", "attention_mask"],
        output_names=["output"],
        dynamic_shapes={
            "hidden_states": {0: batch, 1: length},
            "attention_mask": {0: batch, 1: length},
        },
        opset_version=18,
        dynamo=True,
        optimize=True,
        verbose=False,
        report=False,
    )
    # What the exporter does to every graph it writes (export/graphs/onnx_io.py): DirectML
    # rejects Reshape(allowzero=1).
    import onnx_ir as ir

    from colembed_export.graphs.reshape_allowzero import clear_reshape_allowzero

    model = ir.load(path)
    clear_reshape_allowzero(model)
    ir.save(model, path)


def inputs_for(length: int, hidden: int, rng: np.random.Generator):
    """A right-padded batch of two: row 0 full, row 1 `short` real tokens then random padding."""
    short = max(1, length - max(1, length // 3))
    states = rng.standard_normal((2, length, hidden), dtype=np.float32)
    mask = np.ones((2, length), np.int64)
    mask[1, short:] = 0
    return states, mask, short


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference-python", required=True)
    parser.add_argument("--widths", choices=sorted(WIDTHS), default="0.8b")
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[1, 7, 63, 64, 65, 300, 1500, 4000]
    )
    parser.add_argument("--time-lengths", type=int, nargs="*", default=[300, 1500])
    parser.add_argument("--repeats", type=int, default=5, help="runs per round (best kept)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of reference, onnxruntime, module, in turn"
    )
    parser.add_argument("--scale", type=float, default=0.02, help="std of the projections")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="results stem (benchmarks/results/experiments/NAME)")
    args = parser.parse_args()

    import onnx
    import onnxruntime as ort
    import torch

    from colembed_export.graphs.directml import directml_problems

    torch.set_num_threads(args.threads)
    config = WIDTHS[args.widths]
    layer = random_delta_net(config, seed=0, scale=args.scale)
    load_before = load_average()
    work = Path(tempfile.mkdtemp(prefix="qwen3_5-delta-"))
    graph = work / "delta_net.onnx"
    start = time.perf_counter()
    export_layer(layer, graph)
    export_seconds = time.perf_counter() - start
    model = onnx.load(str(graph))
    ops = sorted({(n.domain or "ai.onnx", n.op_type) for n in model.graph.node})
    dml = directml_problems(graph)
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])

    rng = np.random.default_rng(0)
    feed = {"config": json.dumps(config)}
    feed.update({f"w.{k}": v.numpy() for k, v in layer.state_dict().items()})
    cases = []
    for i, length in enumerate(args.lengths):
        states, mask, short = inputs_for(length, config["hidden_size"], rng)
        cases.append((length, short, states, mask))
        feed[f"hidden{2 * i}"], feed[f"mask{2 * i}"] = states, mask
        feed[f"hidden{2 * i + 1}"] = states[1:, :short]
        feed[f"mask{2 * i + 1}"] = mask[1:, :short]
    timed = {}
    timing_feed = {k: v for k, v in feed.items() if k == "config" or k.startswith("w.")}
    for j, length in enumerate(args.time_lengths):
        states = rng.standard_normal((1, length, config["hidden_size"]), dtype=np.float32)
        timing_feed[f"hidden{j}"] = states
        timing_feed[f"mask{j}"] = np.ones((1, length), np.int64)
        timing_feed[f"time{j}"] = np.array(args.repeats)
        timed[length] = (j, states)
    threads = {"OMP_NUM_THREADS": str(args.threads)}

    def reference_run(data: dict, name: str):
        inp, out = work / f"{name}-in.npz", work / f"{name}-out.npz"
        np.savez(inp, **data)
        run_reference(
            "colembed_export.families.qwen3_5.reference",
            "layer",
            inp,
            out,
            python=args.reference_python,
            env=threads,
        )
        return np.load(out)

    ref = reference_run(feed, "distances")

    rows = []
    for i, (length, short, states, mask) in enumerate(cases):
        with torch.no_grad():
            eager = layer(torch.from_numpy(states), torch.from_numpy(mask)).numpy()
        onnx_out = session.run(None, {"hidden_states": states, "attention_mask": mask})[0]
        alone = session.run(
            None, {"hidden_states": states[1:, :short], "attention_mask": mask[1:, :short]}
        )[0]
        reference, reference_alone = ref[f"out{2 * i}"], ref[f"out{2 * i + 1}"]
        real = [(0, length), (1, short)]

        def worst(a, b):
            return max(float(np.abs(a[r, :n] - b[r, :n]).max()) for r, n in real)

        rows.append(
            {
                "length": length,
                "short_row": short,
                "onnx_vs_reference": worst(onnx_out, reference),
                "torch_vs_reference": worst(eager, reference),
                "onnx_vs_torch": worst(onnx_out, eager),
                "padding_effect_onnx": float(np.abs(onnx_out[1, :short] - alone[0]).max()),
                "padding_effect_reference": float(
                    np.abs(reference[1, :short] - reference_alone[0]).max()
                ),
                "reference_max_abs": float(np.abs(reference).max()),
            }
        )
        print(json.dumps(rows[-1]), flush=True)

    def best_of(fn) -> float:
        fn()
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        return best

    # Each round times the reference (its own process), then onnxruntime, then this module in
    # torch, so the three share the machine's state of that minute.
    rounds = {length: {"reference": [], "onnxruntime": [], "module": []} for length in timed}
    for _ in range(args.rounds):
        seconds = reference_run(timing_feed, "times")
        for length, (j, states) in timed.items():
            mask = np.ones((1, length), np.int64)
            one = {"hidden_states": states, "attention_mask": mask}
            rounds[length]["reference"].append(float(seconds[f"seconds{j}"]))
            rounds[length]["onnxruntime"].append(best_of(lambda: session.run(None, one)))
            with torch.no_grad():
                rounds[length]["module"].append(
                    best_of(lambda: layer(torch.from_numpy(states), torch.from_numpy(mask)))
                )
        print(json.dumps(rounds), flush=True)
    times = [
        {
            "length": length,
            **{f"{k}_s": v for k, v in r.items()},
            "onnxruntime_over_reference": [o / f for o, f in zip(r["onnxruntime"], r["reference"])],
        }
        for length, r in rounds.items()
    ]
    load_after = load_average()

    info = machine_info()
    info["command"] = "python -m benchmarks.experiments.qwen3_5_delta_rule " + " ".join(
        sys.argv[1:]
    )
    info["load_average_at_start"] = load_before
    data = {
        "widths": config,
        "projection_std": args.scale,
        "export_seconds": export_seconds,
        "ops": ops,
        "directml_problems": dml,
        "distances": rows,
        "times": times,
        "load_before": load_before,
        "load_after": load_after,
    }
    print(json.dumps({k: data[k] for k in ("ops", "directml_problems")}), flush=True)
    if args.out:
        body = [markdown_header(info), "", "```", json.dumps(data, indent=1), "```"]
        write_results(args.out, "\n".join(body) + "\n", info, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
