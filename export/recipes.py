"""What each reduced-precision variant is: the recipe per graph role and the gate against fp32.

| variant | vision graph                               | text graph                                        |
|---------|--------------------------------------------|---------------------------------------------------|
| int8    | dynamic int8, per-channel MatMul weights   | dynamic int8, per-channel MatMul weights, after   |
|         |                                            | SmoothQuant smoothing of activation outliers      |
| int4    | the int8 vision graph (same file)          | MatMulNBits 4-bit weight-only, accuracy level 4,  |
|         |                                            | block 16; token-embedding table stays fp32        |
| fp16    | fp16 weights and weight-GEMMs, fp32 rest   | fp16 weights and weight-GEMMs, fp32 rest          |

Why these choices (measured on the Qwen2-VL-2B-width benchmark model and the stress checkpoint,
see benchmarks/README.md):

- int8: onnxruntime's dynamic quantisation (`quantize_dynamic`) turns each MatMul with a constant
  weight into DynamicQuantizeLinear + MatMulInteger, which the CPU graph optimiser fuses into
  `DynamicQuantizeMatMul`. Activations are always uint8 there with ONE scale per tensor; signed
  int8 weights (u8s8) run the VNNI kernels (`INT8_WEIGHT_TYPE`). Trained models carry a few
  activation channels far above the rest (the stress checkpoint imitates them); a per-tensor
  scale then leaves the other channels a few levels. SmoothQuant (Xiao et al. 2023) moves that
  range into the weights at export: per input channel k, s_k = max|X_k|^a / max|W_k|^(1-a);
  X/s is folded into the producing norm's weight, W*s into the MatMul's rows. The function is
  unchanged in fp32, the graph and its speed too (graph_edits.smooth_activation_outliers): only
  constants change, and the smoothed and plain int8 graphs of both families are op for op the
  same after onnxruntime's own optimisation (tests/test_int8_smoothing.py), so no
  DynamicQuantizeMatMul fusion is lost. Every MatMul with a constant weight is quantised: in both
  families' int8 graphs only attention's activation x activation products (and the rotary
  frequencies) stay fp32. Per-channel weight scales cost nothing over per-tensor here
  (DynamicQuantizeMatMul on the 11 GEMM shapes of a ColQwen2.5 page, AVX2 without VNNI,
  interleaved: within run-to-run noise both ways) and follow each output channel's range.
  Chosen by measurement on the stress checkpoint at Qwen2-VL-2B widths (2+2 layers; per-token
  cosine to fp32, mean / min): plain 0.99626 / 0.99225; smoothed (alpha 0.5) 0.99654 / 0.99345;
  the one text MatMul whose input outlier ratio exceeded 8 left fp32 0.99635 / 0.99339 (slower).
  On the 64-wide tiny stress fixture smoothing costs a little (0.9945 / 0.986 against 0.9983 /
  0.9965), inside the gate; at real widths it is the better of the three.
- int4 is for the language model, where query work is memory-bound; the vision tower is
  compute-bound, where 4 bits save nothing over int8 compute but cost accuracy, so the int4
  variant reuses the int8 vision graph file.
- fp16 targets DirectML: fp16 weights (half the bytes) and fp16 weight-GEMMs (the bulk of the
  work); norms, softmax, activations, residual adds, rotary tables, attention scores and the
  final projection + L2 normalisation stay fp32, with one Cast into and one out of each GEMM
  group. No value rounds through fp16 between two fp32 ops (graph_edits.round_trip_casts == 0),
  and a residual stream above 65504 (the fp16 maximum) stays finite. A GEMM whose input or
  output comes near 65504 on the sample inputs stays fp32 (Qwen2.5-VL's gated vision MLP feeds
  its down-projection silu(gate) * up, the seed notes' overflow point). onnxruntime's CPU
  provider runs fp16 MatMuls in fp32 between its own casts (measured: an fp16 island fed 2e5
  returns the fp32 result), so the cosine gate run on CPU cannot see an fp16 overflow: the gate
  checks the measured peak at every fp16 GEMM instead (`Gate.fp16_peak`), and any inf/NaN.

Gates: per-token cosine between the variant's and fp32's embeddings (mean and min over all tokens)
and top-1 agreement on a ranking set built so that fp32 has clear winners (evaluation.py); no
inf/NaN anywhere; for fp16, the peak at its GEMMs.
This module imports nothing heavy; the recipes import onnx / onnxruntime when called.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from colembed.errors import ExportError

# Signed int8 weights: u8 activations x s8 weights is the VNNI fast path on x86 (benchmarks/
# README.md, "int8 weight type"); QUInt8 weights run the slower u8u8 kernels.
INT8_WEIGHT_TYPE = "QInt8"
# SmoothQuant migration strength: 0.5 splits the range evenly between activations and weights
# (the paper's default for OPT/LLaMA-class models).
SMOOTHING_ALPHA = 0.5
# Activation scales of the int8 MatMuls: "row" (one per token) or "tensor" (onnxruntime's
# dynamic quantisation, one per tensor and batch); see quantise.py and the module docstring.
INT8_ACTIVATIONS = "row"
# An input channel whose max |value| on a calibration item exceeds OUTLIER_RATIO x that item's
# median channel is computed in fp32 beside the int8 product, at most max(OUTLIER_MIN_CAP,
# width / OUTLIER_CAP_DIVISOR) channels per MatMul (the largest).
OUTLIER_RATIO = 8.0
OUTLIER_MIN_CAP = 4
OUTLIER_CAP_DIVISOR = 64
# Block 16 with the token-embedding table left fp32: on the realistic-width 2+2-layer model the
# mean/min per-token cosine to fp32 was 0.9814/0.920 with block 32 + 4-bit embeddings, 0.9835/0.940
# with fp32 embeddings, 0.9855/0.944 with block 16; the gate is 0.98 mean, so take the margin.
INT4_BLOCK_SIZE = 16
INT4_ACCURACY_LEVEL = 4  # int8 activations in the MatMulNBits kernel (VNNI), weights 4-bit
# Module-path fragments (torch exporter name scopes) whose weight-GEMMs stay fp32 in fp16: the
# final projection feeds the L2 normalisation and is tiny.
FP16_KEEP_SCOPES = ("projection",)
# fp16's largest finite value. A GEMM whose input or output reached FP16_MAX / FP16_HEADROOM on
# the sample inputs stays fp32: user pages are not the samples, so two bits of headroom. On the
# ColQwen2.5 stress checkpoint this keeps every vision down-projection (its input, silu(gate) *
# up, reaches 2e5) and nothing else.
FP16_MAX = 65504.0
FP16_HEADROOM = 4.0
FP16_SAFE_PEAK = FP16_MAX / FP16_HEADROOM


@dataclass(frozen=True)
class Gate:
    """What a variant must reach against fp32 (min_cosine None: not gated)."""

    mean_cosine: float
    min_cosine: float | None = None
    top1_agreement: float = 0.95
    fp16_peak: float | None = None  # largest value allowed into or out of an fp16 GEMM

    def misses(self, figures: dict[str, Any]) -> list[str]:
        misses = []
        if figures.get("non_finite_tokens"):
            misses.append(f"{figures['non_finite_tokens']} of {figures['tokens']} token embeddings "
                          "hold inf or NaN: the variant graph overflowed")
        by_role = figures.get("fp16_gemm_peak") or {}  # {role: peak}, from convert_fp16
        peak = None if not by_role or None in by_role.values() else max(by_role.values())
        if self.fp16_peak is not None and (peak is None or not peak < self.fp16_peak):
            where = next((figures["fp16_gemm_peak_at"][r] for r, v in by_role.items() if v == peak), None)
            misses.append(
                f"a value entering or leaving an fp16 GEMM reaches {peak} ({where}) on the sample inputs "
                f"(limit {self.fp16_peak:.0f} = fp16's {FP16_MAX:.0f} / {FP16_HEADROOM:.0f}): it "
                "overflows where the GEMMs run in fp16 (DirectML); onnxruntime's CPU provider runs "
                "them in fp32 and cannot show it")
        if not figures["mean_cosine"] >= self.mean_cosine:
            misses.append(f"mean cosine {figures['mean_cosine']:.5f} < {self.mean_cosine}")
        for bucket, row in (figures.get("buckets") or {}).items():
            if not row["mean"] >= self.mean_cosine:
                misses.append(f"{bucket}: mean cosine {row['mean']:.5f} < {self.mean_cosine}")
        if self.min_cosine is not None and not figures["min_cosine"] >= self.min_cosine:
            items = figures.get("items") or {}
            failing = sorted((n for n, row in items.items() if not row["min"] >= self.min_cosine),
                             key=lambda n: items[n]["min"])
            named = ("; below it: " + ", ".join(f"{n} ({items[n]['tokens']} tokens, min "
                                                f"{items[n]['min']:.4f})" for n in failing[:8])
                     if failing else "")
            misses.append(f"min cosine {figures['min_cosine']:.5f} < {self.min_cosine}{named}")
        ranking = figures.get("ranking")
        if ranking is not None and not ranking["top1_agreement"] >= self.top1_agreement:
            misses.append(f"top-1 agreement {ranking['top1_agreement']:.3f} < "
                          f"{self.top1_agreement} on {ranking['queries']} clear-winner queries")
        return misses

    def to_dict(self) -> dict[str, Any]:
        return {"mean_cosine": self.mean_cosine, "min_cosine": self.min_cosine,
                "top1_agreement": self.top1_agreement, "fp16_peak": self.fp16_peak}


@dataclass(frozen=True)
class VariantSpec:
    """Which recipe makes each role's graph, and the gate against fp32."""

    name: str
    recipes: dict[str, str]  # role -> recipe ("int8", "int4", "fp16")
    gate: Gate


# fp16 gate: fp16 keeps 11 significant bits, so honest rounding over a few dozen layers moves a
# token's direction by ~1e-3 relative (cosine 1 - 1e-6 ... 1 - 1e-4). A cosine below 0.999 (mean)
# / 0.99 (any token) means an overflow or a lost small value somewhere.
GATES = {
    "int8": Gate(mean_cosine=0.99, min_cosine=0.95),
    "int4": Gate(mean_cosine=0.98),
    "fp16": Gate(mean_cosine=0.999, min_cosine=0.99, fp16_peak=FP16_SAFE_PEAK),
}

VARIANTS: dict[str, VariantSpec] = {
    "int8": VariantSpec("int8", {"vision": "int8", "text": "int8"}, GATES["int8"]),
    "int4": VariantSpec("int4", {"vision": "int8", "text": "int4"}, GATES["int4"]),
    "fp16": VariantSpec("fp16", {"vision": "fp16", "text": "fp16"}, GATES["fp16"]),
}


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


def quiet_quantisers() -> None:
    # matmul_nbits_quantizer logs one INFO line per node; the dynamic quantiser warns about
    # pre-processing (symbolic shape inference), which does not apply to MatMul-only quantisation.
    for name in ("onnxruntime.quantization.matmul_nbits_quantizer", "root"):
        logging.getLogger(name).setLevel(logging.ERROR)


def weight_matmuls(model: Any) -> list[Any]:
    """The MatMuls with a constant 2-D fp32 weight (what int8 quantises)."""
    from .graph_edits import ONNX_DOMAINS, _const_float

    return [n for n in model.graph if n.op_type == "MatMul" and n.domain in ONNX_DOMAINS
            and _const_float(n.inputs[1]) is not None and _const_float(n.inputs[1]).ndim == 2]


def outlier_channels(profiles: Sequence[Any], ratio: float | None = None,
                     most: int | None = None) -> Any:
    """Input channels whose max |value| exceeds `ratio` x the median channel's, on any one
    calibration item (each item's own profile: a page's image tokens set other channel maxima
    than a query's text tokens), at most `most` (the largest first), sorted."""
    import numpy as np

    depth = profiles[0].shape[0]
    ratio = OUTLIER_RATIO if ratio is None else ratio
    most = max(OUTLIER_MIN_CAP, depth // OUTLIER_CAP_DIVISOR) if most is None else most
    worst = np.zeros(depth)
    for profile in profiles:
        worst = np.maximum(worst, profile / max(float(np.median(profile)), 1e-30))
    found = np.flatnonzero(worst > ratio)
    if found.size > most:
        found = found[np.argsort(worst[found])[::-1][:most]]
    return np.sort(found)


def quantize_int8(src: Path, work: Path | None = None, *,
                  calibration: Sequence[dict[str, Any]] | None = None,
                  scheme: str = INT8_ACTIVATIONS, alpha: float | None = SMOOTHING_ALPHA,
                  weight_levels: int | None = None) -> tuple[Any, dict[str, Any]]:
    """The int8 graph of the fp32 graph at `src` (an onnx_ir Model, weights quantised one at a
    time, quantise.py) and what was decided per MatMul. With `calibration` (sample feeds of the
    fp32 graph): SmoothQuant smoothing and, for the "row" scheme, outlier channels kept fp32."""
    import numpy as np
    import onnx_ir as ir

    from .graph_edits import channel_maxima_per_feed, module_path, smoothing_factors
    from .quantise import WEIGHT_PEAK, quantise_matmuls

    model = ir.load(src)
    matmuls = weight_matmuls(model)
    factors: dict[str, Any] = {}
    outliers: dict[str, Any] = {}
    if calibration:
        inputs = sorted({n.inputs[0].name for n in matmuls})
        per_feed = channel_maxima_per_feed(src, inputs, calibration)
        if alpha is not None:
            factors = smoothing_factors(model, src, calibration, alpha=alpha,
                                        maxima={k: np.max(v, axis=0) for k, v in per_feed.items()})
        if scheme == "row":
            for node in matmuls:
                s = factors.get(node.name)
                profiles = [p if s is None else p / s for p in per_feed[node.inputs[0].name]]
                found = outlier_channels(profiles)
                if found.size:
                    outliers[node.name] = found
    counts = quantise_matmuls(model, {n.name: scheme for n in matmuls}, factors, outliers=outliers,
                              weight_levels=weight_levels or WEIGHT_PEAK)
    paths = {n.name: module_path(n) for n in matmuls}
    return model, {"int8_activations": scheme, "int8_matmuls": counts, "smoothed": len(factors),
                   "fp32_outlier_channels": {paths[k]: len(v) for k, v in outliers.items()}}


def quantize_int4(src: Path, *, block_size: int = INT4_BLOCK_SIZE,
                  accuracy_level: int = INT4_ACCURACY_LEVEL) -> Any:
    """4-bit weight-only MatMulNBits, asymmetric (4 inputs: A, B, scales, zero points)."""
    import onnx
    import onnx_ir as ir
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(str(src))
    quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=block_size, is_symmetric=False,
                                     accuracy_level=accuracy_level, op_types_to_quantize=("MatMul",),
                                     quant_axes=(("MatMul", 0),))
    quantizer.process()
    return ir.from_proto(quantizer.model.model)


def convert_fp16(src: Path, calibration: Sequence[dict[str, Any]] | None, *,
                 safe_peak: float | None = FP16_SAFE_PEAK) -> tuple[Any, dict[str, Any]]:
    """fp16 weights and weight-GEMMs, everything else fp32 (see the module docstring); a GEMM
    whose input or output reaches `safe_peak` on the `calibration` feeds stays fp32 (None: none
    is kept, for tests that show what the gate refuses). Returns (ir.Model, figures): the
    largest value left entering or leaving an fp16 GEMM and the module paths kept fp32."""
    import onnx_ir as ir

    from .graph_edits import fp16_gemm_peaks, half_precision_gemms, module_path

    model = ir.load(src)
    peaks = fp16_gemm_peaks(model, src, calibration or [], keep_scopes=FP16_KEEP_SCOPES)
    kept = {n for n, peak in peaks.items() if safe_peak is not None and not peak < safe_peak}
    paths = {node.name: module_path(node) for node in model.graph if node.name in peaks}
    half_precision_gemms(model, keep_scopes=FP16_KEEP_SCOPES, keep_nodes=kept)
    island = max((n for n in peaks if n not in kept), key=peaks.__getitem__, default=None)
    return model, {"fp16_gemm_peak": peaks[island] if calibration and island else None,
                   "fp16_gemm_peak_at": paths.get(island),
                   "fp16_kept_fp32": sorted(paths[n] for n in kept)}


def make_graph(recipe: str, src: Path, work: Path,
               calibration: Sequence[dict[str, Any]] | None) -> tuple[Any, dict[str, Any]]:
    """The variant graph of one role as an onnx_ir Model (not yet sorted nor saved), and what the
    recipe measured on the way (recorded with the variant's check, read by its gate)."""
    if recipe == "int8":
        return quantize_int8(src, work, calibration=calibration)
    if recipe == "int4":
        return quantize_int4(src), {}
    if recipe == "fp16":
        return convert_fp16(src, calibration)
    raise ExportError(f"unknown recipe {recipe!r}")


# Recipes that read the fp32 graph's activations on sample inputs.
CALIBRATED_RECIPES = ("int8", "fp16")
