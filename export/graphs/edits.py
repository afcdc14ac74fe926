"""Edits on variant graphs (onnx_ir models): fp16 GEMM islands, outlier smoothing, finishing.

- `half_precision_gemms`: the fp16 recipe. Each MatMul / Gemm with a constant fp32 weight gets an fp16
  copy of the weight and runs in fp16 between one Cast in (shared by the MatMuls that read the
  same activation) and one Cast out; constant Gathers (the token-embedding table) read an fp16
  table and Cast out. Everything else stays fp32, so no value goes fp32 -> fp16 -> fp32 between
  two fp32 ops (`round_trip_casts` counts those; onnxruntime does not remove them).
- `fp16_gemm_peaks`: the largest value entering or leaving each GEMM the fp16 recipe would
  convert, measured on the fp32 graph; the recipe keeps those near fp16's range in fp32.
- `smooth_activation_outliers`: SmoothQuant's export-time smoothing for the int8 recipe.
- `fusable_rms_norms`: RMSNorm written as onnxruntime's CPU optimiser fuses it (one
  SimplifiedLayerNormalization kernel instead of seven); the exporter applies it to every graph.
- `finish`: onnx_ir's stable topological sort (the converters append nodes) and the one
  `Reshape(allowzero)` cleaner (`reshape_allowzero.py`), before saving.
- `spilled_initializers`: inside it, each initializer `add_initializer` makes (a quantised or
  fp16 weight) goes to a scratch file as soon as it is made and is read back one at a time when
  the graph is saved, so a variant's new weights never accumulate in memory: the writer holds
  the graph and one weight, whatever the model's size.
This module imports onnx_ir and numpy; onnxruntime only for calibration.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from colembed.errors import ExportError

from .reshape_allowzero import clear_reshape_allowzero

ONNX_DOMAINS = ("", "ai.onnx")
SCOPE_KEY = "pkg.torch.onnx.name_scopes"
SMOOTHING_BOUNDS = (1e-4, 1e4)  # never scale a channel by more than this either way
WEIGHT_SLOTS = {"MatMul": 1, "Gemm": 1, "Gather": 0}  # op -> input holding the constant weight


def finish(model: Any) -> int:
    """Sort the graph (stable, subgraphs too) and clear Reshape allowzero; returns the count."""
    try:
        model.graph.sort()
    except ValueError as e:
        raise ExportError(f"variant graph has a cycle; cannot sort it: {e}") from e
    return clear_reshape_allowzero(model)


def scopes(node: Any) -> list[str]:
    """The torch module path of a node, outermost first (empty when the exporter left none)."""
    raw = node.metadata_props.get(SCOPE_KEY)
    if not raw:
        return []
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return []
    return [str(v) for v in value] if isinstance(value, list) else []


def module_path(node: Any) -> str:
    """The torch module a node came from (its innermost scope but the op's own), else its name."""
    found = scopes(node)
    return (found[-2] or found[-1]) if len(found) > 1 else node.name


def release(value: Any) -> None:
    """Drop a lazily loaded initializer's memory map (its pages leave RSS)."""
    tensor = value.const_value
    if tensor is not None and hasattr(tensor, "release"):
        tensor.release()


def _const_float(value: Any) -> np.ndarray | None:
    """The array of a constant fp32 input (initializer), else None."""
    import onnx_ir as ir

    if value is None or value.const_value is None or value.dtype != ir.DataType.FLOAT:
        return None
    return value.const_value.numpy()


# (scratch file, smallest array spilled) while `spilled_initializers` is active
_SPILL: contextvars.ContextVar[tuple[Path, int] | None] = contextvars.ContextVar(
    "colembed_spill", default=None
)
SPILL_BYTES = 1 << 20  # smaller arrays (scales, biases, zero points) stay in memory


@contextlib.contextmanager
def spilled_initializers(scratch: Path, min_bytes: int = SPILL_BYTES) -> Iterator[Path]:
    """Within: `add_initializer` writes each array of `min_bytes` or more to the file `scratch`
    at once and registers a lazy read of it (onnx_ir's `LazyTensor`, evaluated when the graph is
    saved and dropped once written). The file is removed on exit: save the graph inside."""
    scratch = Path(scratch)
    scratch.write_bytes(b"")
    token = _SPILL.set((scratch, min_bytes))
    try:
        yield scratch
    finally:
        _SPILL.reset(token)
        scratch.unlink(missing_ok=True)


def _spilled(array: np.ndarray, name: str, scratch: Path) -> Any:
    """`array` appended to `scratch`, as a lazy tensor reading it back."""
    import onnx_ir as ir

    array = np.asarray(array, order="C")  # (ascontiguousarray would make a 0-d array 1-d)
    dtype, shape = array.dtype, array.shape
    with open(scratch, "ab") as f:
        offset = f.tell()
        array.tofile(f)

    def read():
        data = np.fromfile(scratch, dtype=dtype, count=array_size, offset=offset)
        return ir.tensor(data.reshape(shape), name=name)

    array_size = int(array.size)
    return ir.LazyTensor(
        read, dtype=ir.DataType.from_numpy(dtype), shape=ir.Shape(shape), name=name
    )


def add_initializer(graph: Any, name: str, array: np.ndarray) -> Any:
    """Register `array` as the graph initializer `name` (dtype and shape its own); return it.
    Inside `spilled_initializers` a large one is written to the scratch file and read lazily."""
    import onnx_ir as ir

    spill = _SPILL.get()
    if spill is not None and array.nbytes >= spill[1]:
        const = _spilled(array, name, spill[0])
    else:
        const = ir.tensor(array, name=name)
    value = ir.Value(
        name=name,
        shape=ir.Shape(array.shape),
        type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
        const_value=const,
    )
    graph.register_initializer(value)
    return value


def _cast(value: Any, to: Any, name: str) -> Any:
    import onnx_ir as ir

    node = ir.node("Cast", [value], attributes={"to": to}, name=name)
    node.outputs[0].name = name + "_out"
    node.outputs[0].type = ir.TensorType(to)
    return node


def _swap_in(graph: Any, old: Any, new_nodes: Sequence[Any]) -> None:
    """Put `new_nodes` where `old` was; the last one's output replaces `old`'s."""
    import onnx_ir as ir

    graph.insert_after(old, new_nodes)
    replacement = new_nodes[-1].outputs[0]
    for i, output in enumerate(graph.outputs):  # first: onnx_ir refuses to rewire a graph output
        if output is old.outputs[0]:
            graph.outputs[i] = replacement
            name = output.name
            output.name = f"{name}_replaced"
            replacement.name = name
    ir.convenience.replace_all_uses_with(old.outputs[0], replacement)
    graph.remove(old, safe=True)


def fp16_candidates(model: Any, keep_scopes: Iterable[str] = ()) -> list[tuple[Any, int]]:
    """(node, weight slot) of every node the fp16 recipe would run on fp16 weights: MatMul / Gemm
    / Gather with a constant fp32 weight, outside `keep_scopes` (module-path fragments)."""
    keep = tuple(keep_scopes)
    found = []
    for node in model.graph:
        weight_slot = WEIGHT_SLOTS.get(node.op_type)
        if weight_slot is None or node.domain not in ONNX_DOMAINS:
            continue
        if _const_float(node.inputs[weight_slot]) is None:
            continue
        if not any(k in s for s in scopes(node) for k in keep):
            found.append((node, weight_slot))
    return found


def half_precision_gemms(
    model: Any, keep_scopes: Iterable[str] = (), keep_nodes: Iterable[str] = ()
) -> int:
    """The fp16 recipe (module docstring). Returns how many nodes now run on fp16 weights.
    `keep_nodes` (node names) stay fp32 as well, e.g. those `fp16_overflow_risks` found."""
    import onnx_ir as ir
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    graph, f16, f32 = model.graph, ir.DataType.FLOAT16, ir.DataType.FLOAT
    kept = set(keep_nodes)
    half_weights: dict[int, Any] = {}
    half_inputs: dict[int, Any] = {}
    converted = 0
    for node, weight_slot in fp16_candidates(model, keep_scopes):
        if node.name in kept:
            continue
        weight = node.inputs[weight_slot]
        array = _const_float(weight)
        if id(weight) not in half_weights:
            half_weights[id(weight)] = add_initializer(
                graph, f"{weight.name}_fp16", array.astype(np.float16)
            )
            del array
            if len(weight.uses()) == 1:  # streamed: the fp32 pages leave RSS weight by weight
                release(weight)
        inputs = list(node.inputs)
        inputs[weight_slot] = half_weights[id(weight)]
        if node.op_type == "Gemm" and len(inputs) > 2 and inputs[2] is not None:
            bias = _const_float(inputs[2])
            if bias is None:
                continue
            inputs[2] = add_initializer(graph, f"{inputs[2].name}_fp16", bias.astype(np.float16))
        new: list[Any] = []
        if node.op_type in ("MatMul", "Gemm"):
            activation = inputs[0]
            if id(activation) not in half_inputs:
                cast_in = _cast(activation, f16, f"{node.name}_to_fp16")
                new.append(cast_in)
                half_inputs[id(activation)] = cast_in.outputs[0]
            inputs[0] = half_inputs[id(activation)]
        half = ir.node(node.op_type, inputs, attributes=node.attributes, name=f"{node.name}_fp16")
        half.outputs[0].name = f"{node.name}_fp16_out"
        new += [half, _cast(half.outputs[0], f32, f"{node.name}_to_fp32")]
        _swap_in(graph, node, new)
        converted += 1
    RemoveUnusedNodesPass()(model)  # drops the fp32 weights nothing reads any more
    return converted


def round_trip_casts(model: Any) -> list[str]:
    """Names of Casts to fp32 whose input is a Cast to fp16 of an fp32 value (graph and subgraphs)."""
    import onnx_ir as ir

    found = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type != "Cast" or node.attributes.get_int("to") != ir.DataType.FLOAT:
            continue
        producer = node.inputs[0].producer()
        if (
            producer is not None
            and producer.op_type == "Cast"
            and producer.attributes.get_int("to") == ir.DataType.FLOAT16
            and producer.inputs[0].dtype in (ir.DataType.FLOAT, None)
        ):
            found.append(node.name)
    return found


# ------------------------------------------------------------------------------- RMSNorm
def fusable_rms_norms(model: Any) -> int:
    """Rewrite RMSNorm's `x * Reciprocal(Sqrt(mean(x^2) + eps))` (torch's rsqrt at opset 18) as
    `x / Sqrt(...)`, the form onnxruntime's CPU optimiser fuses into one
    SimplifiedLayerNormalization kernel (it leaves the Reciprocal form as seven ops). The same
    function up to one rounding; plain ONNX ops, so every provider still runs the file. Returns
    how many norms were rewritten."""
    import onnx_ir as ir

    rewritten = 0
    for node in list(model.graph):
        if node.op_type != "Reciprocal" or node.domain not in ONNX_DOMAINS:
            continue
        sqrt = node.inputs[0].producer()
        users = node.outputs[0].uses()
        if sqrt is None or sqrt.op_type != "Sqrt" or len(users) != 1:
            continue
        mul, slot = users[0]
        x = mul.inputs[1 - slot] if mul.op_type == "Mul" else None
        if x is None or _rms_input(sqrt) is not x:
            continue
        div = ir.node("Div", [x, sqrt.outputs[0]], name=f"{mul.name}_div")
        div.outputs[0].name = f"{mul.name}_div_out"
        _swap_in(model.graph, mul, [div])
        model.graph.remove(node, safe=True)
        rewritten += 1
    return rewritten


def _rms_input(sqrt: Any) -> Any:
    """x when `sqrt` computes Sqrt(ReduceMean(Pow(x, 2)) + eps), else None."""
    add = sqrt.inputs[0].producer()
    if add is None or add.op_type != "Add":
        return None
    mean = next(
        (
            v.producer()
            for v in add.inputs
            if v.producer() is not None and v.producer().op_type == "ReduceMean"
        ),
        None,
    )
    power = mean.inputs[0].producer() if mean is not None else None
    if power is None or power.op_type != "Pow" or _const_float(power.inputs[1]) is None:
        return None
    return power.inputs[0] if float(_const_float(power.inputs[1])) == 2.0 else None


# ------------------------------------------------------------------------------- smoothing
def _smoothable_groups(model: Any) -> list[tuple[Any, Any, list[Any]]]:
    """(scale node, its constant scale value, the weight-MatMuls reading its output).

    A group is a norm's last scaling (Mul by a constant vector, or LayerNormalization's scale)
    whose output is read only by MatMuls with constant weights: dividing the scale by s and
    multiplying the weights' rows by s leaves the function unchanged.
    """
    groups = []
    for node in model.graph:
        if node.domain not in ONNX_DOMAINS or node.op_type not in ("Mul", "LayerNormalization"):
            continue
        if node.op_type == "Mul":
            slots = [
                i
                for i, v in enumerate(node.inputs)
                if _const_float(v) is not None and _const_float(v).ndim == 1
            ]
            if len(slots) != 1:
                continue
            scale = node.inputs[slots[0]]
        else:
            scale = node.inputs[1]
            if _const_float(scale) is None:
                continue
        users = [user for user, _ in node.outputs[0].uses()]
        if (
            users
            and all(
                u.op_type == "MatMul"
                and u.domain in ONNX_DOMAINS
                and u.inputs[0] is node.outputs[0]
                and _const_float(u.inputs[1]) is not None
                for u in users
            )
            and len(scale.uses()) == 1
        ):
            groups.append((node, scale, users))
    return groups


# Whether a calibration probe's session prepacks its weights (onnxruntime's default). Off: a probe
# runs a handful of items once, and unpacked weights stay the external-data file's memory-mapped
# pages (file-backed, which the kernel can drop under pressure) instead of a packed anonymous copy
# of every fp32 weight (a 4B variant step's 1.16x peak came from such a probe of
# the fp32 text graph), and loading skips the packing: results/experiments/variants-probe-prepacking-2b-full.md.
PROBE_PREPACKING = False


@contextlib.contextmanager
def _probe(src: Path, outputs: Callable[[Any], list[str]]) -> Iterator[tuple[Any, list[str]]]:
    """An onnxruntime session (no graph optimisation) on a copy of the graph at `src` whose outputs
    are what `outputs(proto graph)` adds and names; the copy sits beside `src` (same external
    data) and is removed on exit."""
    import onnx
    import onnxruntime as ort

    proto = onnx.load(str(src), load_external_data=False)
    del proto.graph.output[:]
    names = outputs(proto.graph)
    proto.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names)
    probe = src.with_name(f".{src.stem}.calibration.onnx")
    onnx.save(proto, str(probe))
    try:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        if not PROBE_PREPACKING:
            options.add_session_config_entry("session.disable_prepacking", "1")
        yield ort.InferenceSession(str(probe), options, providers=["CPUExecutionProvider"]), names
    finally:
        probe.unlink(missing_ok=True)


def channel_maxima(
    src: Path, names: Sequence[str], feeds: Iterable[dict[str, Any]]
) -> dict[str, np.ndarray]:
    """Per-channel (last axis) max |value| of the named intermediate tensors of the graph at
    `src`, by onnxruntime over all `feeds`."""
    per_feed = channel_maxima_per_feed(src, names, feeds)
    return {name: np.max(peaks, axis=0) for name, peaks in per_feed.items()}


def channel_maxima_per_feed(
    src: Path, names: Sequence[str], feeds: Iterable[dict[str, Any]]
) -> dict[str, list[np.ndarray]]:
    """Per-channel (last axis) max |value| of the named intermediate tensors, one vector per feed
    (a page's channel profile differs from a query's: a maximum over both hides the query's).
    Reduced inside the graph (Flatten, Abs, ReduceMax), so a 779-token query at full width
    returns vectors, not every intermediate tensor."""
    import onnx

    def channel_peaks(graph: Any) -> list[str]:
        axis = onnx.helper.make_tensor("channel_peak_axis0", onnx.TensorProto.INT64, [1], [0])
        graph.initializer.append(axis)
        outs = []
        for i, name in enumerate(names):
            graph.node.extend(
                [
                    onnx.helper.make_node("Flatten", [name], [f"channel_rows_{i}"], axis=-1),
                    onnx.helper.make_node("Abs", [f"channel_rows_{i}"], [f"channel_abs_{i}"]),
                    onnx.helper.make_node(
                        "ReduceMax",
                        [f"channel_abs_{i}", "channel_peak_axis0"],
                        [f"channel_peak_{i}"],
                        keepdims=0,
                    ),
                ]
            )
            outs.append(f"channel_peak_{i}")
        return outs

    maxima: dict[str, list[np.ndarray]] = {name: [] for name in names}
    with _probe(src, channel_peaks) as (session, outs):
        for feed in feeds:
            for name, peak in zip(names, session.run(outs, feed)):
                maxima[name].append(peak)
    return maxima


def peak_magnitudes(
    src: Path, names: Sequence[str], feeds: Iterable[dict[str, Any]]
) -> dict[str, float]:
    """max |value| of each named intermediate tensor of the graph at `src` over `feeds`. The probe
    reduces each tensor to a scalar inside the graph, so memory stays that of one plain run."""
    import onnx

    def scalar_peaks(graph: Any) -> list[str]:
        outs = []
        for i, name in enumerate(names):
            graph.node.extend(
                [
                    onnx.helper.make_node("Abs", [name], [f"peak_abs_{i}"]),
                    onnx.helper.make_node(
                        "ReduceMax", [f"peak_abs_{i}"], [f"peak_{i}"], keepdims=0
                    ),
                ]
            )
            outs.append(f"peak_{i}")
        return outs

    peaks = dict.fromkeys(names, 0.0)
    with _probe(src, scalar_peaks) as (session, outs):
        for feed in feeds:
            for name, value in zip(names, session.run(outs, feed)):
                value = float(value)  # a NaN counts as unbounded
                peaks[name] = max(peaks[name], value) if np.isfinite(value) else float("inf")
    return peaks


def fp16_gemm_peaks(
    model: Any, src: Path, calibration: Sequence[dict[str, Any]], *, keep_scopes: Iterable[str]
) -> dict[str, float]:
    """{node name: max |input| or |output|} of the GEMMs the fp16 recipe would convert, on the
    `calibration` feeds of the fp32 graph at `src` (the same graph as `model`). Only these values
    pass through fp16: everything between the islands stays fp32."""
    gemms = [node for node, _ in fp16_candidates(model, keep_scopes) if node.op_type != "Gather"]
    tensors = sorted({v.name for n in gemms for v in (n.inputs[0], n.outputs[0])})
    peaks = peak_magnitudes(src, tensors, calibration)
    return {n.name: max(peaks[n.inputs[0].name], peaks[n.outputs[0].name]) for n in gemms}


def smoothing_factors(
    model: Any,
    src: Path,
    calibration: Sequence[dict[str, Any]],
    *,
    alpha: float,
    maxima: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """SmoothQuant's factors for every `_smoothable_groups` group: {MatMul name: s}, with the
    norm's scale (and LayerNorm bias) divided by s in place; the caller multiplies each named
    MatMul's weight rows by s (the int8 recipe does it while quantising, weight by weight).

    s_k = max|X_k|^alpha / max|W_k|^(1-alpha) over the group's weights, from `calibration` feeds
    of the fp32 graph at `src` (the same graph as `model`), or from `maxima` (per-channel max |X|
    by tensor name) when the caller measured them already.
    """
    import onnx_ir as ir

    groups = _smoothable_groups(model)
    if not groups:
        return {}
    names = [node.outputs[0].name for node, _, _ in groups]
    if maxima is None or not set(names) <= set(maxima):
        maxima = channel_maxima(src, names, calibration)
    low, high = SMOOTHING_BOUNDS
    factors: dict[str, np.ndarray] = {}
    for node, scale, users in groups:
        act = np.maximum(maxima[node.outputs[0].name], 1e-5)
        weight_peak = np.max([np.abs(_const_float(u.inputs[1])).max(axis=1) for u in users], axis=0)
        s = np.clip(act**alpha / np.maximum(weight_peak, 1e-5) ** (1 - alpha), low, high)
        s = s.astype(np.float32)
        targets = [scale] + (
            [node.inputs[2]]
            if node.op_type == "LayerNormalization"
            and len(node.inputs) > 2
            and _const_float(node.inputs[2]) is not None
            else []
        )
        for value in targets:
            value.const_value = ir.tensor(_const_float(value) / s, name=value.name)
        for user in users:
            if len(user.inputs[1].uses()) > 1:
                raise ExportError(
                    f"{user.inputs[1].name}: a weight shared outside its smoothing group"
                )
            factors[user.name] = s
    return factors


def smooth_activation_outliers(
    model: Any, src: Path, calibration: Sequence[dict[str, Any]], *, alpha: float
) -> int:
    """`smoothing_factors` with the weights multiplied in place too (an fp32 graph computing the
    same function); returns how many MatMuls were smoothed. Holds every smoothed weight in
    memory: the int8 recipe folds the factors while quantising instead."""
    import onnx_ir as ir

    factors = smoothing_factors(model, src, calibration, alpha=alpha)
    for node in model.graph:
        if node.name in factors:
            w = node.inputs[1]
            w.const_value = ir.tensor(_const_float(w) * factors[node.name][:, None], name=w.name)
    return len(factors)
