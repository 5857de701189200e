"""Downlink link/N with catch-up: split B_down among the PS's connections by backlog, sans-I/O.

The PS is the one sender on the downlink, so link/N there is its own choice of pacing rates.
A hard ``B_down / N`` per connection is fair only while every connection keeps up: a flow
that falls behind once (a BBR ProbeRTT, a PS that lost the CPU for 100 ms) can
never catch up, because the others leave no spare rate, and the whole synchronous
iteration then waits for it. Splitting the same ``B_down`` in proportion to the bytes each
connection still has to deliver (queued plus unacknowledged) gives a laggard more and the
leaders less until all of them would finish together; with equal backlogs it is exactly
``B_down / N``. The rates always sum to ``B_down``, so the bottleneck queue sees no more
than the link/N caps would offer.
"""

from __future__ import annotations

from collections.abc import Mapping


def backlog_shares(total_bps: float, backlog_bytes: Mapping[int, int], *,
                   min_fraction: float = 0.25) -> dict[int, float]:
    """``{connection: pacing rate in bit/s}`` that sums to ``total_bps``.

    Each connection gets ``total_bps * backlog / sum(backlog)``, but never less than
    ``min_fraction`` of the equal share ``total_bps / n`` (a connection with a nearly
    empty backlog still moves its next chunk at once; the others give up the difference
    in proportion to their own shares). With no backlog anywhere the equal share is
    returned. Negative backlogs are an error: they mean the caller's byte accounting
    is wrong.
    """
    if not total_bps > 0.0:
        raise ValueError(f"total_bps={total_bps}: must be > 0")
    if not 0.0 <= min_fraction <= 1.0:
        raise ValueError(f"min_fraction={min_fraction}: must be in [0, 1]")
    if not backlog_bytes:
        return {}
    for conn, b in backlog_bytes.items():
        if b < 0:
            raise ValueError(f"backlog_bytes[{conn}]={b}: must be >= 0")
    equal = total_bps / len(backlog_bytes)
    floor = min_fraction * equal
    # The floored connections take floor each; the rest share what is left by backlog.
    # The first pass floors nobody; each pass floors those that fell under the floor.
    low: set[int] = set()
    while True:
        rest = total_bps - floor * len(low)
        high_backlog = sum(b for c, b in backlog_bytes.items() if c not in low)
        if high_backlog == 0:
            return {c: equal for c in backlog_bytes}
        out = {c: floor if c in low else rest * backlog_bytes[c] / high_backlog
               for c in backlog_bytes}
        more = {c for c in backlog_bytes if c not in low and out[c] < floor}
        if not more:
            return out
        low |= more
