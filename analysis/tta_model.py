"""Time to accuracy under a keep-ratio schedule on a bandwidth trace: what the best schedule
any policy could follow would gain over the best fixed ratio, to read the measured
``cellular_tta`` result against (DESIGN.md 1.1).

The model has three measured inputs and no free parameter:

- ``iterations``: keep ratio -> iterations to the target accuracy, as measured (the fixed
  runs of ``benchmarks/cellular_tta.py``). Between measured keeps it is interpolated
  log-log; outside them it is not extrapolated (``ValueError``).
- ``overhead_s``: the part of an iteration that does not depend on the keep ratio
  (compute, the dense downlink, round trips), measured as the fixed run's mean iteration
  time less its modelled upload.
- the trace: an iteration started at time t with keep k takes
  ``overhead_s + workers x wire_bytes(k) / goodput(t)`` where goodput is the trace's rate
  over the upload (the workers share the up bottleneck).

An iteration at keep k advances training by 1 / iterations(k) of the way to the target;
TTA is the time at which the sum reaches 1. The fixed schedule keeps one k throughout.
The best schedule picks, for each iteration, the k with the most progress per second at
the bandwidth it meets. The bandwidth does not depend on the choice, but an iteration's
length decides where on the trace the next one starts, so the greedy choice is close to
the best under the model, not exactly it: on the real traces of
``benchmarks/tta_headroom.py`` it lands within 2.5 % of the best fixed keep where no
schedule can do better. The model ignores that a keep's effect on training depends on what
came before (error feedback carries the unsent part along), so it is an estimate of the
achievable gain, not a bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from agents.core.bandwidth import BandwidthTrace
from agents.core.ethernet import TCP_GOODPUT_FRACTION

__all__ = ["best_schedule_tta_s", "iterations_at", "keep_independent_s", "schedule_tta_s",
           "topk_wire_bytes"]

# Top-k sends a float32 value and an int32 index per kept element.
TOPK_BYTES_PER_KEPT = 8


def iterations_at(keep: float, iterations: Mapping[float, float]) -> float:
    """Iterations to the target at ``keep``, interpolated log-log between the measured
    keeps. Raises ValueError outside their range or with fewer than two of them."""
    if len(iterations) < 2:
        raise ValueError(f"iterations: {dict(iterations)} needs at least two measured keeps")
    ks = sorted(iterations)
    if not ks[0] <= keep <= ks[-1]:
        raise ValueError(f"keep={keep!r} is outside the measured keeps [{ks[0]}, {ks[-1]}]")
    for k in ks:
        if not (k > 0 and iterations[k] > 0):
            raise ValueError(f"iterations[{k}]={iterations[k]!r}: keep and count must be > 0")
    for lo, hi in zip(ks, ks[1:], strict=False):
        if keep <= hi:
            f = (math.log(keep) - math.log(lo)) / (math.log(hi) - math.log(lo))
            return math.exp((1 - f) * math.log(iterations[lo]) + f * math.log(iterations[hi]))
    raise AssertionError("unreachable")


def topk_wire_bytes(keep: float, dense_bytes: int) -> float:
    """Bytes one worker sends per iteration: the dense float32 gradient at keep 1, else
    top-k's values and indices (never more than dense)."""
    if keep >= 1:
        return float(dense_bytes)
    return min(float(dense_bytes), keep * dense_bytes / 4 * TOPK_BYTES_PER_KEPT)


def _iteration_s(keep: float, t0_s: float, *, trace: BandwidthTrace,
                 dense_bytes: int, workers: int, overhead_s: float,
                 goodput_fraction: float) -> float:
    """An iteration at ``keep`` started at trace time t0: the keep-independent part, then
    every worker's upload through the shared bottleneck."""
    wire = workers * topk_wire_bytes(keep, dense_bytes) / goodput_fraction
    return overhead_s + trace.seconds_to_carry(t0_s + overhead_s, wire)


def keep_independent_s(iteration_s: float, keep: float, *, mean_rate_mbps: float,
                       dense_bytes: int, workers: int,
                       goodput_fraction: float = TCP_GOODPUT_FRACTION) -> float:
    """The part of a measured mean iteration at ``keep`` that does not depend on the keep:
    the iteration less its modelled upload at the trace's mean rate (never below 0)."""
    if mean_rate_mbps <= 0:
        raise ValueError(f"mean_rate_mbps={mean_rate_mbps!r} must be > 0")
    wire = workers * topk_wire_bytes(keep, dense_bytes) / goodput_fraction
    return max(0.0, iteration_s - wire * 8 / (mean_rate_mbps * 1e6))


def schedule_tta_s(*, choose: Callable[[float], float],
                   trace: BandwidthTrace,
                   iterations: Mapping[float, float], dense_bytes: int, workers: int,
                   overhead_s: float, goodput_fraction: float = TCP_GOODPUT_FRACTION,
                   start_s: float = 0.0, limit_s: float = 3600.0) -> tuple[float, int]:
    """(TTA seconds, iterations) when training starts at trace time ``start_s`` and
    iteration i, starting at trace time t, uses keep ``choose(t)``. The trace's rate is the
    bottleneck's, in wire bytes."""
    if workers < 1 or overhead_s < 0 or dense_bytes <= 0:
        raise ValueError(f"workers={workers}, overhead_s={overhead_s}, "
                         f"dense_bytes={dense_bytes}: must be >= 1, >= 0, > 0")
    t, progress, n = start_s, 0.0, 0
    while progress < 1.0 - 1e-9:  # n x (1/n) may round to just under 1
        if t - start_s > limit_s:
            raise ValueError(f"the target is not reached within limit_s={limit_s}")
        k = choose(t)
        t += _iteration_s(k, t, trace=trace, dense_bytes=dense_bytes,
                          workers=workers, overhead_s=overhead_s,
                          goodput_fraction=goodput_fraction)
        progress += 1.0 / iterations_at(k, iterations)
        n += 1
    return t - start_s, n


def best_schedule_tta_s(*, trace: BandwidthTrace,
                        iterations: Mapping[float, float], dense_bytes: int, workers: int,
                        overhead_s: float, keeps: Sequence[float] | None = None,
                        goodput_fraction: float = TCP_GOODPUT_FRACTION,
                        start_s: float = 0.0, limit_s: float = 3600.0) -> tuple[float, int]:
    """(TTA seconds, iterations) of the schedule that gives each iteration the keep with
    the most progress per second at the bandwidth it meets. ``keeps``: the candidates
    (default: 40 log-spaced between the smallest and largest measured keep)."""
    lo, hi = min(iterations), max(iterations)
    cands = list(keeps) if keeps is not None else [
        lo * (hi / lo) ** (i / 39) for i in range(40)]

    def choose(t0: float) -> float:
        def rate(k: float) -> float:
            s = _iteration_s(k, t0, trace=trace, dense_bytes=dense_bytes,
                             workers=workers, overhead_s=overhead_s,
                             goodput_fraction=goodput_fraction)
            return 1.0 / (iterations_at(k, iterations) * s)
        return max(cands, key=rate)

    return schedule_tta_s(choose=choose, trace=trace, iterations=iterations,
                          dense_bytes=dense_bytes, workers=workers, overhead_s=overhead_s,
                          goodput_fraction=goodput_fraction, start_s=start_s,
                          limit_s=limit_s)
