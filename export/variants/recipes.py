"""What each reduced-precision variant is: the recipe per graph role and the gate against fp32.

| variant | vision graph                               | text graph                                        |
|---------|--------------------------------------------|---------------------------------------------------|
| int8    | int8 weights (7-bit, per column),          | the same, after SmoothQuant smoothing of the      |
|         | one activation scale per token; one code   | norms' outputs                                    |
|         | per weight, two when the gate refuses one  |                                                   |
| int4    | the one-code int8 vision graph (same file) | MatMulNBits weight-only, accuracy level 4: the    |
|         |                                            | MLP 4-bit (blocks of 16), the attention's q/k/v/o |
|         |                                            | 8-bit (blocks of 128), the final projection and   |
|         |                                            | the token-embedding table fp32                    |
| fp16    | fp16 weights and weight-GEMMs, fp32 rest   | fp16 weights and weight-GEMMs, fp32 rest          |
| openvino| fp32 in OpenVINO's form (openvino_form.py; | the same: GroupQueryAttention decomposed          |
|         | per-token rotary position ids)             |                                                   |
| openvino-bf16 | the openvino files, compiled at bf16 inference precision by OpenVINO        |         |
| openvino-int8 | the openvino form with NNCF INT8_ASYM weights (per output channel)          |         |

Why these choices (the figures, with their result notes, are in docs/variants.md):

- int8 (quantise.py writes it, weight by weight): int8 weights symmetric per output column, and
  each MatMul's activation quantised with one scale per token, not one per tensor: a per-tensor
  scale is set by the largest value anywhere in the run (padding and neighbours included), so a
  token's precision would depend on its batch ("int8: one activation scale per token"). Input
  channels past OUTLIER_RATIO x their median are computed in fp32 beside the int8 product
  (LLM.int8()'s decomposition), judged per item; SmoothQuant (alpha 0.5) folds range from the
  norms' outputs into the weights first. Weights use 7 bits: u8 x s8 kernels on AVX2 without VNNI
  saturate 16-bit pair sums with 8-bit weights (benchmarks/results/experiments/variants-int8-bits.md).
  Error compounds over depth, so the variant is the fastest recipe that holds
  (`recipe_attempts`): one code per weight ("int8"), then two ("int8x2", its `fallback`) when the
  gate refuses one, gated again against the same fp32 run ("int8: the fastest recipe that holds").
  An attention whose calibration scores spread past sharp_scores.SHARP_SCORE_SPREAD logits keeps
  every MatMul its scores depend on fp32 (its q/k, the layers before it), and the vision graph
  (the fp32 file itself) when it is that sharp on pages: int8's score error there flips which
  key wins (sharp_scores.py says why).
- int4 is for the language model, where query work is memory-bound; the vision tower is
  compute-bound, so the int4 variant reuses the int8 vision graph file. Its text graph is
  MatMulNBits (asymmetric blocks along K, accuracy level 4) with bits per MatMul role
  (INT4_ROLE_BITS): the attention's projections cost ~3x the MLP's error per weight, so they are
  8-bit, the MLP 4-bit, the final projection fp32 ("int4: the MLP 4-bit, the attention 8-bit,
  the projection fp32"; benchmarks/results/variants/variants-int4-recipes-4b-2+2-b.md).
- fp16 targets DirectML: fp16 weights and weight-GEMMs; norms, softmax, activations, residual
  adds, rotary tables, attention scores and the final projection + L2 normalisation stay fp32,
  one Cast into and one out of each GEMM group, no value rounding through fp16 between two fp32
  ops. A GEMM whose input or output comes near 65504 (the fp16 maximum) on the sample inputs
  stays fp32. onnxruntime's CPU provider runs fp16 MatMuls in fp32, so a cosine gate on CPU
  cannot see an fp16 overflow: the gate checks the measured peak at every fp16 GEMM
  (`Gate.fp16_peak`) and any inf/NaN.

Gates: per-token cosine between the variant's and fp32's embeddings (mean and min over all tokens)
and top-1 agreement on a ranking set built so that fp32 has clear winners (variants/gates.py); no
inf/NaN anywhere; for fp16, the peak at its GEMMs.
This module imports nothing heavy; the recipes import onnx / onnxruntime when called.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from colembed.errors import ExportError
from colembed.fidelity import describe_token
from colembed.layout import BASE_VARIANT

# Signed int8 weights: u8 activations x s8 weights is the VNNI fast path on x86 (benchmarks/
# README.md, "int8 weight type"); QUInt8 weights run the slower u8u8 kernels.
INT8_WEIGHT_TYPE = "QInt8"
# SmoothQuant migration strength: 0.5 splits the range evenly between activations and weights
# (the paper's default for OPT/LLaMA-class models).
SMOOTHING_ALPHA = 0.5
# Activation scales of the int8 MatMuls: "row" (one per token) or "tensor" (onnxruntime's
# dynamic quantisation, one per tensor and batch); see quantise.py and the module docstring.
INT8_ACTIVATIONS = "row"
# The vision attention's QK^T and PV as integer products, one head at a time
# (int8_attention.py). Off: on the VNNI EPYC one attention ran 1.57x faster than fp32
# MultiHeadAttention on a quiet machine but at par under load, at a per-token min cosine of
# 0.9990 (0.998 on sharper attention; results/experiments/attention-int8.md), and no end-to-end A/B nor gate
# at depth has said yes yet. On: the int8 vision graph carries it, the fp32 graph never does.
INT8_VISION_ATTENTION = False
# An input channel whose max |value| on a calibration item exceeds OUTLIER_RATIO x that item's
# median channel is computed in fp32 beside the int8 product, at most max(OUTLIER_MIN_CAP,
# width / OUTLIER_CAP_DIVISOR) channels per MatMul (the largest).
OUTLIER_RATIO = 8.0
OUTLIER_MIN_CAP = 4
OUTLIER_CAP_DIVISOR = 64
# The 4-bit blocks: 16 (MatMulNBits' smallest) with the token-embedding table left fp32: on the
# Qwen2-VL-2B-width 2+2-layer model, every MatMul 4-bit, the mean/min per-token cosine to fp32 was
# 0.9814/0.920 with block 32 + 4-bit embeddings, 0.9835/0.940 with fp32 embeddings, 0.9855/0.944
# with block 16. Which MatMuls are 4-bit: INT4_ROLE_BITS below (the module docstring).
INT4_BLOCK_SIZE = 16
INT4_ACCURACY_LEVEL = 4  # int8 activations in the MatMulNBits kernel (VNNI), weights 4-bit
INT4_SYMMETRIC = False  # asymmetric blocks: a scale and a zero point per block
INT4_DEFAULT_BITS = 4
# (module-path fragment, bits) per MatMul role, the first fragment found wins; 8: MatMulNBits
# 8-bit blocks; 32: left fp32; any other MatMul INT4_DEFAULT_BITS. The final 320-dim projection
# (0.8M weights, straight into the L2 normalisation) stays fp32; the attention projections
# (q, k, v, o: a quarter of a layer's weights, half its 4-bit error) are 8-bit; the MLP 4-bit
# (the module docstring's measurements). DirectML runs it: its MatMulNBits kernel takes 4- and
# 8-bit blocks alike (export/graphs/data/directml_kernels.json, node_rules; tests/export/graphs/test_directml.py).
INT4_ROLE_BITS: tuple[tuple[str, int], ...] = (("projection", 32), ("self_attn", 8))
# Block size of the 8-bit roles: 8.3 bits a weight with the scales (blocks of 16: 10.5); on the
# 4B-width 2+2 model the same fidelity as blocks of 16 (worst bucket 0.98826 against 0.98840).
INT4_BLOCK_SIZE_8BIT = 128
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
            misses.append(
                f"{figures['non_finite_tokens']} of {figures['tokens']} token embeddings "
                "hold inf or NaN: the variant graph overflowed"
            )
        by_role = figures.get("fp16_gemm_peak") or {}  # {role: peak}, from convert_fp16
        peak = None if not by_role or None in by_role.values() else max(by_role.values())
        if self.fp16_peak is not None and (peak is None or not peak < self.fp16_peak):
            where = next(
                (figures["fp16_gemm_peak_at"][r] for r, v in by_role.items() if v == peak), None
            )
            misses.append(
                f"a value entering or leaving an fp16 GEMM reaches {peak} ({where}) on the sample inputs "
                f"(limit {self.fp16_peak:.0f} = fp16's {FP16_MAX:.0f} / {FP16_HEADROOM:.0f}): it "
                "overflows where the GEMMs run in fp16 (DirectML); onnxruntime's CPU provider runs "
                "them in fp32 and cannot show it"
            )
        if not figures["mean_cosine"] >= self.mean_cosine:
            misses.append(f"mean cosine {figures['mean_cosine']:.5f} < {self.mean_cosine}")
        for bucket, row in (figures.get("buckets") or {}).items():
            if not row["mean"] >= self.mean_cosine:
                misses.append(f"{bucket}: mean cosine {row['mean']:.5f} < {self.mean_cosine}")
        for kind, row in (figures.get("token_classes") or {}).items():
            low_mean = not row["mean"] >= self.mean_cosine
            low_min = self.min_cosine is not None and not row["min"] >= self.min_cosine
            if low_mean or low_min:
                what = (
                    f"mean cosine {row['mean']:.5f} < {self.mean_cosine}"
                    if low_mean
                    else f"min cosine {row['min']:.5f} < {self.min_cosine}"
                )
                misses.append(
                    f"query tokens of class {kind!r} ({row['tokens']} tokens): {what}; "
                    f"worst {describe_token(row['worst'])}"
                )
        if self.min_cosine is not None and not figures["min_cosine"] >= self.min_cosine:
            items = figures.get("items") or {}
            failing = sorted(
                (n for n, row in items.items() if not row["min"] >= self.min_cosine),
                key=lambda n: items[n]["min"],
            )
            named = (
                "; below it: "
                + ", ".join(
                    f"{n} ({items[n]['tokens']} tokens, min {items[n]['min']:.4f})"
                    for n in failing[:8]
                )
                if failing
                else ""
            )
            token = (
                f"; worst query {describe_token(figures['worst_token'])}"
                if figures.get("worst_token")
                else ""
            )
            misses.append(
                f"min cosine {figures['min_cosine']:.5f} < {self.min_cosine}{named}{token}"
            )
        ranking = figures.get("ranking")
        if ranking is not None and not ranking["top1_agreement"] >= self.top1_agreement:
            misses.append(
                f"top-1 agreement {ranking['top1_agreement']:.3f} < "
                f"{self.top1_agreement} on {ranking['queries']} clear-winner queries"
            )
        return misses

    def to_dict(self) -> dict[str, Any]:
        return {
            "mean_cosine": self.mean_cosine,
            "min_cosine": self.min_cosine,
            "top1_agreement": self.top1_agreement,
            "fp16_peak": self.fp16_peak,
        }


@dataclass(frozen=True)
class VariantSpec:
    """Which recipe makes each role's graph, and the gate against fp32; `fallback`: the recipes
    tried when the gate refuses `recipes` (slower, closer to fp32), None: none."""

    name: str
    recipes: dict[str, str]  # role -> recipe ("int8", "int8x2", "int4", "fp16", "openvino", ...)
    gate: Gate
    fallback: dict[str, str] | None = None


# fp16 gate: fp16 keeps 11 significant bits, so honest rounding over a few dozen layers moves a
# token's direction by ~1e-3 relative (cosine 1 - 1e-6 ... 1 - 1e-4). A cosine below 0.999 (mean)
# / 0.99 (any token) means an overflow or a lost small value somewhere.
# The OpenVINO variants are judged as OpenVINO runs them (gates.gate_model). "openvino" is
# the fp32 graphs in the form OpenVINO computes exactly (openvino_form.py), at f32 inference
# precision: f32 rounding only (the parity bound, 1e-4 per unit vector, is a cosine above
# 1 - 5e-9), so anything below 0.9999 is a different computation. bf16 keeps 8 significant bits,
# int8 weights (NNCF INT8_ASYM, per output channel) ~the int8 variant's error: their gates are
# int8's.
GATES = {
    "int8": Gate(mean_cosine=0.99, min_cosine=0.95),
    "int4": Gate(mean_cosine=0.98),
    "fp16": Gate(mean_cosine=0.999, min_cosine=0.99, fp16_peak=FP16_SAFE_PEAK),
    "openvino": Gate(mean_cosine=0.99999, min_cosine=0.9999, top1_agreement=1.0),
    "openvino-bf16": Gate(mean_cosine=0.99, min_cosine=0.95),
    "openvino-int8": Gate(mean_cosine=0.99, min_cosine=0.95),
}

# The int8 recipes by the int8 codes each weight gets (quantise.quantise_matmuls' weight_passes):
# one code ("int8"), or two, the second for what the first left ("int8x2": ~13-bit weights, twice
# the integer products; 1.64x one code's page time, 1.89x its query time at 2B widths, 8 + 7
# layers: benchmarks/results/experiments/variants-speed-ab-passes.md). The recipe names the graph files
# (`{role}.{recipe}.onnx`) and is recorded with the variant's check, so which one a folder holds
# is part of what the manifest (and an index's identity, its manifest hash) says.
INT8_RECIPES = {"int8": 1, "int8x2": 2}

VARIANTS: dict[str, VariantSpec] = {
    "int8": VariantSpec(
        "int8",
        {"vision": "int8", "text": "int8"},
        GATES["int8"],
        fallback={"vision": "int8x2", "text": "int8x2"},
    ),
    "int4": VariantSpec("int4", {"vision": "int8", "text": "int4"}, GATES["int4"]),
    "fp16": VariantSpec("fp16", {"vision": "fp16", "text": "fp16"}, GATES["fp16"]),
    # OpenVINO's (colembed.sessions.OPENVINO_VARIANTS: the precision each is compiled with).
    # openvino-bf16 runs the openvino graph files (written once) at bf16 inference precision.
    "openvino": VariantSpec(
        "openvino", {"vision": "openvino", "text": "openvino"}, GATES["openvino"]
    ),
    "openvino-bf16": VariantSpec(
        "openvino-bf16", {"vision": "openvino", "text": "openvino"}, GATES["openvino-bf16"]
    ),
    "openvino-int8": VariantSpec(
        "openvino-int8",
        {"vision": "openvino-int8", "text": "openvino-int8"},
        GATES["openvino-int8"],
    ),
}


def parse_variants(variants: Sequence[str] | str) -> list[str]:
    """Normalise "int8,int4" / ["int8", "int4"] to a de-duplicated list; unknown names raise."""
    if isinstance(variants, str):
        variants = variants.split(",")
    names: list[str] = []
    for raw in variants:
        name = raw.strip().lower()
        if not name or name == BASE_VARIANT:
            continue
        if name not in VARIANTS:
            raise ExportError(
                f"unknown variant {raw!r}; known: {sorted(VARIANTS)} (fp32 is always written)"
            )
        if name not in names:
            names.append(name)
    return names


def int8_recipe(weight_passes: int) -> str:
    """The int8 recipe writing `weight_passes` codes per weight (INT8_RECIPES); others refused."""
    for recipe, passes in INT8_RECIPES.items():
        if passes == weight_passes:
            return recipe
    raise ExportError(
        f"int8 weight passes must be one of {sorted(INT8_RECIPES.values())}, not {weight_passes!r}"
    )


def recipe_attempts(name: str, int8_weight_passes: int | None = None) -> list[dict[str, str]]:
    """The recipe sets (role -> recipe) the exporter tries for variant `name`, in order: the
    first whose graphs pass the gate is written. By default the variant's recipes, then its
    `fallback` (int8: one code per weight, then two: the fastest recipe that holds).
    `int8_weight_passes` forces one recipe: every int8 recipe with that many codes per weight,
    no fallback (`colembed export --int8-weight-passes N`)."""
    spec = VARIANTS[name]
    if int8_weight_passes is not None:
        forced = int8_recipe(int8_weight_passes)
        return [
            {
                role: forced if recipe in INT8_RECIPES else recipe
                for role, recipe in spec.recipes.items()
            }
        ]
    return [dict(spec.recipes)] + ([dict(spec.fallback)] if spec.fallback else [])


def weight_passes_of(recipes: dict[str, str]) -> int | None:
    """Codes per weight of the int8 graphs of a recipe set (None: it has none); one value, as
    `recipe_attempts` never mixes them."""
    found = {INT8_RECIPES[r] for r in recipes.values() if r in INT8_RECIPES}
    return max(found) if found else None


NUMBERS = {2: "two"}


def recipe_label(recipes: dict[str, str]) -> str:
    """How the export's output names a recipe set: "one int8 code per weight" / "two ..."."""
    passes = weight_passes_of(recipes)
    if passes is None:
        return "recipes " + ", ".join(f"{role} {r}" for role, r in recipes.items())
    return (
        "one int8 code per weight"
        if passes == 1
        else f"{NUMBERS.get(passes, passes)} int8 codes per weight"
    )


def quiet_quantisers() -> None:
    # matmul_nbits_quantizer logs one INFO line per node; the dynamic quantiser warns about
    # pre-processing (symbolic shape inference), which does not apply to MatMul-only quantisation.
    for name in ("onnxruntime.quantization.matmul_nbits_quantizer", "root"):
        logging.getLogger(name).setLevel(logging.ERROR)


def weight_matmuls(model: Any) -> list[Any]:
    """The MatMuls with a constant 2-D fp32 weight (what int8 quantises)."""
    from ..graphs.edits import ONNX_DOMAINS, _const_float

    return [
        n
        for n in model.graph
        if n.op_type == "MatMul"
        and n.domain in ONNX_DOMAINS
        and _const_float(n.inputs[1]) is not None
        and _const_float(n.inputs[1]).ndim == 2
    ]


def outlier_channels(
    profiles: Sequence[Any], ratio: float | None = None, most: int | None = None
) -> Any:
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


def row_calibration(
    model: Any,
    src: Path,
    matmuls: Sequence[Any],
    calibration: Sequence[dict[str, Any]],
    per_feed: dict[str, list[Any]],
    *,
    alpha: float | None = SMOOTHING_ALPHA,
    outliers: bool = True,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the calibration feeds decide for the int8 `matmuls` of `model` (read from `src`):
    SmoothQuant's factors {MatMul name: s} (`smoothing_factors`: the norms before them divided by
    s in place; none when `alpha` is None) and, with `outliers`, the input channels each MatMul
    keeps fp32 (`outlier_channels` of its input's smoothed profiles; only MatMuls that have any).
    `per_feed`: `channel_maxima_per_feed` of the MatMuls' inputs on `calibration`."""
    import numpy as np

    from ..graphs.edits import smoothing_factors

    factors: dict[str, Any] = {}
    if alpha is not None:
        maxima = {k: np.max(v, axis=0) for k, v in per_feed.items()}
        factors = smoothing_factors(model, src, calibration, alpha=alpha, maxima=maxima)
    kept: dict[str, Any] = {}
    for node in matmuls if outliers else ():
        s = factors.get(node.name)
        found = outlier_channels([p if s is None else p / s for p in per_feed[node.inputs[0].name]])
        if found.size:
            kept[node.name] = found
    return factors, kept


def quantize_int8(
    src: Path,
    work: Path | None = None,
    *,
    calibration: Sequence[dict[str, Any]] | None = None,
    scheme: str = INT8_ACTIVATIONS,
    alpha: float | None = SMOOTHING_ALPHA,
    weight_levels: int | None = None,
    activation_levels: int | None = None,
    weight_passes: int = 1,
    attention: bool | None = None,
    keep: Sequence[str] = (),
    sharp: Sequence[Any] = (),
) -> tuple[Any, dict[str, Any]]:
    """The int8 graph of the fp32 graph at `src` (an onnx_ir Model, weights quantised one at a
    time, quantise.py) and what was decided per MatMul. With `calibration` (sample feeds of the
    fp32 graph): SmoothQuant smoothing and, for the "row" scheme, outlier channels kept fp32.
    `weight_levels` / `activation_levels` default to quantise.WEIGHT_PEAK / ACTIVATION_PEAK,
    read when called (benchmarks/variants/fidelity.py --int8-levels measures other pairs).
    `weight_passes`: int8 codes per weight (1 or 2: INT8_RECIPES). `attention` (default INT8_VISION_ATTENTION, read when called): the vision attention's
    products in int8 (int8_attention.py). `keep`: module-path fragments whose MatMuls stay fp32
    (their weights still take the smoothing factors; measurements' arms). `sharp`: the graph's
    sharp attentions (sharp_scores.sharp_attentions): every MatMul their scores depend on stays
    fp32 (sharp_scores.score_feeders)."""
    import onnx_ir as ir

    from .gemm_as_matmul import gemms_as_matmuls
    from ..graphs.edits import channel_maxima_per_feed, module_path
    from . import quantise
    from .sharp_scores import score_feeders

    model = ir.load(src)
    gemms_as_matmuls(model)  # the vision merger's Linears come out as Gemm: int8 them too
    attentions = 0
    if INT8_VISION_ATTENTION if attention is None else attention:
        from .int8_attention import int8_attentions

        attentions = int8_attentions(model)  # the vision tower's MultiHeadAttention nodes
    matmuls = weight_matmuls(model)
    factors: dict[str, Any] = {}
    outliers: dict[str, Any] = {}
    if calibration:
        inputs = sorted({n.inputs[0].name for n in matmuls})
        per_feed = channel_maxima_per_feed(src, inputs, calibration)
        factors, outliers = row_calibration(
            model, src, matmuls, calibration, per_feed, alpha=alpha, outliers=scheme == "row"
        )
    spreads = {a.path: a for a in sharp}
    feeders = score_feeders(model, list(spreads), matmuls) if sharp else {}
    schemes = {
        n.name: BASE_VARIANT
        if any(k in module_path(n) for k in keep) or module_path(n) in feeders
        else scheme
        for n in matmuls
    }
    levels = {
        "weights": weight_levels or quantise.WEIGHT_PEAK,
        "activations": activation_levels or quantise.ACTIVATION_PEAK,
    }
    counts = quantise.quantise_matmuls(
        model,
        schemes,
        factors,
        outliers=outliers,
        weight_levels=levels["weights"],
        activation_levels=levels["activations"],
        weight_passes=weight_passes,
    )
    paths = {n.name: module_path(n) for n in matmuls}
    return model, {
        "int8_activations": scheme,
        "int8_code_peaks": levels,
        "int8_matmuls": counts,
        "int8_attentions": attentions,
        "smoothed": len(factors),
        "fp32_outlier_channels": {paths[k]: len(v) for k, v in outliers.items()},
        "int8_kept_fp32": {
            path: f"feeds {att}, whose scores spread {spreads[att].spread:.0f} logits "
            f"(> {spreads[att].limit:.0f}) on the calibration feeds"
            for path, att in sorted(feeders.items())
        },
        **(
            {
                "fp32_matmuls": sorted(
                    paths[n.name] for n in matmuls if schemes[n.name] == BASE_VARIANT
                )
            }
            if keep
            else {}
        ),
    }


def int4_bits(path: str, role_bits: Sequence[tuple[str, int]] = ()) -> int:
    """The bits of the MatMul at module `path` under `role_bits` ((fragment, bits) pairs, the
    first fragment found in the path wins; none: INT4_DEFAULT_BITS). 32: left an fp32 MatMul."""
    return next((bits for fragment, bits in role_bits if fragment in path), INT4_DEFAULT_BITS)


def quantize_int4(
    src: Path,
    *,
    block_size: int = INT4_BLOCK_SIZE,
    accuracy_level: int = INT4_ACCURACY_LEVEL,
    symmetric: bool = INT4_SYMMETRIC,
    role_bits: Sequence[tuple[str, int]] = INT4_ROLE_BITS,
    block_size_8bit: int = INT4_BLOCK_SIZE_8BIT,
) -> Any:
    """MatMulNBits weight-only blocks (4 or 8 bits per MatMul by `role_bits`, or left fp32), every
    MatMul with a constant 2-D weight; written weight by weight from the memory-mapped fp32 graph
    (quantise.quantise_int4_matmuls) by onnxruntime's own block quantiser. The defaults are the
    recipe (the module docstring says why); benchmarks/variants/fidelity.py --int4 and
    variants_int4_recipes.py measure others."""
    import onnx_ir as ir

    from ..graphs.edits import module_path
    from .quantise import quantise_int4_matmuls

    model = ir.load(src)
    groups: dict[int, list[Any]] = {}
    for node in weight_matmuls(model):
        groups.setdefault(int4_bits(module_path(node), role_bits), []).append(node)
    unknown = sorted(set(groups) - {4, 8, 32})
    if unknown:
        raise ExportError(
            f"int4 recipe: bits {unknown} in role_bits {list(role_bits)}; "
            "known: 4, 8 (MatMulNBits) and 32 (fp32)"
        )
    for bits, block in ((4, block_size), (8, block_size_8bit)):
        by_block: dict[int, list[Any]] = {}
        for node in groups.get(bits, []):
            depth = node.inputs[1].shape[0]
            by_block.setdefault(fitting_block(int(depth), block), []).append(node)
        for fitted, nodes in sorted(by_block.items()):
            quantise_int4_matmuls(
                model,
                nodes,
                block_size=fitted,
                accuracy_level=accuracy_level,
                bits=bits,
                symmetric=symmetric,
            )
    return model


def fitting_block(depth: int, block: int, smallest: int = 16) -> int:
    """`block` halved until it divides the weight's depth K (not below `smallest`, MatMulNBits'
    smallest block): a padded last block is a form DirectML's kernel refuses (it takes whole
    blocks only, directml_kernels.json node_rules), and no real width needs one (Qwen widths are
    multiples of 128); narrow test widths do."""
    while depth % block and block > smallest:
        block //= 2
    return block


def convert_fp16(
    src: Path,
    calibration: Sequence[dict[str, Any]] | None,
    *,
    safe_peak: float | None = FP16_SAFE_PEAK,
) -> tuple[Any, dict[str, Any]]:
    """fp16 weights and weight-GEMMs, everything else fp32 (see the module docstring); a GEMM
    whose input or output reaches `safe_peak` on the `calibration` feeds stays fp32 (None: none
    is kept, for tests that show what the gate refuses). Returns (ir.Model, figures): the
    largest value left entering or leaving an fp16 GEMM and the module paths kept fp32."""
    import onnx_ir as ir

    from ..graphs.edits import fp16_gemm_peaks, half_precision_gemms, module_path

    model = ir.load(src)
    peaks = fp16_gemm_peaks(model, src, calibration or [], keep_scopes=FP16_KEEP_SCOPES)
    kept = {n for n, peak in peaks.items() if safe_peak is not None and not peak < safe_peak}
    paths = {node.name: module_path(node) for node in model.graph if node.name in peaks}
    half_precision_gemms(model, keep_scopes=FP16_KEEP_SCOPES, keep_nodes=kept)
    island = max((n for n in peaks if n not in kept), key=peaks.__getitem__, default=None)
    return model, {
        "fp16_gemm_peak": peaks[island] if calibration and island else None,
        "fp16_gemm_peak_at": paths.get(island),
        "fp16_kept_fp32": sorted(paths[n] for n in kept),
    }


def make_graph(
    recipe: str,
    src: Path,
    work: Path,
    calibration: Sequence[dict[str, Any]] | None,
    sharp: Sequence[Any] = (),
) -> tuple[Any, dict[str, Any]]:
    """The variant graph of one role as an onnx_ir Model (not yet sorted nor saved), and what the
    recipe measured on the way (recorded with the variant's check, read by its gate). `sharp`:
    the graph's sharp attentions, which the int8 recipes keep fp32 (sharp_scores.py)."""
    if recipe in INT8_RECIPES:
        return quantize_int8(
            src,
            work,
            calibration=calibration,
            weight_passes=INT8_RECIPES[recipe],
            sharp=sharp,
        )
    if recipe == "int4":
        return quantize_int4(src), {}
    if recipe == "fp16":
        return convert_fp16(src, calibration)
    if recipe == "openvino":
        from ..graphs.openvino_form import openvino_graph

        return openvino_graph(src)
    if recipe == "openvino-int8":
        from ..graphs.openvino_form import openvino_int8_graph

        return openvino_int8_graph(src, work)
    raise ExportError(f"unknown recipe {recipe!r}")


# Recipes that read the fp32 graph's activations on sample inputs.
CALIBRATED_RECIPES = (*INT8_RECIPES, "fp16")
# Recipes writing OpenVINO's form (openvino_form.py): their graphs are checked against
# data/openvino_ops.json when written.
OPENVINO_RECIPES = ("openvino", "openvino-int8")
