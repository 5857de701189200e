"""``adaptive.rate_source = "drain"`` (agents/core/drain.py): a worker's own link rate from
the ACKs of a stretch in which its upload was provably queued, and the conservative
windowed estimate the adaptive keep is planned on (pure; no network)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.core import config as cfgmod
from agents.core.drain import (
    MSS_BYTES,
    DrainReading,
    backlog_ack_rate_bps,
    conservative_rate_bps,
)
from agents.core.policies import AdaptiveRatio
from agents.core.policies.adaptive import ack_clock_rate_bps
from analysis.load import load_events
from tests.loopback import run_loopback

MS = 1_000_000
RTT_NS = 30 * MS


def simulate(writes: list[tuple[int, int]], link_bps: float, rtt_ns: int = RTT_NS,
             poll_ns: int = MS // 2, last_ack_delay_ns: int = 0,
             end_ns: int = 200 * MS) -> list[DrainReading]:
    """Readings every ``poll_ns`` of one upload through a FIFO link of ``link_bps`` with the
    bottleneck at the sender: ``writes`` are (ts_ns, bytes) handed to TCP (all sent at
    once: a large cwnd); segments leave the queue one after another at the link rate and
    each is acknowledged ``rtt_ns`` after it left, every second one (delayed ACKs), the
    last one ``last_ack_delay_ns`` late."""
    segs: list[tuple[int, int]] = []  # (ts the segment is queued, its end offset)
    offset = 0
    for ts, size in writes:
        while size > 0:
            n = min(size, MSS_BYTES)
            offset += n
            size -= n
            segs.append((ts, offset))
    acks: list[tuple[int, int]] = []
    free_ns = 0
    for i, (ts, end) in enumerate(segs):
        prev_end = segs[i - 1][1] if i else 0
        free_ns = max(free_ns, ts) + int((end - prev_end) * 8e9 / link_bps)
        if i % 2 == 1 or i == len(segs) - 1:
            late = last_ack_delay_ns if i == len(segs) - 1 else 0
            acks.append((free_ns + rtt_ns + late, end))
    out = []
    for t in range(0, end_ns, poll_ns):
        sent = max((e for ts, e in segs if ts <= t), default=0)
        acked = max((e for ts, e in acks if ts <= t), default=0)
        out.append(DrainReading(t, sent, acked))
    return out


def test_a_queued_upload_reads_its_link_rate() -> None:
    # w0's case: 27 KB written in 11 chunks within 9 ms onto a 10 Mbit/s link.
    writes = [(k * 800_000, 2_500) for k in range(11)]
    readings = simulate(writes, 10e6)
    assert backlog_ack_rate_bps(readings, RTT_NS) == pytest.approx(10e6, rel=0.05)
    # A 100 Mbit/s link with a dense 340 KB written in 14 ms reads 100 Mbit/s too.
    fast = simulate([(k * 1_300_000, 31_000) for k in range(11)], 100e6)
    assert backlog_ack_rate_bps(fast, RTT_NS) == pytest.approx(100e6, rel=0.08)


def test_a_slow_writer_gives_no_sample_where_the_ack_clock_reads_the_writer() -> None:
    # A fast link (100 Mbit/s) fed by a writer that compresses 3 ms per 5 KB chunk
    # (13 Mbit/s): the ACKs come at the writer's pace, not the link's.
    writes = [(k * 3 * MS, 5_000) for k in range(11)]
    readings = simulate(writes, 100e6)
    old = ack_clock_rate_bps([(r.ts_ns, r.bytes_acked) for r in readings])
    assert old is not None and old < 20e6          # the old estimate would cut this worker
    assert backlog_ack_rate_bps(readings, RTT_NS) is None


def test_a_delayed_last_ack_does_not_lower_the_rate() -> None:
    writes = [(0, 30_000)]
    readings = simulate(writes, 10e6, last_ack_delay_ns=40 * MS)
    old = ack_clock_rate_bps([(r.ts_ns, r.bytes_acked) for r in readings])
    assert old is not None and old < 0.6 * 10e6
    assert backlog_ack_rate_bps(readings, RTT_NS) == pytest.approx(10e6, rel=0.05)


def test_too_little_to_time_gives_nothing() -> None:
    assert backlog_ack_rate_bps([], RTT_NS) is None
    one_seg = simulate([(0, 1_000)], 10e6)
    assert backlog_ack_rate_bps(one_seg, RTT_NS) is None
    with pytest.raises(ValueError, match="min_rtt_ns"):
        backlog_ack_rate_bps(one_seg, -1)


def test_the_conservative_rate_is_the_window_minimum_unless_at_plan() -> None:
    assert conservative_rate_bps([], 95e6, 0.2) is None
    assert conservative_rate_bps([12e6, 7e6, 9e6], 95e6, 0.2) == 7e6
    # A link as fast as planned reads either side of the plan: not a cut.
    assert conservative_rate_bps([90e6, 80e6, 101e6], 95e6, 0.2) == 95e6
    assert conservative_rate_bps([70e6], 95e6, 0.2) == 70e6
    with pytest.raises(ValueError, match="plan_bps"):
        conservative_rate_bps([1.0], 0.0, 0.2)


def run_iterations(policy: AdaptiveRatio, rates: list[float | None]) -> list[float]:
    """The keep of each iteration's first chunk, feeding after each upload the one sample
    the worker gets (None: the upload gave no sample)."""
    keeps = []
    for i, rate in enumerate(rates):
        policy.start(340_000, r0_bps=95e6, ts_ns=i * 100)
        keeps.append(policy.keep_for_next_chunk(0).keep)
        if rate is not None:
            policy.observe(rate, i * 100 + 50)
    return keeps


def test_a_dip_is_followed_from_the_next_upload_and_held_for_the_window() -> None:
    # w0's link: 10 Mbit/s, a dip to 5 for two uploads, back to 10; one sample per upload.
    rates: list[float | None] = [10e6, 10e6, 10e6, 5e6, 5e6, 10e6, 10e6, 10e6, 10e6, 10e6]
    drain = run_iterations(AdaptiveRatio(rate_source="drain", drain_window=3, eps=0.2),
                           rates)
    assert drain[0] == 1.0                                    # nothing measured yet
    assert drain[1] == pytest.approx(10 / 95)
    assert drain[4] == pytest.approx(5 / 95)                  # the dip, one upload later
    assert drain[5:8] == pytest.approx([5 / 95] * 3)          # held while in the window
    assert drain[8] == pytest.approx(10 / 95)                 # and released after it
    # The old per-iteration window ("writes", carry_rt): one sample per iteration never
    # makes a stable pair, so the keep never leaves the plan -- the failure this replaces.
    old = run_iterations(AdaptiveRatio(rate_source="writes", carry_rt=True, eps=0.2), rates)
    assert old == [1.0] * len(rates)


def test_an_upload_without_a_sample_keeps_the_last_estimate() -> None:
    # A long (dense) upload on a slow link may show no backlogged stretch: falling back to
    # the plan there sent w0 dense for whole runs (measured 2026-11-24 22:08, p99 4.5x).
    keeps = run_iterations(AdaptiveRatio(rate_source="drain", drain_window=2, eps=0.2),
                           [8e6, None, None, None, 9e6])
    assert keeps == pytest.approx([1.0] + [8 / 95] * 4)


def test_a_fast_worker_at_its_plan_is_not_cut() -> None:
    keeps = run_iterations(AdaptiveRatio(rate_source="drain", drain_window=4, eps=0.2),
                           [97e6, 88e6, 101e6, 93e6, 99e6])
    assert keeps == [1.0] * 5


def test_drain_window_is_validated() -> None:
    cfg = cfgmod.from_dict({"adaptive": {"rate_source": "drain", "drain_window": 6}})
    assert cfg.adaptive.drain_window == 6
    with pytest.raises(cfgmod.ConfigError, match="adaptive.drain_window"):
        cfgmod.from_dict({"adaptive": {"drain_window": 0}})


def test_real_workers_log_one_drain_reading_set_per_upload(tmp_path: Path) -> None:
    """The worker's side over loopback TCP (real sockets and TCP_INFO, no Mininet, no
    shaper): every upload ends with one ``drain`` event and the run completes."""
    n, iters = 2, 6
    run_dir, rc = run_loopback(tmp_path, [
        f"net.workers={n}", f"run.iterations={iters}", "workload.hidden=64",
        "workload.chunk_bytes=8192", 'adaptive.policy="adaptive"',
        'adaptive.rate_source="drain"', 'compress.name="topk"'])
    assert rc == 0, (run_dir / "ps.log").read_text()
    ev = load_events(run_dir)
    drains = ev[ev["event"] == "drain"]
    assert len(drains) == n * iters
    assert (drains["readings"] >= 2).all()
