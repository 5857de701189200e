"""How busy a stage link was (analysis/pipeline.py ``link_load``): bytes per step at the
link's rate over the measured step's time."""

from __future__ import annotations

import pytest

from analysis.pipeline import PipelineMetrics, link_load


def metrics(wall_s: float, steps: int, link_bytes: dict[tuple[str, str], float]
            ) -> PipelineMetrics:
    return PipelineMetrics(steps=steps, wall_s=wall_s, busy_s={}, bubble=0.0,
                           bubble_ideal=0.0, bubble_per_stage={}, samples_per_s=1.0,
                           link_bytes_per_step=link_bytes, peak_act_bytes={},
                           dp_link_bytes_per_step={})


def test_a_link_that_carries_its_rate_the_whole_step_is_fully_busy() -> None:
    # 5 steps of 0.1 s; 1.25 MB a step is 100 Mbit/s for 0.1 s; half of it is half busy.
    m = metrics(0.5, 5, {("s0", "s1"): 1_250_000.0, ("s1", "s0"): 625_000.0})
    load = link_load(m, 100.0)
    assert load[("s0", "s1")] == pytest.approx(1.0)
    assert load[("s1", "s0")] == pytest.approx(0.5)
    assert link_load(m, 1000.0)[("s0", "s1")] == pytest.approx(0.1)
