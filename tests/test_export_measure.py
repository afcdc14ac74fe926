"""The exporter's per-step memory figures: each step's own peak, not the process's so far."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from colembed_export.measure import StepMeter


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-step peaks read /proc")
def test_each_step_reports_its_own_peak():
    messages: list[str] = []
    meter = StepMeter(messages.append)
    with meter.step("allocate"):
        block = np.ones(300_000_000 // 8)  # 300 MB, touched
        del block
    with meter.step("idle"):
        pass
    allocate, idle = meter.records
    assert idle.per_step_peak  # the kernel accepted the reset
    assert allocate.peak_rss_gb - idle.peak_rss_gb > 0.25
    assert idle.rss_after_gb < allocate.peak_rss_gb - 0.25  # freed memory went back
    assert meter.peak_rss_gb == allocate.peak_rss_gb
    assert messages[0] == "allocate" and messages[1].startswith("allocate: ")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-step peaks read /proc")
def test_a_step_keeps_its_peak_across_its_sub_steps():
    """A sub-step resets the kernel's peak mark; what the enclosing step held before it (and what
    the sub-step held) still counts in the enclosing step's peak."""
    meter = StepMeter(lambda message: None)
    with meter.step("variants"):
        block = np.ones(300_000_000 // 8)  # 300 MB, touched, before any sub-step
        del block
        with meter.step("write int8"):
            pass
        with meter.step("gate"):
            inner = np.ones(200_000_000 // 8)
            del inner
    write, gate, outer = meter.records
    assert (write.parent, gate.parent, outer.parent) == ("variants", "variants", None)
    assert outer.peak_rss_gb - write.peak_rss_gb > 0.25  # the 300 MB before the sub-steps
    assert gate.peak_rss_gb - write.peak_rss_gb > 0.15
    assert outer.peak_rss_gb >= gate.peak_rss_gb
