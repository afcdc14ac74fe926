"""onnxruntime sessions: which providers, with which options, and proof that we got them.

The one session factory: the model graphs (`model.py`), the MaxSim scorer (`scoring.py`) and the
benchmarks all open their onnxruntime sessions through `Session`, so thread counts, spinning, memory
options and the provider check are set in one place. Provider names live here and nowhere else.

Capabilities live in one table. onnxruntime silently falls back to CPU when a provider refuses a
graph (DirectML does so for `Reshape(allowzero=1)`), so after creating a session we check the
provider it really got and raise instead of running slowly on the wrong device. A graph onnxruntime
cannot load raises ModelFolderError naming the file (onnxruntime's own exception types vary).

"openvino" is not an onnxruntime provider: `open_session` hands those graphs to the OpenVINO
runtime (`openvino_runtime.py`, the `openvino` extra), which runs only the variants made for it
(`OPENVINO_VARIANTS`).

The only colembed module that imports onnxruntime (lazily: importing this module is cheap).
"""

from __future__ import annotations

import importlib.util
import os
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .errors import ModelFolderError, ProviderError

CPU = "CPUExecutionProvider"
DIRECTML = "DmlExecutionProvider"
CUDA = "CUDAExecutionProvider"
OPENVINO = "OpenVINO"  # the OpenVINO runtime itself (openvino_runtime.py), not an onnxruntime EP

# name users may pass -> provider name
ALIASES = {"cpu": CPU, "directml": DIRECTML, "dml": DIRECTML, "cuda": CUDA, "openvino": OPENVINO}

# The variants made for OpenVINO (export/graphs/openvino_form.py writes their graphs) and the inference
# precision each is compiled with. OpenVINO runs these and no other (its ONNX front end reads the
# fp32 graphs' vision rotary with another meaning); no other provider runs them.
OPENVINO_VARIANTS = {"openvino": "f32", "openvino-bf16": "bf16", "openvino-int8": "f32"}
OPENVINO_EXTRA_HINT = "pip install 'colembed[openvino]'"


@dataclass(frozen=True)
class ProviderTraits:
    """What a provider needs from the session and the caller."""

    mem_pattern: bool = True
    sequential: bool = False
    one_run_at_a_time: bool = False  # serialise `run` calls on a session
    config: tuple[tuple[str, str], ...] = ()  # session config entries


TRAITS: dict[str, ProviderTraits] = {
    CPU: ProviderTraits(),
    # DirectML: memory patterns off, sequential execution, one Run per session at a time
    # (onnxruntime's DirectML documentation); dynamic graph fusion lets DirectML fuse graphs whose
    # shapes change per call (tokens, patches), as ours do, instead of running node by node.
    DIRECTML: ProviderTraits(
        mem_pattern=False,
        sequential=True,
        one_run_at_a_time=True,
        config=(("ep.dml.enable_dynamic_graph_fusion", "1"),),
    ),
    CUDA: ProviderTraits(),
}

ProviderSpec = str | tuple[str, dict[str, Any]]
# execution_order name -> onnxruntime.ExecutionOrder member
EXECUTION_ORDERS = {"default": "DEFAULT", "priority": "PRIORITY_BASED"}

# How the intra-op threads wait, inside a run and between runs. A run is a chain of parallel
# sections (each GEMM, each large element-wise node); a thread that blocks after one section
# has to be woken for the next (a futex round trip, longer on a busy machine). The int8 graphs'
# per-token scales add ~60 nodes a language layer, which made a single int8 query ~10% slower
# than 0.1.0's per-tensor graphs with blocking threads; spinning within runs won it back
# (benchmarks/results/embed/embed-against-own.md, docs/speed.md). The threads stop spinning when a run
# returns (onnxruntime's `session.force_spinning_stop`), which keeps what blocking was for: no
# core burnt between runs while the host prepares the next batch.
RUN_THREAD_CONFIG = (("session.intra_op.allow_spinning", "1"), ("session.force_spinning_stop", "1"))


def onnxruntime_facts() -> dict[str, Any]:
    """The installed onnxruntime's version and providers (for reports such as `colembed doctor`)."""
    import onnxruntime as ort

    return {"onnxruntime": ort.__version__, "available_providers": ort.get_available_providers()}


def available_providers() -> list[str]:
    import onnxruntime as ort

    return list(ort.get_available_providers())


def openvino_installed() -> bool:
    """Whether the OpenVINO runtime can be imported (found, not imported: that is slow)."""
    return importlib.util.find_spec("openvino") is not None


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-threads share one core's FPUs, so
    matmul-bound work uses these): the machine's, at most the CPUs its affinity allows (a
    `taskset`, a container's cpuset, a pinned worker), since threads beyond those only queue."""
    cores = _machine_physical_cores()
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this system (macOS, Windows)
        return cores
    return max(1, min(cores, allowed))


def _machine_physical_cores() -> int:
    try:
        cores = set()
        with open("/proc/cpuinfo") as f:
            physical, core = None, None
            for line in f:
                if line.startswith("physical id"):
                    physical = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    core = line.split(":")[1].strip()
                elif not line.strip() and core is not None:
                    cores.add((physical, core))
                    physical, core = None, None
        if cores:
            return len(cores)
    except OSError:
        pass
    return max(1, (os.cpu_count() or 2) // 2) if (os.cpu_count() or 1) > 1 else 1


def resolve_providers(
    providers: str | Sequence[ProviderSpec] | None, *, auto_openvino: bool = False
) -> list[ProviderSpec]:
    """Normalise the user's request. None -> CPU; "auto" -> DirectML when available, else
    OpenVINO when `auto_openvino` (the caller's measured choice: `model.auto_providers`), else
    CPU. OpenVINO runs a whole graph or nothing, so it is never listed beside another provider."""
    available = available_providers()
    if providers is None:
        return [CPU]
    if isinstance(providers, str):
        if providers.lower() == "auto":
            if DIRECTML in available:
                return [DIRECTML, CPU]
            return [OPENVINO] if auto_openvino and openvino_installed() else [CPU]
        providers = [providers]
    resolved: list[ProviderSpec] = []
    for spec in providers:
        if isinstance(spec, (list, tuple)) and len(spec) != 2:
            raise ProviderError(f"provider {spec!r} is not a name or a (name, options) pair")
        name, options = (spec, None) if isinstance(spec, str) else spec
        if not isinstance(name, str):
            raise ProviderError(f"provider {spec!r} is not a name or a (name, options) pair")
        name = ALIASES.get(name.lower(), name)
        if name == OPENVINO:
            if not openvino_installed():
                raise ProviderError(
                    f"the OpenVINO runtime is not installed ({OPENVINO_EXTRA_HINT})"
                )
            if options is not None and not isinstance(options, dict):
                raise ProviderError(f"OpenVINO options {options!r} are not a dict")
            resolved.append(name if options is None else (name, options))
            continue
        if name not in available:
            hint = (
                " (on Windows x64 colembed installs onnxruntime-directml; if `onnxruntime` was "
                "installed next to it, e.g. by fastembed, run `pip uninstall -y onnxruntime "
                "onnxruntime-directml` then `pip install onnxruntime-directml`)"
                if name == DIRECTML
                else ""
            )
            asked = f"{name} (options {options})" if options else name
            raise ProviderError(
                f"execution provider {asked} is not available here; this "
                f"onnxruntime has {available}{hint}"
            )
        resolved.append(name if options is None else (name, options))
    if not resolved:
        raise ProviderError("an empty provider list was given")
    if OPENVINO in [_name(p) for p in resolved] and len(resolved) > 1:
        raise ProviderError(
            "OpenVINO runs a whole graph: give it alone, not beside "
            f"{[_name(p) for p in resolved if _name(p) != OPENVINO]}"
        )
    return resolved


def default_openvino_variant(providers: Any) -> str | None:
    """ "openvino" when `providers` (as given, unresolved) asks for OpenVINO first, else None: the
    variant a caller that names no variant gets there (the only exact one OpenVINO runs)."""
    if isinstance(providers, str):
        providers = [providers]
    if not providers or isinstance(providers, (bytes, dict)):
        return None
    first = providers[0]
    name = (
        first
        if isinstance(first, str)
        else (first[0] if isinstance(first, (list, tuple)) and first else None)
    )
    return (
        "openvino"
        if isinstance(name, str) and ALIASES.get(name.lower(), name) == OPENVINO
        else None
    )


def open_session(
    source: str | os.PathLike,
    providers: Sequence[ProviderSpec] | None,
    *,
    threads: int | None = None,
    precision: str | None = None,
    **options: Any,
):
    """The session for a model graph: OpenVINO's when `providers` (resolved) is OpenVINO, with
    `precision` (the variant's) unless its options name one; else onnxruntime's `Session` with
    `options`. Both have `run(feeds)`, `providers` and `session` (its inputs and outputs)."""
    providers = list(providers) if providers else [CPU]
    if _name(providers[0]) != OPENVINO:
        return Session(source, providers, threads=threads, **options)
    from . import openvino_runtime

    given = providers[0][1] if isinstance(providers[0], tuple) else {}
    settings = dict(given)
    if precision is not None:
        settings.setdefault("precision", precision)
    return openvino_runtime.Session(source, settings, threads=threads or physical_cores())


def arena_shrinking_options(providers: list[str], cpu_mem_arena: bool):
    """Run options that hand the CPU arena's free chunks back after each run, so one large
    request does not leave the process at its peak (benchmarks/results/query_memory/query_memory.md)."""
    if not cpu_mem_arena or not providers or providers[0] != CPU:
        return None
    import onnxruntime as ort

    options = ort.RunOptions()
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return options


def _name(spec: ProviderSpec) -> str:
    return spec if isinstance(spec, str) else spec[0]


class Session:
    """An onnxruntime InferenceSession plus the lock its provider may need.

    `source`: a graph file or the serialised graph (bytes). `providers`: resolved specs (see
    `resolve_providers`); None is CPU. `save_optimized`: also write the graph as onnxruntime
    optimised it (weights beside it), for inspecting fusions. `session_config`: onnxruntime
    session config entries on top of the provider's (the export gate's: colembed_export/
    export/variants/gates.py). `profile_prefix`: profile every run (node placement per provider; `colembed
    doctor`), files starting with this prefix. `execution_order`: onnxruntime's order of the
    graph's nodes, "default" (its topological sort) or "priority" (its priority-based one, which
    runs a node whose inputs are all constants, such as the Cast of a weight, only when nothing
    before it in the graph can run: next to its consumer; the export gate's fp16 sessions,
    colembed_export/evaluation.py). The order changes when each node runs, not what it computes.
    """

    def __init__(
        self,
        source: str | os.PathLike | bytes,
        providers: Sequence[ProviderSpec] | None = None,
        *,
        threads: int | None = None,
        cpu_mem_arena: bool = True,
        graph_optimization: str = "all",
        session_config: Mapping[str, str] | None = None,
        save_optimized: str | os.PathLike | None = None,
        profile_prefix: str | None = None,
        execution_order: str = "default",
    ) -> None:
        import onnxruntime as ort

        if execution_order not in EXECUTION_ORDERS:
            raise ValueError(
                f"execution_order must be one of {sorted(EXECUTION_ORDERS)}, got "
                f"{execution_order!r}"
            )

        providers = list(providers) if providers else [CPU]
        traits = TRAITS.get(_name(providers[0]), ProviderTraits())
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads if threads else physical_cores()
        options.inter_op_num_threads = 1
        options.enable_cpu_mem_arena = cpu_mem_arena
        options.enable_mem_pattern = traits.mem_pattern
        options.execution_order = getattr(ort.ExecutionOrder, EXECUTION_ORDERS[execution_order])
        if profile_prefix is not None:
            options.enable_profiling = True
            options.profile_file_prefix = profile_prefix
        options.graph_optimization_level = {
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        }[graph_optimization]
        if traits.sequential:
            options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # Within a run the intra-op threads spin between parallel sections (RUN_THREAD_CONFIG above),
        # and stop when the run returns: between graph runs the host does numpy work (the next
        # batch, the next scorer chunk), which spinning threads would steal cores from.
        for key, value in RUN_THREAD_CONFIG:
            options.add_session_config_entry(key, value)
        if save_optimized is not None:
            options.optimized_model_filepath = str(save_optimized)
            options.add_session_config_entry(
                "session.optimized_model_external_initializers_file_name",
                os.path.basename(save_optimized) + "_data",
            )
        for key, value in (*traits.config, *(session_config or {}).items()):
            options.add_session_config_entry(key, value)
        self.options = options
        self.path = None if isinstance(source, (bytes, bytearray)) else os.fspath(source)
        label = os.path.basename(self.path) if self.path else "<in-memory graph>"
        try:
            self.session = ort.InferenceSession(
                bytes(source) if self.path is None else self.path,
                sess_options=options,
                providers=providers,
            )
        except Exception as e:  # onnxruntime raises its own exception types for unreadable graphs
            if type(e).__module__.startswith("colembed"):
                raise
            raise ModelFolderError(
                f"onnxruntime cannot load this graph ({e})", path=self.path or label
            ) from e
        got = self.session.get_providers()
        wanted = _name(providers[0])
        if not got or got[0] != wanted:
            raise ProviderError(
                f"{label}: asked for {wanted} but onnxruntime gave {got}; refusing the silent "
                "fallback (the graph or this machine does not support that provider)"
            )
        self.providers = got
        self._lock = threading.Lock() if traits.one_run_at_a_time else None

    def run(self, feeds: dict[str, Any], run_options: Any = None) -> list[Any]:
        if self._lock is None:
            return self.session.run(None, feeds, run_options)
        with self._lock:
            return self.session.run(None, feeds, run_options)
