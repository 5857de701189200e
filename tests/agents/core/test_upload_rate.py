"""The adaptive policy's per-upload rate sample (``adaptive.rate_source = "upload"``):
the ACK-clock estimate as a pure function, and stability across iterations when the
samples carry over with rt (pure; no network)."""

from __future__ import annotations

import pytest

from agents.core import config as cfgmod
from agents.core.policies import AdaptiveRatio
from agents.core.policies.adaptive import ack_clock_rate_bps

MS = 1_000_000


def test_the_ack_clock_is_the_slope_between_the_first_and_last_rise() -> None:
    # Readings every ms: nothing acked for one RTT (30 ms), then 1250 bytes per ms
    # (10 Mbit/s) for 20 ms, then a final delayed ACK 40 ms later.
    samples = [(t * MS, 0) for t in range(30)]
    samples += [((30 + k) * MS, 1250 * (k + 1)) for k in range(20)]
    samples += [(90 * MS, 1250 * 20 + 700), (91 * MS, 1250 * 20 + 700)]
    rate = ack_clock_rate_bps(samples[:-2])
    assert rate == pytest.approx(10e6)
    # The delayed last ACK lowers it, but the RTT before the first ACK does not count.
    with_tail = ack_clock_rate_bps(samples)
    assert with_tail is not None and 0.3e7 < with_tail < 10e6
    assert ack_clock_rate_bps([(0, 0), (MS, 0)]) is None
    assert ack_clock_rate_bps([(0, 0), (MS, 100)]) is None  # one rise: nothing to time


def test_upload_samples_carry_across_iterations_and_move_rt() -> None:
    for source, moves in (("writes", False), ("upload", True)):
        p = AdaptiveRatio(carry_rt=True, rate_source=source, eps=0.2)
        p.start(1000, r0_bps=100.0)
        p.observe(50.0, 1)
        p.observe(50.0, 2)
        assert p.rt_bps == 50.0
        # One sample per iteration: only the carried window lets two of them agree.
        for i, rate in enumerate((20.0, 21.0)):
            p.start(1000, r0_bps=100.0, ts_ns=10 + i)
            p.observe(rate, 11 + i)
        assert (p.rt_bps == 21.0) is moves
        assert p.keep_for_next_chunk(0).keep == pytest.approx(0.21 if moves else 0.5)


def test_rate_source_is_validated() -> None:
    with pytest.raises(cfgmod.ConfigError, match="adaptive.rate_source"):
        cfgmod.from_dict({"adaptive": {"rate_source": "guess"}})
