"""A worker's own uplink rate, timed by its ACKs while its upload is provably queued
(sans-I/O).

The adaptive keep ratio (DESIGN.md 1.1, seeds/004) needs the rate of *this worker's* link.
Two earlier estimates did not give it on ``configs/heterogeneous.toml`` (docs/fidelity.md):
``bytes_acked`` deltas ``sample_ms`` apart while the gradient is written see no second
reading on a short compressed upload; and the ACK clock of a whole upload (first to last
rise of ``bytes_acked``) reads whatever paced the bytes: the link, but also a slow writer
(compression between chunks), a congestion window smaller than the upload, or a delayed
last ACK, so fast workers read far below their link and cut for nothing.

**When ACKs time the link.** A byte's ACK comes back about ``min_rtt`` after the byte left
the bottleneck queue (here the sender's own uplink). If every byte acknowledged between two
readings at ``t1`` and ``t2`` had already been handed to TCP by ``t1 - min_rtt``, the queue
in front of the link was never empty over that stretch: the link, and nothing else, set the
pace of those ACKs. So, from readings ``(ts_ns, bytes_sent, bytes_acked)`` taken while a
worker uploads (``tcpi_bytes_sent``, ``tcpi_bytes_acked``):

- the *rises* are the readings at which ``bytes_acked`` grew;
- the span ends at the last rise that leaves at least ``tail_bytes`` of the upload
  unacknowledged (the receiver may hold the final odd segment's ACK back, delayed-ACK
  style, so the last ACK is not the link's);
- the span starts at the earliest rise ``t1`` with
  ``bytes_sent(t1 - min_rtt) >= bytes_acked(end)`` (``bytes_sent(t)``: the last reading at
  or before ``t``; the earliest reading before that);

    backlog_ack_rate_bps = 8 x (acked_end - acked_start) / (t_end - t_start)

A worker whose writes, window or receiver were slower than its link never meets the start
condition and gives no sample, rather than a low one. A fast link that drains the upload
in about one RTT gives a short span or none, and keeps the plan.

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
                         tail_bytes: int = 2 * MSS_BYTES, min_span_ns: int = 2_000_000,
                         min_bytes: int = 2 * MSS_BYTES) -> float | None:
    """The link's rate from the ACKs of a backlogged stretch of ``readings`` (time order),
    in bit/s; see the module docstring for the span and the formula. None when no stretch
    qualifies, or it lasts under ``min_span_ns`` or carries under ``min_bytes``."""
    if min_rtt_ns < 0:
        raise ValueError(f"min_rtt_ns={min_rtt_ns}: must be >= 0")
    if not readings:
        return None
    target = readings[-1].bytes_sent
    rises = [b for a, b in zip(readings, readings[1:], strict=False)
             if b.bytes_acked > a.bytes_acked and b.bytes_acked <= target - tail_bytes]
    if len(rises) < 2:
        return None
    end = rises[-1]
    times = [r.ts_ns for r in readings]

    def sent_by(ts_ns: int) -> int:
        i = bisect_right(times, ts_ns) - 1
        return readings[max(i, 0)].bytes_sent

    start = next((r for r in rises if sent_by(r.ts_ns - min_rtt_ns) >= end.bytes_acked), end)
    span_ns = end.ts_ns - start.ts_ns
    acked = end.bytes_acked - start.bytes_acked
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
