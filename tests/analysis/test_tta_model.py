"""The time-to-accuracy model of analysis/tta_model.py: closed forms on constant traces,
and the invariant that the best schedule is never slower than any fixed keep."""

from __future__ import annotations

import math

import pytest

from agents.core.bandwidth import BandwidthTrace
from analysis.tta_model import (
    best_schedule_tta_s,
    iterations_at,
    schedule_tta_s,
    topk_wire_bytes,
)
from traces.generate import square

ITERS = {0.01: 200.0, 0.1: 80.0, 1.0: 50.0}
DENSE = 340_000


def constant(bps: float) -> BandwidthTrace:
    return BandwidthTrace((0.0,), (bps / 1e6,), period_s=1.0)


def test_iterations_interpolate_log_log_and_never_extrapolate() -> None:
    assert iterations_at(0.1, ITERS) == pytest.approx(80.0)
    # halfway in log keep between 0.01 and 0.1 is the geometric mean of the counts
    assert iterations_at(math.sqrt(0.001), ITERS) == pytest.approx(math.sqrt(200 * 80))
    with pytest.raises(ValueError, match="outside the measured keeps"):
        iterations_at(0.001, ITERS)
    with pytest.raises(ValueError, match="at least two"):
        iterations_at(0.1, {0.1: 80.0})
    with pytest.raises(ValueError, match=r"iterations\[0.1\]"):
        iterations_at(0.5, {0.1: 0.0, 1.0: 50.0})


def test_wire_bytes_of_topk_and_dense() -> None:
    assert topk_wire_bytes(1.0, DENSE) == DENSE
    assert topk_wire_bytes(0.01, DENSE) == pytest.approx(0.02 * DENSE)  # value + index
    assert topk_wire_bytes(0.9, DENSE) == DENSE                           # never above dense


def test_fixed_schedule_on_a_constant_trace_is_the_closed_form() -> None:
    bps, overhead = 6e6, 0.06
    for k in ITERS:
        tta, n = schedule_tta_s(choose=lambda t, k=k: k, trace=constant(bps),
                                iterations=ITERS, dense_bytes=DENSE, workers=2,
                                overhead_s=overhead, goodput_fraction=1.0)
        per_iter = overhead + 2 * topk_wire_bytes(k, DENSE) * 8 / bps
        assert n == math.ceil(ITERS[k])
        assert tta == pytest.approx(n * per_iter, rel=1e-3)


def test_best_schedule_never_loses_to_a_fixed_keep() -> None:
    trace = square(2.0, 60.0, half_period_s=1.0, duration_s=400.0)
    common = dict(trace=trace, iterations=ITERS, dense_bytes=DENSE, workers=2, overhead_s=0.02)
    keeps = [0.01, 0.03, 0.1, 0.3, 1.0]
    best_s, fixed_s = [], []
    # Where on the wave training starts moves a TTA by up to 10 %: average over the period.
    for start in [0.2 * i for i in range(10)]:
        best, _ = best_schedule_tta_s(keeps=keeps, start_s=start, **common)
        fixed = {k: schedule_tta_s(choose=lambda t, k=k: k, start_s=start, **common)[0]
                 for k in keeps}
        assert best <= min(fixed.values()) * 1.01, (start, best, fixed)
        best_s.append(best)
        fixed_s.append(fixed)
    mean_fixed = min(sum(f[k] for f in fixed_s) for k in keeps) / len(fixed_s)
    # Where the rate swings 30x each second, following it beats every fixed keep, by 4 %:
    # bytes a slow phase does not carry are carried when the fast one comes, so a fixed
    # keep only waits, and following the rate gains only the slow phase's own bytes.
    assert sum(best_s) / len(best_s) < 0.98 * mean_fixed, (best_s, mean_fixed)


def test_start_s_shifts_the_trace() -> None:
    trace = square(2.0, 60.0, half_period_s=1.0, duration_s=400.0)
    common = dict(iterations=ITERS, dense_bytes=DENSE, workers=2, overhead_s=0.02)
    a = schedule_tta_s(choose=lambda t: 0.1, trace=trace, start_s=1.0, **common)
    # The same wave started half a period later, from 0, is the same schedule.
    later = square(60.0, 2.0, half_period_s=1.0, duration_s=400.0)
    b = schedule_tta_s(choose=lambda t: 0.1, trace=later, **common)
    assert a == pytest.approx(b, rel=1e-9)
    # ... and it matters: from the wave's start the TTA differs.
    assert schedule_tta_s(choose=lambda t: 0.1, trace=trace, **common)[0] != \
        pytest.approx(a[0], rel=1e-3)


def test_on_a_constant_trace_the_best_schedule_is_the_best_fixed_keep() -> None:
    common = dict(trace=constant(6e6), iterations=ITERS, dense_bytes=DENSE,
                  workers=2, overhead_s=0.06)
    keeps = [0.01, 0.1, 1.0]
    best, _ = best_schedule_tta_s(keeps=keeps, **common)
    fixed = min(schedule_tta_s(choose=lambda t, k=k: k, **common)[0] for k in keeps)
    assert best == pytest.approx(fixed, rel=1e-6)
