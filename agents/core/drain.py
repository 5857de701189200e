"""A worker's own uplink rate, timed by its ACKs while its upload is provably queued
(sans-I/O).

The adaptive keep ratio (DESIGN.md 1.1, seeds/004) needs the rate of *this worker's* link.
Two earlier estimates did not give it on ``configs/heterogeneous.toml`` (docs/fidelity.md):
``bytes_acked`` deltas ``sample_ms`` apart while the gradient is written see no second
reading on a short compressed upload; and the ACK clock of a whole upload (first to last
rise of ``bytes_acked``) reads whatever paced the bytes: the link, but also a slow writer
(compression between chunks), a congestion window smaller than the upload, or a delayed
last ACK, so fast workers read far below their link and cut for nothing.

**When ACKs time the link.** gradbed's uplink shaper sits on the sender's own interface,
and TCP hands an upload to it at once (GSO segments, TCP small queues' allowance): bytes
``tcpi_bytes_sent`` counts are queued in front of the link or beyond it. A byte's ACK comes
back about ``min_rtt`` after the byte left that queue, so ``bytes_acked(t + min_rtt)`` is
what had left the queue by ``t``. From readings ``(ts_ns, bytes_sent, bytes_acked)`` taken
while a worker uploads, the interval between readings ``i`` and ``i+1`` was *backlogged*
(the queue never ran dry, so the link and nothing else set the pace) when

    bytes_sent(t_i) - bytes_acked(t_{i+1} + min_rtt) >= margin_bytes

(two segments by default: a receiver may hold one ACK back, delayed-ACK style; a value
after the last reading is unknown, and the interval does not count). Over the longest run
of backlogged intervals, ``t_a`` to ``t_b``:

    backlog_ack_rate_bps = 8 x (acked_last_rise - acked_first_rise)
                           / (t_last_rise - t_first_rise)

over the readings in ``[t_a + min_rtt, t_b + min_rtt]`` at which ``bytes_acked`` rose
(``bytes_acked(t)`` above: the last reading at or before ``t``; timing rise to rise keeps an
ACK's size from quantising the ends). A writer slower than its link
(compression between chunks), a congestion window or receiver window that held bytes back
(they are then not yet "sent"), or a delayed last ACK never make an interval backlogged,
so they give no sample rather than a low one.

**The estimate the keep is planned on** (:func:`conservative_rate_bps`) is the minimum of
the last ``window`` samples, carried across iterations: a dip lowers the keep from the next
upload on and holds it for ``window`` uploads, so the worker under-sends rather than
over-sends while its link wanders (the p99 target is about the dips). A minimum within
``eps`` of the plan counts as the plan itself: a flow on a link as fast as planned reads a
little either side of it, and cutting it for that would slow training for nothing.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MSS_BYTES = 1448  # a full-size TCP payload at a 1500-byte MTU with timestamps


@dataclass(frozen=True)
class DrainReading:
    """One ``TCP_INFO`` reading of the upload connection: ``tcpi_bytes_sent`` (bytes handed
    to IP, retransmissions included) and ``tcpi_bytes_acked``, at ``ts_ns``."""

    ts_ns: int
    bytes_sent: int
    bytes_acked: int


def backlog_ack_rate_bps(readings: Sequence[DrainReading], min_rtt_ns: int,
                         margin_bytes: int = 2 * MSS_BYTES, min_span_ns: int = 2_000_000,
                         min_bytes: int = 2 * MSS_BYTES) -> float | None:
    """The link's rate over the longest backlogged stretch of ``readings`` (time order), in
    bit/s; see the module docstring for the test and the formula. None when no stretch
    qualifies, or it lasts under ``min_span_ns`` or carries under ``min_bytes``."""
    if min_rtt_ns < 0:
        raise ValueError(f"min_rtt_ns={min_rtt_ns}: must be >= 0")
    times = [r.ts_ns for r in readings]

    def acked_at(ts_ns: int) -> int | None:
        if not readings or ts_ns > times[-1]:
            return None  # after the last reading: not known
        i = bisect_right(times, ts_ns) - 1
        return readings[max(i, 0)].bytes_acked

    best: tuple[int, int] | None = None
    start: int | None = None
    for i in range(len(readings) - 1):
        left = acked_at(times[i + 1] + min_rtt_ns)
        if left is None or readings[i].bytes_sent - left < margin_bytes:
            start = None
            continue
        start = i if start is None else start
        if best is None or times[i + 1] - times[start] > times[best[1]] - times[best[0]]:
            best = (start, i + 1)
    if best is None:
        return None
    # Time the ACKs from rise to rise inside the stretch, so that an ACK's size (two
    # segments) does not quantise the span's ends.
    lo, hi = times[best[0]] + min_rtt_ns, times[best[1]] + min_rtt_ns
    rises = [b for a, b in zip(readings, readings[1:], strict=False)
             if b.bytes_acked > a.bytes_acked and lo <= b.ts_ns <= hi]
    if len(rises) < 2:
        return None
    span_ns = rises[-1].ts_ns - rises[0].ts_ns
    acked = rises[-1].bytes_acked - rises[0].bytes_acked
    if span_ns < min_span_ns or acked < min_bytes:
        return None
    return 8e9 * acked / span_ns


def conservative_rate_bps(samples: Iterable[float], plan_bps: float,
                          eps: float) -> float | None:
    """The rate the next upload is planned on: the minimum of ``samples`` (the last few
    link rates), or ``plan_bps`` when that minimum is within ``eps`` of the plan or above
    it (a link as fast as planned is not cut). None without samples."""
    if plan_bps <= 0.0:
        raise ValueError(f"plan_bps={plan_bps}: must be > 0")
    low = min(samples, default=None)
    if low is None:
        return None
    if low < 0.0:
        raise ValueError(f"rate sample {low}: must be >= 0")
    return plan_bps if low >= (1.0 - eps) * plan_bps else low
