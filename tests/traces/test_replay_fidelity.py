"""Replay fidelity in Mininet: a replayed step trace delivers the bytes it allows.

The Mahimahi-style physical invariant of STYLE.md: over a 1 to 100 Mbit/s step trace, the
bytes leaving the up bottleneck in every 1 s window are within 3 % of
``trace.bytes_between`` (wire bytes: Ethernet frames as HTB meters them). The measurement
itself lives in ``benchmarks/trace_fidelity.py``; this is the same run, shorter (10 s: each
rate holds for the second after its step and one steady second).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from agents.core.bandwidth import BandwidthTrace
from traces.generate import steps

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import trace_fidelity  # noqa: E402

RATES_MBPS = (1.0, 10.0, 50.0, 100.0, 20.0)  # every step of the shipped fidelity trace


def step_trace(step_s: float) -> BandwidthTrace:
    """1 -> 10 -> 50 -> 100 -> 20 Mbit/s, ``step_s`` each."""
    return steps([(i * step_s, r) for i, r in enumerate(RATES_MBPS)],
                 period_s=len(RATES_MBPS) * step_s)


TRACE = step_trace(3.0)
# Replayed in Mininet: 2 s a step, so each rate holds for the second after its step and
# for one steady second.
REPLAYED = step_trace(2.0)


def test_window_errors_compares_measured_instants_with_trace() -> None:
    # Pure part: a link that delivers exactly the trace gives zero error on every window,
    # even when the samples are jittered; one window short by 5 % shows up as -5 %.
    samples = []
    for i in range(0, 151):
        t = i / 10 + (0.003 if i % 3 else -0.002) if i else 0.0
        samples.append(trace_fidelity.Sample(t, round(TRACE.bytes_between(0.0, t)), 1.0))
    wins = trace_fidelity.window_errors(samples, TRACE, 15.0)
    assert len(wins) == 15
    assert max(abs(w.error) for w in wins) < 1e-4
    short = [trace_fidelity.Sample(s.t_s, s.sent_bytes - (6250 if s.t_s > 4.5 else 0), 1.0)
             for s in samples]
    errs = [w.error for w in trace_fidelity.window_errors(short, TRACE, 15.0)]
    assert errs[4] == pytest.approx(-6250 / 1_250_000, rel=1e-2)
    assert max(abs(e) for i, e in enumerate(errs) if i != 4) < 1e-4


@pytest.mark.mininet
def test_replayed_step_trace_delivers_trace_bytes_within_3pct_per_second() -> None:
    # Up to three runs: on these 2-vCPU virtual machines a timer stall of the host longer
    # than the HTB burst (10 ms) occasionally costs a 1 s window 3-6 % with no drop and no
    # idle sender, and under the full suite's load a `tc class change` sometimes lands
    # ~17 ms late (+6.8 % in the second after a 100 -> 20 step). A replay that is really
    # off (a wrong rate, steps applied late every time) fails every run.
    for attempt in range(3):
        res = trace_fidelity.run(REPLAYED, REPLAYED.period_s)
        if max(abs(w.error) for w in res["windows"]) <= 0.03:
            break
        print(f"attempt {attempt}: worst window {res['worst'].as_dict()}")
    table = [w.as_dict() for w in res["windows"]]
    assert len(table) == 10, table
    # The veth counter we sample counts what the bfifo dequeued (same unit, same bytes).
    assert res["tx_over_qdisc_bytes"] == pytest.approx(1.0, abs=5e-3)
    worst = max(abs(w.error) for w in res["windows"])
    assert worst <= 0.03, table
    # The rates really changed: a 100 Mbit/s second carries ~100x a 1 Mbit/s one.
    assert res["windows"][6].delivered_bytes > 50 * res["windows"][0].delivered_bytes
