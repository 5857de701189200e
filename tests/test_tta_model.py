"""The time-to-accuracy model of analysis/tta_model.py: closed forms on constant traces,
and the invariant that the best schedule is never slower than any fixed keep."""

from __future__ import annotations

import math

import pytest

from analysis.tta_model import (
    best_schedule_tta_s,
    iterations_at,
    schedule_tta_s,
    topk_wire_bytes,
)
from traces.generate import square

ITERS = {0.01: 200.0, 0.1: 80.0, 1.0: 50.0}
DENSE = 340_000


def constant(bps: float):  # type: ignore[no-untyped-def]
    return lambda a, b: (b - a) * bps / 8


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
        tta, n = schedule_tta_s(choose=lambda t, k=k: k, bytes_between=constant(bps),
                                iterations=ITERS, dense_bytes=DENSE, workers=2,
                                overhead_s=overhead, goodput_fraction=1.0)
        per_iter = overhead + 2 * topk_wire_bytes(k, DENSE) * 8 / bps
        assert n == math.ceil(ITERS[k])
        assert tta == pytest.approx(n * per_iter, rel=1e-3)


def test_best_schedule_never_loses_to_a_fixed_keep() -> None:
    trace = square(2.0, 60.0, half_period_s=1.0, duration_s=400.0)
    common = dict(bytes_between=trace.bytes_between, iterations=ITERS, dense_bytes=DENSE,
                  workers=2, overhead_s=0.02)
    best, _ = best_schedule_tta_s(keeps=[0.01, 0.03, 0.1, 0.3, 1.0], **common)
    fixed = {k: schedule_tta_s(choose=lambda t, k=k: k, **common)[0]
             for k in (0.01, 0.03, 0.1, 0.3, 1.0)}
    assert best <= min(fixed.values()) * 1.01, (best, fixed)
    # Where the rate swings 30x each second, following it beats every fixed keep (by 10 %).
    assert best < 0.95 * min(fixed.values()), (best, fixed)


def test_on_a_constant_trace_the_best_schedule_is_the_best_fixed_keep() -> None:
    common = dict(bytes_between=constant(6e6), iterations=ITERS, dense_bytes=DENSE,
                  workers=2, overhead_s=0.06)
    keeps = [0.01, 0.1, 1.0]
    best, _ = best_schedule_tta_s(keeps=keeps, **common)
    fixed = min(schedule_tta_s(choose=lambda t, k=k: k, **common)[0] for k in keeps)
    assert best == pytest.approx(fixed, rel=1e-6)
