"""Generated bandwidth traces (constant, steps, square wave, seeded random walk) and writers.

These are the synthetic B(t) schedules the issue-4 experiments replay on the bottleneck
(DESIGN.md section 1.1): a 100 -> 20 -> 100 Mbit/s step, a square wave, and a cellular-like
random walk. Writers produce Mahimahi delivery-opportunity files (the format of Netravali et
al., "Mahimahi", USENIX ATC 2015) and ``time_s Mbps`` logs, atomically (write to a temporary
file in the same folder, then rename) so a crash never leaves half a trace.

``python -m traces.generate [--out DIR]`` regenerates ``traces/data/*`` deterministically: each
shipped trace as a Mahimahi ``.trace`` file and as an exact ``.log`` of its rate steps.
"""

from __future__ import annotations

import argparse
import math
import os
import random
from collections.abc import Sequence
from pathlib import Path

from agents.core.bandwidth import (  # noqa: F401  (constant and _check_rate are re-exported)
    MAHIMAHI_PACKET_BYTES,
    BandwidthTrace,
    TraceError,
    _check_rate,
    constant,
)
from agents.core.files import write_atomic
from agents.core.flowsize import FlowSizeCDF, load_flow_cdf, write_flow_cdf

DATA_DIR = Path(__file__).resolve().parent / "data"


def _check_duration(name: str, duration_s: float) -> None:
    if not (math.isfinite(duration_s) and duration_s > 0.0):
        raise TraceError(f"{name}: duration_s={duration_s} must be finite and > 0")


def steps(points: Sequence[tuple[float, float]], period_s: float) -> BandwidthTrace:
    """Rate steps ``[(t_s, rate_mbps), ...]``; the first must start at 0."""
    _check_duration("steps", period_s)
    if not points:
        raise TraceError("steps: no (t_s, rate_mbps) points")
    for i, (t_s, r) in enumerate(points):
        _check_rate(f"steps[{i}]", r)
        if not math.isfinite(t_s):
            raise TraceError(f"steps[{i}]: t_s={t_s} is not finite")
    desc = ",".join(f"{t:g}:{r:g}" for t, r in points)
    return BandwidthTrace(tuple(float(t) for t, _ in points), tuple(float(r) for _, r in points),
                          float(period_s), f"steps({desc};{period_s}s)")


def square(lo_mbps: float, hi_mbps: float, half_period_s: float,
           duration_s: float) -> BandwidthTrace:
    """Alternates ``hi`` (first) and ``lo`` every ``half_period_s`` over ``duration_s``."""
    _check_rate("square lo", lo_mbps)
    _check_rate("square hi", hi_mbps)
    _check_duration("square half_period", half_period_s)
    _check_duration("square", duration_s)
    n = max(1, math.ceil(duration_s / half_period_s - 1e-9))
    times = tuple(k * half_period_s for k in range(n))
    rates = tuple(float(hi_mbps if k % 2 == 0 else lo_mbps) for k in range(n))
    return BandwidthTrace(times, rates, float(duration_s),
                          f"square({lo_mbps},{hi_mbps},{half_period_s}s,{duration_s}s)")


def random_walk(mean_mbps: float, sigma_mbps: float, step_s: float, duration_s: float,
                seed: int, lo_mbps: float = 0.5, hi_mbps: float = float("inf")) -> BandwidthTrace:
    """A mean-reverting Gaussian random walk, clipped to [lo, hi], one value per ``step_s``.

    The reversion (a discrete Ornstein-Uhlenbeck step with ``theta = 0.1``) keeps the long-run
    mean near ``mean_mbps``, which a plain walk would drift away from; ``sigma_mbps`` is the
    per-step noise. Seeded: the same arguments always give the same trace.
    """
    _check_rate("random_walk mean", mean_mbps)
    _check_duration("random_walk step", step_s)
    _check_duration("random_walk", duration_s)
    if not (sigma_mbps >= 0.0 and lo_mbps <= hi_mbps):
        raise TraceError(f"random_walk: need sigma_mbps >= 0 and lo_mbps <= hi_mbps, got "
                         f"{sigma_mbps}, {lo_mbps}, {hi_mbps}")
    rng = random.Random(seed)
    theta = 0.1
    n = max(1, math.ceil(duration_s / step_s - 1e-9))
    x = float(mean_mbps)
    times: list[float] = []
    rates: list[float] = []
    for k in range(n):
        times.append(round(k * step_s, 9))
        rates.append(round(min(max(x, lo_mbps), hi_mbps), 6))
        x += theta * (mean_mbps - x) + rng.gauss(0.0, sigma_mbps)
    return BandwidthTrace(tuple(times), tuple(rates), float(duration_s),
                          f"random_walk(mean={mean_mbps},sigma={sigma_mbps},seed={seed})")


# -- writers -------------------------------------------------------------------------------


def mahimahi_timestamps(trace: BandwidthTrace) -> list[int]:
    """Delivery-opportunity timestamps (ms) for one period of ``trace``.

    Opportunities are placed where the cumulative allowed bytes cross each multiple of 1500,
    so every millisecond carries the trace's rate to within one packet. The period must be a
    whole number of milliseconds, and Mahimahi takes the period from the last line, so the
    final opportunity is moved to exactly the period (time 0 of the next loop is the same
    instant, so the schedule is unchanged up to that one packet).
    """
    period_ms = round(trace.period_s * 1000)
    if period_ms <= 0 or abs(period_ms - trace.period_s * 1000) > 1e-6:
        raise TraceError(f"{trace.source}: period_s={trace.period_s} is not a positive whole "
                         f"number of milliseconds")
    stamps: list[int] = []
    carried = 0.0  # allowed bytes not yet turned into a whole packet
    # One sweep over milliseconds and steps together: O(period_ms + steps), where calling
    # bytes_between per millisecond would search the steps every time.
    bounds = [*trace.times_s[1:], trace.period_s]
    i = 0
    for ms in range(period_ms):
        a, b = ms / 1000, (ms + 1) / 1000
        while bounds[i] <= a:
            i += 1
        j = i
        while True:
            lo = max(a, trace.times_s[j])
            hi = min(b, bounds[j])
            carried += trace.rates_mbps[j] * 1e6 / 8 * (hi - lo)
            if bounds[j] >= b or j + 1 == len(bounds):
                break
            j += 1
        while carried >= MAHIMAHI_PACKET_BYTES - 1e-6:
            stamps.append(ms)
            carried -= MAHIMAHI_PACKET_BYTES
    if not stamps:
        raise TraceError(f"{trace.source}: allows less than one 1500-byte packet per period")
    stamps[-1] = period_ms
    return stamps


def write_mahimahi(trace: BandwidthTrace, path: str | os.PathLike[str]) -> None:
    """Write ``trace`` as a Mahimahi delivery-opportunity file (atomically)."""
    write_atomic(path, "".join(f"{ms}\n" for ms in mahimahi_timestamps(trace)))


def write_rate_log(trace: BandwidthTrace, path: str | os.PathLike[str]) -> None:
    """Write ``trace`` as ``time_s Mbps`` lines (atomically); a trailing comment keeps the
    period, and :func:`agents.core.bandwidth.load_rate_log` accepts ``period_s`` to restore it."""
    lines = [f"# {trace.source}\n", f"# period_s {trace.period_s!r}\n"]
    lines += [f"{t!r} {r!r}\n" for t, r in zip(trace.times_s, trace.rates_mbps, strict=True)]
    write_atomic(path, "".join(lines))


# -- the project's shipped traces ----------------------------------------------------------


def shipped_traces() -> dict[str, BandwidthTrace]:
    """The generated traces the project's configs replay, by file name."""
    return {
        # The step experiment of benchmarks/adaptive_step.py: 100, then 20, then 100 Mbit/s, 20 s each.
        "step_100_20_100.trace": steps([(0.0, 100.0), (20.0, 20.0), (40.0, 100.0)], 60.0),
        # A square wave between 10 and 50 Mbit/s, 5 s per level.
        "square_10_50.trace": square(10.0, 50.0, 5.0, 60.0),
        # A cellular-like walk (mean 10 Mbit/s, 100 ms steps) for the adaptive-ratio runs.
        "cellular_like.trace": random_walk(10.0, 1.5, 0.1, 120.0, seed=4, lo_mbps=1.0,
                                           hi_mbps=40.0),
        # A 1 to 100 Mbit/s staircase for the replay-fidelity check.
        "fidelity_1_100.trace": steps([(0.0, 1.0), (5.0, 10.0), (10.0, 50.0), (15.0, 100.0),
                                       (20.0, 20.0)], 25.0),
    }


def pareto_flow_cdf(alpha: float = 1.1, lo_bytes: float = 1e3, hi_bytes: float = 1e7
                    ) -> FlowSizeCDF:
    """A bounded-Pareto flow-size CDF (heavy-tailed, as data-centre flow sizes are) at
    log-spaced sizes 1, 3, 10, 30 ... KB up to ``hi_bytes``."""
    sizes = [lo_bytes]
    while sizes[-1] < hi_bytes:
        sizes.append(min(hi_bytes, sizes[-1] * (3 if len(sizes) % 2 else 10 / 3)))
    norm = 1 - (lo_bytes / hi_bytes) ** alpha
    cdf = [(1 - (lo_bytes / s) ** alpha) / norm for s in sizes]
    cdf[-1] = 1.0
    return FlowSizeCDF(tuple(round(s) for s in sizes), tuple(cdf), source="pareto")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m traces.generate", description=__doc__)
    ap.add_argument("--out", type=Path, default=DATA_DIR, help="output folder")
    args = ap.parse_args(argv)
    for name, trace in shipped_traces().items():
        path = args.out / name
        write_mahimahi(trace, path)
        # The exact steps as well: Mahimahi's 1500-byte quantum jitters 100 ms windows by a
        # packet, and a replay of the .log changes the rate only where the trace does.
        write_rate_log(trace, path.with_suffix(".log"))
        print(f"{path}: mean {trace.mean_mbps():.3f} Mbit/s over {trace.period_s:g} s")
    # Background flows for [background] kind = "flows" (the real data-centre CDFs are in
    # ../shared/traces/flowsize/).
    cdf_path = args.out / "pareto_flows.cdf"
    write_flow_cdf(pareto_flow_cdf(), cdf_path)
    print(f"{cdf_path}: mean {load_flow_cdf(cdf_path).mean_bytes() / 1e3:.1f} KB per flow")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
