"""Question: What peak memory do loading a ColQwen2.5 base and merging a LoRA adapter take?
Answer: 1.9x the fp32 weights for either step with today's loader (2.2x before)
Note: benchmarks/results/experiments/merge-memory.md

Peak memory of loading a colpali-layout ColQwen2.5 base and merging a LoRA adapter into it.

    python -m benchmarks.experiments.merge_memory --workdir /tmp/merge-mem --clean
    python -m benchmarks.experiments.merge_memory --loader-file OLD.py ...   # another loader

The step `colembed export ADAPTER` runs before the export proper
(export/families/qwen2_5/adapter.py): the base in colpali-engine's layout is loaded as an fp32
`ColQwen2ForRetrieval` and peft merges the adapter into it. bench_export.py measures the export of a
transformers-layout checkpoint only; this measures what comes first. The checkpoint: Qwen2.5-VL-3B
widths (the published 3B bases'), random weights, reduced depth (`--vision-depth`, `--text-layers`),
written in the pre-4.52 colpali layout as fp32 (the published 3B bases are bf16: a bf16 base would
cost the old loader a further half copy); the adapter: LoRA r 32 / alpha 32 with nomic-ai's target
regex over the language model and custom_text_proj (docs/models-colqwen2_5.md). Each measurement
runs in a fresh child process; the figure is that step's own peak RSS (VmHWM reset at its start,
colembed_export.measure) against the checkpoint's fp32 weights. `--loader-file` swaps in another
`export/families/qwen2_5/checkpoint.py` (e.g. the previous commit's) for an A/B in one run.

Writes benchmarks/results/experiments/merge-memory.{md,json} (or --results).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # the benchmarks folder

from benchmarks.shared.machine import machine_info, markdown_header  # noqa: E402

BUILD = """
import sys, dataclasses, json
from pathlib import Path
import torch
from peft import LoraConfig, get_peft_model
from benchmarks.shared.specs import build, reduced_spec
from colembed_export.testing.tiny_qwen2_5 import to_colpali_layout
depth, layers, work = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
spec = reduced_spec("colqwen2.5", "qwen2.5-vl-3b", depth, layers)
build("colqwen2.5", work / "transformers", spec)
to_colpali_layout(work / "transformers", work / "base", pre_4_52=True, shards=2)
"""
ADAPTER = """
import sys, json
from pathlib import Path
import torch
from torch import nn
from peft import LoraConfig, get_peft_model
from colembed_export.families.qwen2_5.checkpoint import load_colqwen2_5
work = Path(sys.argv[1])
model = load_colqwen2_5(work / "base")
class Pre452(nn.Module):  # colpali-engine's module tree before transformers 4.52
    def __init__(self, m):
        super().__init__()
        self.model, self.visual = m.vlm.model.language_model, m.vlm.model.visual
        self.custom_text_proj = m.embedding_proj_layer
targets = r"(.*(model).*(down_proj|gate_proj|up_proj|k_proj|q_proj|v_proj|o_proj).*$|.*(custom_text_proj).*$)"
peft_model = get_peft_model(Pre452(model), LoraConfig(r=32, lora_alpha=32, target_modules=targets,
                                                      task_type="FEATURE_EXTRACTION"))
peft_model.save_pretrained(work / "adapter")
config = json.loads((work / "adapter" / "adapter_config.json").read_text())
(work / "adapter" / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(work / "base")}))
"""
MEASURE = """
import sys, json, importlib.util
from pathlib import Path
import torch, transformers, peft  # imported before the step: not part of its peak
from colembed_export.measure import StepMeter
what, work, loader = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
import colembed_export.families.qwen2_5.checkpoint as ckpt
if loader:
    spec = importlib.util.spec_from_file_location("colembed_export._bench_loader", loader)
    module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
    ckpt.load_colqwen2_5 = module.load_colqwen2_5
    import colembed_export.families.qwen2_5.adapter as adapter
    adapter.load_colqwen2_5 = module.load_colqwen2_5
meter = StepMeter(lambda m: None)
with meter.step(what):
    if what == "load the base":
        model = ckpt.load_colqwen2_5(work / "base")
    else:
        from colembed_export.families.qwen2_5.adapter import merge_adapter
        model = merge_adapter(work / "adapter")
print(json.dumps(meter.as_dicts()[0]))
"""


def child(code: str, *args: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code, *args], check=True, cwd=HERE, capture_output=True, text=True
    ).stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vision-depth", type=int, default=2)
    parser.add_argument("--text-layers", type=int, default=2)
    parser.add_argument("--workdir", default="/tmp/colembed-bench-merge")
    parser.add_argument(
        "--loader-file",
        action="append",
        default=[],
        help="another export/families/qwen2_5/checkpoint.py to measure beside the current one",
    )
    parser.add_argument("--clean", action="store_true")
    parser.add_argument("--results", default=str(HERE / "results" / "experiments" / "merge-memory"))
    args = parser.parse_args()

    from colembed import safe_fs

    info = machine_info()
    work = safe_fs.make_work_folder(args.workdir, "bench_merge_memory")
    if not (work / "base" / "config.json").is_file():
        child(BUILD, str(args.vision_depth), str(args.text_layers), str(work))
    if not (work / "adapter").is_dir():
        child(ADAPTER, str(work))
    weights = sum(p.stat().st_size for p in (work / "base").glob("*.safetensors")) / 1e9
    rows = []
    for loader in ["", *args.loader_file]:  # interleaved: A, B per step
        for what in ("load the base", "merge the adapter"):
            record = json.loads(child(MEASURE, what, str(work), loader).strip().splitlines()[-1])
            rows.append(
                {
                    "loader": loader or "current",
                    **record,
                    "peak_over_weights": round(record["peak_rss_gb"] / weights, 2),
                }
            )
    result = {
        "weights_gb": round(weights, 3),
        "vision_depth": args.vision_depth,
        "text_layers": args.text_layers,
        "rows": rows,
    }
    lines = [
        "# Loading a colpali-layout ColQwen2.5 base and merging an adapter: peak RSS",
        "",
        markdown_header(info),
        "",
        f"Base: random weights, Qwen2.5-VL-3B widths, {args.vision_depth} vision blocks + "
        f"{args.text_layers} language layers, pre-4.52 colpali layout in 2 fp32 shards, "
        f"{weights:.2f} GB. Adapter: LoRA r 32 / alpha 32, nomic-ai's target regex.",
        "",
        "| loader | step | seconds | peak RSS GB | peak / fp32 weights |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['loader']} | {r['step']} | {r['seconds']:.1f} | {r['peak_rss_gb']:.2f} | "
            f"{r['peak_over_weights']:.2f}x |"
        )
    lines += [
        "",
        "Peak RSS per step is that step's own high-water mark (VmHWM reset at its start), "
        "each in a fresh process after torch, transformers and peft are imported.",
    ]
    Path(args.results + ".json").write_text(
        json.dumps({"machine": info, **result}, indent=2) + "\n"
    )
    Path(args.results + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.clean:
        safe_fs.remove_tree(work, owner=safe_fs.is_work_folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
