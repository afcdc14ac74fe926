"""The export's memory plan (export/pipeline/plan.py): figures read from the checkpoint's headers,
said before any work, and a refusal naming the step, its figure and what to drop."""

from __future__ import annotations

import pytest

from colembed.errors import ExportError


def _fp32_sizes(folder):
    """Every tensor's fp32 bytes, read by loading the tensors (what the plan reads from headers)."""
    from safetensors.torch import load_file

    return {k: v.numel() * 4 for k, v in load_file(folder / "model.safetensors").items()}


def test_the_plan_reads_the_checkpoints_sizes(tiny_checkpoint):
    from colembed_export.pipeline.plan import BASELINE, TRACE, plan_export

    sizes = _fp32_sizes(tiny_checkpoint)
    largest = max(sizes, key=sizes.__getitem__)
    plan = plan_export(tiny_checkpoint, streamed=True, check=True, variants=["int8", "fp16"])
    assert plan.weights == sum(sizes.values())
    assert (plan.largest_name, plan.largest) == (largest, sizes[largest])
    steps = {s.name: s for s in plan.steps}
    assert steps["graphs, streamed"].peak == BASELINE + TRACE + sizes[largest]
    reference = steps["check: torch reference, layer by layer"]
    assert reference.peak == BASELINE + TRACE + sizes[largest]  # one module's weights at a time
    sessions = steps["check: graphs on onnxruntime, one at a time, weights mapped"]
    vision = sum(size for name, size in sizes.items() if ".visual." in name)
    assert 0 < vision < sum(sizes.values())
    assert sessions.peak == BASELINE + max(vision, sum(sizes.values()) - vision)  # one graph
    assert reference.drop == sessions.drop == "--no-check"
    variants = steps["variants (int8, fp16)"]
    assert variants.peak > sessions.peak  # fp32 and a variant
    unstreamed = {s.name: s for s in plan_export(tiny_checkpoint, streamed=False, check=True).steps}
    assert unstreamed["check against the torch model"].peak == BASELINE + sum(sizes.values())
    bare = plan_export(tiny_checkpoint, streamed=True, check=False)
    assert [s.name for s in bare.steps] == ["graphs, streamed"]
    whole = plan_export(tiny_checkpoint, streamed=False, check=False)
    assert whole.steps[0].peak > bare.steps[0].peak  # the whole model against one tensor
    assert any("expected peak" in line for line in plan.lines())


def test_a_step_over_the_limit_is_refused_by_name():
    """Full-size figures (a 2B checkpoint's): the streamed graphs fit where the check and the
    variants do not; each refused step is named with its figure and what drops it."""
    from colembed_export.pipeline.plan import GB, ExportPlan, ExportPlanRefused, Step, check_plan

    steps = [
        Step("graphs, streamed", 1.8 * GB, None),
        Step("check against the torch model", 10.4 * GB, "--no-check"),
        Step("variants (fp16)", 17.2 * GB, "--variant (export the fp32 folder alone)"),
    ]
    plan = ExportPlan(9.8 * GB, 0.9 * GB, "embed_tokens.weight", steps)
    with pytest.raises(ExportPlanRefused) as refused:
        check_plan(plan, 8)
    message = str(refused.value)
    assert "would exceed --max-memory 8 GB; nothing was done" in message
    assert "check against the torch model: ~10.40 GB (drop it: --no-check)" in message
    assert "variants (fp16): ~17.20 GB" in message and "graphs, streamed" not in message
    assert "leave out the steps named above" in message
    check_plan(plan, 17.3)  # every step fits
    with pytest.raises(ExportPlanRefused, match="needs a machine with more memory"):
        check_plan(plan, 1.0)
    with pytest.raises(ExportError, match="above 0"):
        check_plan(plan, 0)


def test_the_cli_prints_the_plan_and_refuses_before_any_work(tiny_checkpoint, tmp_path, capsys):
    from colembed.cli import main

    out = tmp_path / "model"
    assert main(["export", str(tiny_checkpoint), "--out", str(out), "--max-memory", "0.1"]) == 1
    err = capsys.readouterr().err
    assert "plan: expected peak" in err and "graphs, streamed" in err
    assert "would exceed --max-memory 0.1 GB" in err and "nothing was done" in err
    assert not out.exists() and list(tmp_path.iterdir()) == []  # no staging folder either


def test_without_a_limit_only_the_graphs_refuse_and_droppable_steps_warn(monkeypatch):
    """With no --max-memory the available memory is the limit: a check or variant step over it
    is a warning naming what drops it; graphs over it refuse."""
    from colembed_export.pipeline import plan as plan_module
    from colembed_export.pipeline.plan import GB, ExportPlan, ExportPlanRefused, Step, check_plan

    monkeypatch.setattr(plan_module, "available_memory", lambda: 4 * GB)
    steps = [
        Step("graphs, streamed", 1.8 * GB, None),
        Step("check against the torch model", 10.4 * GB, "--no-check"),
    ]
    warnings = check_plan(ExportPlan(9.8 * GB, 0.9 * GB, "embed_tokens.weight", steps), None)
    assert len(warnings) == 1 and "check against the torch model" in warnings[0]
    assert "--no-check" in warnings[0] and "4.00 GB" in warnings[0]
    assert check_plan(ExportPlan(1 * GB, 0.1 * GB, "w", steps[:1]), None) == []
    whole = [Step("graphs, from the whole loaded model", 10.6 * GB, None)]
    with pytest.raises(ExportPlanRefused, match="needs a machine with more memory"):
        check_plan(ExportPlan(9.8 * GB, 0.9 * GB, "embed_tokens.weight", whole), None)
