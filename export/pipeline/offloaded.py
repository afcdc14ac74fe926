"""The torch reference run layer by layer from the memory-mapped checkpoint, never the whole model.

The check compares the exported graphs with the checkpoint's own torch model
(`verify.reference_outputs`). Loaded whole, that model holds every fp32 weight at once. Here it is
the stand-in model the graphs are traced from (`graphs/streamed_weights.StandInModel`: every weight
matrix an unwritten `torch.empty` placeholder, the norms, biases and the patch convolution read
whole), and each module that owns a weight matrix gets a forward pre-hook that puts the
checkpoint's tensor in place (`CheckpointTensors.read`: an F32 tensor is the shard's mapped pages,
an F16 / BF16 one widened exactly to fp32) and a forward hook that puts the placeholder back, so
the run holds one module's weights at a time. The values each forward sees are the ones the
strict whole-model loader gives it, so the outputs are the same bit for bit
(`tests/export/pipeline/test_offloaded.py` holds that on every streamed family).

Placeholders stay on the CPU, not on the meta device (as accelerate's disk offload leaves them):
Qwen3-VL's position interpolation builds its index tensors on its table's device before calling
the table. A placeholder read without its hook would give wrong outputs, which the check reports
as a divergence, never as a pass.

Imports torch lazily (through the stand-in model).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from colembed.errors import ExportError


@contextlib.contextmanager
def offloaded(standin: Any) -> Iterator[Any]:
    """`standin.model` (a `StandInModel`'s) runnable as the reference inside the block: each
    module's weight matrices read from the checkpoint for its forward only. On exit the hooks are
    removed and every placeholder is back, so the model can be traced and streamed again."""
    import torch

    owners: list[tuple[Any, list[tuple[str, Any, str]]]] = []
    for module in standin.model.modules():
        held = []
        for key, param in module._parameters.items():
            if param is None:
                continue
            found = standin.standins.get(param.data_ptr())
            if found is not None and not found.absent:
                held.append((key, param, found.name))
        if held:
            owners.append((module, held))

    def put_weights(module, _args, held=None):
        for key, _placeholder, name in held:
            module._parameters[key] = torch.nn.Parameter(
                standin.tensors.read(name), requires_grad=False
            )

    def put_placeholders(module, _args, _output, held=None):
        for key, placeholder, _name in held:
            module._parameters[key] = placeholder

    if not owners:
        raise ExportError("the stand-in model has no weight matrices to read")
    handles = []
    try:
        for module, held in owners:
            handles.append(
                module.register_forward_pre_hook(lambda m, a, held=held: put_weights(m, a, held))
            )
            handles.append(
                module.register_forward_hook(
                    lambda m, a, o, held=held: put_placeholders(m, a, o, held)
                )
            )
        yield standin.model
    finally:
        for handle in handles:
            handle.remove()
        for module, held in owners:  # a forward that raised leaves its weights in place
            put_placeholders(module, None, None, held)


def offloaded_reference(standin: Any, family: Any, folder: Any):
    """The family's reference outputs (`ExportFamily.run_reference`) from `standin`'s model run
    layer by layer."""
    with offloaded(standin) as model:
        return family.run_reference(family.prepare_reference(model), folder)


__all__ = ["offloaded", "offloaded_reference"]
