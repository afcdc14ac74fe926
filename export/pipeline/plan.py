"""The export's memory plan: what each chosen step will hold at its peak, said before any work,
and a refusal when a step would not fit.

The figures come from the checkpoint's safetensors headers (no tensor is read): `weights`, every
tensor widened to fp32 (what the torch model and the fp32 graphs hold), and `largest`, the largest
single tensor in fp32 (what a streamed graph step holds of the weights at once). Each step's
expected peak is a model of what it keeps resident, fitted to the full-size measurements in
benchmarks/results/export/streamed.md and export-variants-2b.md:

| step | holds at its peak |
|---|---|
| graphs, streamed | the process, the trace, one tensor: `BASELINE + TRACE + largest` |
| graphs, whole model | the process, the trace, the weights: `BASELINE + TRACE + weights` |
| check, reference layer by layer | the process, one module's weights: `BASELINE + TRACE + largest` |
| check, graphs on onnxruntime | one fp32 graph's weight file mapped at a time, the larger: |
|  | `BASELINE + max(vision weights, text weights)` |
| check, whole model | the fp32 torch model, then one fp32 graph at a time: `BASELINE + weights` |
| variants | calibration and the gates run the fp32 graphs on onnxruntime beside the largest |
|  | variant's: `BASELINE + weights x (GATE_FP32 + variant's share)` |

Where the graphs are streamed the check's reference runs layer by layer (offloaded.py); its
onnxruntime step opens the image graph's session, runs it, closes it, then the text graph's
(verify.py), so it counts the larger graph's weights (tensors under `visual` are the image
graph's, the rest the text graph's), as mapped file pages (the sessions copy no weight), which
the kernel can drop and read again: what that step cannot give back is the process and its
activations (benchmarks/results/export/streamed-check.md, streamed-capped.md).
A step's figure is an estimate (RSS counts mapped file pages the kernel could drop), meant to
refuse an export that cannot fit before it runs for an hour, not to size a machine to the MB.
`check_plan` refuses every step over `--max-memory`, naming the step, its figure and what to drop.
Without `--max-memory` the limit is the memory the system reports available, and only a step no
option can drop is refused there (the graphs: the machine cannot hold even the largest tensor);
a droppable step over it is a warning, since the figures are estimates and swap or freed page
cache may still carry it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from colembed.errors import ExportError

GB = 1e9
BASELINE = 0.6 * GB  # the exporter's process: torch, transformers, onnx, onnxruntime imported
TRACE = 0.25 * GB  # tracing one graph of a full-size model, its activations and ONNX proto
GATE_FP32 = 1.2  # calibration and the fp32 gate set: both fp32 graphs and the gate's batches
# Each variant's graphs against fp32 weights (int8x2: two codes per weight, the int8 fallback;
# int4: 4-bit text, 8-bit vision blocks; openvino: fp32 in OpenVINO's form).
VARIANT_SHARE = {
    "int8": 0.5,
    "int4": 0.25,
    "fp16": 0.5,
    "openvino": 1.0,
    "openvino-bf16": 1.0,
    "openvino-int8": 0.25,
}
# safetensors dtype -> bytes per element, for the headers' shapes
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1}


class ExportPlanRefused(ExportError):
    """A step of the export would need more memory than the limit allows; nothing was done."""


@dataclass(frozen=True)
class Step:
    name: str
    peak: float  # bytes
    drop: str | None  # what to leave out to skip this step, None: it cannot be skipped


@dataclass(frozen=True)
class ExportPlan:
    weights: float  # bytes of every checkpoint tensor in fp32
    largest: float  # bytes of the largest tensor in fp32
    largest_name: str
    steps: list[Step] = field(default_factory=list)

    @property
    def peak(self) -> Step:
        return max(self.steps, key=lambda s: s.peak)

    def lines(self) -> list[str]:
        """The plan as the exporter says it."""
        out = [
            f"plan: {self.weights / GB:.2f} GB of fp32 weights, the largest tensor "
            f"{self.largest_name} {self.largest / GB:.2f} GB"
        ]
        out += [f"plan:   {s.name}: ~{s.peak / GB:.2f} GB" for s in self.steps]
        out.append(f"plan: expected peak ~{self.peak.peak / GB:.2f} GB ({self.peak.name})")
        return out


def tensor_sizes(folder: Path) -> dict[str, int]:
    """Every tensor of the checkpoint's safetensors files -> its fp32 bytes, from the headers."""
    sizes: dict[str, int] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            with open(path, "rb") as f:
                length = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(length))
        except (OSError, ValueError) as e:
            raise ExportError(f"{path}: not a safetensors file ({e})") from e
        for name, info in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in info["shape"]:
                count *= int(dim)
            sizes[name] = count * max(4, _DTYPE_BYTES.get(info["dtype"], 4))
    return sizes


def plan_export(
    folder: Path, *, streamed: bool, check: bool, variants: Sequence[str] = ()
) -> ExportPlan:
    """What each step the export will run holds at its peak (module docstring)."""
    sizes = tensor_sizes(folder)
    if not sizes:
        raise ExportError(f"{folder}: no safetensors weights to plan the export from")
    weights = float(sum(sizes.values()))
    largest_name = max(sizes, key=sizes.__getitem__)
    largest = float(sizes[largest_name])
    vision = float(sum(size for name, size in sizes.items() if "visual" in name.split(".")))
    steps = [
        Step("graphs, streamed", BASELINE + TRACE + largest, None)
        if streamed
        else Step("graphs, from the whole loaded model", BASELINE + TRACE + weights, None)
    ]
    if check and streamed:
        steps += [
            Step(
                "check: torch reference, layer by layer", BASELINE + TRACE + largest, "--no-check"
            ),
            Step(
                "check: graphs on onnxruntime, one at a time, weights mapped",
                BASELINE + max(vision, weights - vision),
                "--no-check",
            ),
        ]
    elif check:
        steps.append(Step("check against the torch model", BASELINE + weights, "--no-check"))
    if variants:
        share = max(VARIANT_SHARE.get(v, 1.0) for v in variants)
        steps.append(
            Step(
                f"variants ({', '.join(variants)})",
                BASELINE + weights * (GATE_FP32 + share),
                "--variant (export the fp32 folder alone)",
            )
        )
    return ExportPlan(weights, largest, largest_name, steps)


def available_memory() -> float | None:
    """The memory the system reports available to a new allocation (Linux's MemAvailable), else
    the free physical pages; None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024.0
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def check_plan(plan: ExportPlan, max_memory_gb: float | None) -> list[str]:
    """ExportPlanRefused naming every step over the limit with its figure and what to drop
    (module docstring: which steps refuse without `max_memory_gb`); returns the warnings to say
    for droppable steps over the available memory, [] when every step fits or no limit is known."""
    if max_memory_gb is not None:
        if not max_memory_gb > 0:
            raise ExportError(f"--max-memory {max_memory_gb}: give a size in GB above 0")
        limit, source = max_memory_gb * GB, f"--max-memory {max_memory_gb:g} GB"
    else:
        limit = available_memory()
        if limit is None:
            return []
        source = f"the {limit / GB:.2f} GB this machine has available"
    over = [s for s in plan.steps if s.peak > limit]
    if not over:
        return []
    if max_memory_gb is None and all(s.drop for s in over):
        return [
            f"warning: {s.name} may need ~{s.peak / GB:.2f} GB, more than {source} "
            f"(drop it: {s.drop}; or set a hard limit with --max-memory)"
            for s in over
        ]
    lines = [
        f"  {s.name}: ~{s.peak / GB:.2f} GB"
        + (f" (drop it: {s.drop})" if s.drop else " (needed by every export)")
        for s in over
    ]
    remedy = (
        "leave out the steps named above, or give the export a machine with more memory"
        if all(s.drop for s in over)
        else "this checkpoint needs a machine with more memory"
    )
    raise ExportPlanRefused(
        f"the export would exceed {source}; nothing was done:\n"
        + "\n".join(lines)
        + f"\n{remedy} (largest tensor {plan.largest_name}: {plan.largest / GB:.2f} GB; "
        f"fp32 weights {plan.weights / GB:.2f} GB)"
    )


__all__ = [
    "ExportPlan",
    "ExportPlanRefused",
    "Step",
    "available_memory",
    "check_plan",
    "plan_export",
    "tensor_sizes",
]
