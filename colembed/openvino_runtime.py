"""The model graphs on the OpenVINO runtime: the session `sessions.open_session` opens for the
"openvino" provider.

OpenVINO reads the folder's `.onnx` files itself (its ONNX front end) and compiles them for its
CPU plugin. Not onnxruntime's OpenVINO execution provider: its plugin package offers no device on
non-Intel CPUs, and the package that has it built in replaces onnxruntime; where it ran it loaded
slower and ran no faster than the runtime itself (benchmarks/results/openvino/openvino-2b-2+2-findings.md). No
compiled-model cache by default: OpenVINO's cache holds a copy of the weights (gigabytes for a
full-size model) and read back no faster than a fresh compile where measured; a caller may give
one (`cache_dir`).

Only the graphs made for OpenVINO run here (the `openvino*` variants: export/graphs/openvino_form.py):
OpenVINO's front end reads some of onnxruntime's fused kernels with another meaning.

The only colembed module that imports openvino (lazily: `import colembed` never loads it).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Mapping

from .errors import ModelFolderError, ProviderError

DEVICE = "CPU"
# INFERENCE_PRECISION_HINT values a caller may ask for: "f32" computes as onnxruntime fp32 does
# (the parity bound holds); "bf16" is the bf16 variant's (AVX512-BF16 / AMX CPUs; OpenVINO runs f32
# where the CPU has no bf16 arithmetic, and `Session.precision` then says "f32").
PRECISIONS = ("f32", "bf16")
# Provider options this session takes: ("openvino", {"precision": "bf16", "cache_dir": ...}).
OPTIONS = ("precision", "cache_dir", "device")
# OpenVINO element type name -> onnxruntime's type string (the contracts compare those).
ORT_TYPES = {
    "f32": "tensor(float)",
    "i64": "tensor(int64)",
    "i32": "tensor(int32)",
    "f16": "tensor(float16)",
    "u8": "tensor(uint8)",
    "i8": "tensor(int8)",
    "boolean": "tensor(bool)",
}

_core_lock = threading.Lock()
_core = None


def core() -> Any:
    """The process's one OpenVINO Core (plugins load once)."""
    global _core
    with _core_lock:
        if _core is None:
            import openvino as ov

            _core = ov.Core()
        return _core


def openvino_facts() -> dict[str, Any]:
    """The installed OpenVINO's version, devices and the CPU plugin's capabilities."""
    import openvino as ov

    c = core()
    return {
        "openvino": ov.__version__,
        "devices": list(c.available_devices),
        "cpu_capabilities": list(c.get_property(DEVICE, "OPTIMIZATION_CAPABILITIES")),
    }


class _Arg:
    """One graph input or output, described as onnxruntime's NodeArg is (name, type, shape)."""

    def __init__(self, port: Any) -> None:
        # OpenVINO may merge a graph input's tensor with a value computed from it, giving the
        # tensor several names; the graph's own is one of them (feeds may use any)
        self.names = set(port.get_names())
        self.name = port.get_any_name()
        element = port.get_element_type().get_type_name()
        self.type = ORT_TYPES.get(element, f"tensor({element})")
        shape = port.get_partial_shape()
        self.shape = (
            [d.get_length() if d.is_static else None for d in shape] if shape.rank.is_static else []
        )


class _Signature:
    """`get_inputs()` / `get_outputs()` of a compiled model, as an onnxruntime session has them
    (what `GraphContract.mismatches` reads)."""

    def __init__(self, compiled: Any) -> None:
        self._inputs = [_Arg(p) for p in compiled.inputs]
        self._outputs = [_Arg(p) for p in compiled.outputs]

    def get_inputs(self) -> list[_Arg]:
        return self._inputs

    def get_outputs(self) -> list[_Arg]:
        return self._outputs


class Session:
    """A graph compiled by OpenVINO for its CPU plugin; `run` as `colembed.sessions.Session`'s.

    `options`: the provider options (`OPTIONS`): `precision` (PRECISIONS, default "f32"),
    `cache_dir` (a compiled-model cache folder; default none), `device`.
    `threads`: inference threads (default: physical cores). Each thread that runs the graph gets
    its own infer request, so serve's worker threads may call `run` at once.
    """

    name = "OpenVINO"

    def __init__(
        self, source: str | os.PathLike, options: Mapping[str, Any] | None = None, *, threads: int
    ) -> None:
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ProviderError(
                f"OpenVINO provider options {unknown} are not known; it takes {list(OPTIONS)}"
            )
        precision = options.get("precision", "f32")
        if precision not in PRECISIONS:
            raise ProviderError(f"OpenVINO precision {precision!r}: one of {list(PRECISIONS)}")
        self.path = os.fspath(source)
        device = options.get("device", DEVICE)
        cache = options.get("cache_dir")
        config: dict[str, Any] = {
            "INFERENCE_PRECISION_HINT": precision,
            "INFERENCE_NUM_THREADS": int(threads),
            "PERFORMANCE_HINT": "LATENCY",
        }
        if cache:
            Path(cache).mkdir(parents=True, exist_ok=True)
            config["CACHE_DIR"] = os.fspath(cache)
        try:
            self.compiled = core().compile_model(self.path, device, config)
        except Exception as e:  # OpenVINO raises RuntimeError with its front end's report
            raise ModelFolderError(
                f"OpenVINO cannot load this graph ({str(e).strip()[-600:]})", path=self.path
            ) from e
        self.session = _Signature(self.compiled)
        # what the plugin runs: a bf16 request on a CPU without bf16 arithmetic compiles f32
        self.precision = self.compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
        self.providers = [self.name]
        self._local = threading.local()

    def run(self, feeds: dict[str, Any], run_options: Any = None) -> list[Any]:
        request = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = self.compiled.create_infer_request()
        request.infer(feeds)
        # the request's output tensors are reused by its next run: hand back copies
        return [request.get_output_tensor(i).data.copy() for i in range(len(self.compiled.outputs))]
