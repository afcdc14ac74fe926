"""The exporter's per-step memory figures: each step's own peak, not the process's so far."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

from colembed_export.measure import ANON_SAMPLE_SECONDS, StepMeter


def held() -> None:
    """Long enough for the anonymous-memory sampler to see a block freed inside its step."""
    time.sleep(5 * ANON_SAMPLE_SECONDS)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-step peaks read /proc")
def test_each_step_reports_its_own_peak():
    messages: list[str] = []
    meter = StepMeter(messages.append)
    with meter.step("allocate"):
        block = np.ones(300_000_000 // 8)  # 300 MB, touched
        held()
        del block
    with meter.step("idle"):
        pass
    allocate, idle = meter.records
    assert idle.per_step_peak  # the kernel accepted the reset
    assert allocate.peak_rss_gb - idle.peak_rss_gb > 0.25
    assert idle.rss_after_gb < allocate.peak_rss_gb - 0.25  # freed memory went back
    assert meter.peak_rss_gb == allocate.peak_rss_gb
    assert messages[0] == "allocate" and messages[1].startswith("allocate: ")
    # anonymous memory (the block is): sampled, so at least the block's size in its step only
    assert allocate.peak_anon_gb - idle.peak_anon_gb > 0.25 and "(anonymous " in messages[1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-step peaks read /proc")
def test_a_memory_mapped_file_counts_in_rss_not_in_anonymous_memory(tmp_path):
    """Pages of a memory-mapped file (external weights read through mmap) are in a step's RSS
    peak, not in its anonymous peak: the kernel can drop them under pressure."""
    path = tmp_path / "weights.bin"
    np.ones(300_000_000 // 8).tofile(path)
    meter = StepMeter(lambda message: None)
    with meter.step("map"):
        mapped = np.memmap(path, dtype=np.float64, mode="r")
        assert float(mapped.sum()) == mapped.size  # every page read
        del mapped
    with meter.step("allocate"):
        block = np.ones(300_000_000 // 8)
        held()
        del block
    mapped_step, allocated = meter.records
    assert mapped_step.peak_rss_gb - mapped_step.peak_anon_gb > 0.25
    assert allocated.peak_anon_gb - mapped_step.peak_anon_gb > 0.25


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-step peaks read /proc")
def test_a_step_keeps_its_peak_across_its_sub_steps():
    """A sub-step resets the kernel's peak mark; what the enclosing step held before it (and what
    the sub-step held) still counts in the enclosing step's peak."""
    meter = StepMeter(lambda message: None)
    with meter.step("variants"):
        block = np.ones(300_000_000 // 8)  # 300 MB, touched, before any sub-step
        held()
        del block
        with meter.step("write int8"):
            pass
        with meter.step("gate"):
            inner = np.ones(200_000_000 // 8)
            held()
            del inner
    write, gate, outer = meter.records
    assert (write.parent, gate.parent, outer.parent) == ("variants", "variants", None)
    assert outer.peak_rss_gb - write.peak_rss_gb > 0.25  # the 300 MB before the sub-steps
    assert gate.peak_rss_gb - write.peak_rss_gb > 0.15
    assert outer.peak_rss_gb >= gate.peak_rss_gb
    assert (
        outer.peak_anon_gb - write.peak_anon_gb > 0.25 and outer.peak_anon_gb >= gate.peak_anon_gb
    )
    assert gate.peak_anon_gb - write.peak_anon_gb > 0.15
