"""Clock offsets by min-RTT ping-pong (``topo.clocks``): the estimator on made-up samples,
and a real ping-pong with a local stand-in for ssh. No root."""

from __future__ import annotations

import pytest

from topo.clocks import ClockOffset, best_offset, from_record, measure, offset_at


def test_the_smallest_round_trip_sets_the_offset_and_half_of_it_the_error():
    # Remote clock 5 s ahead; the second sample's 2 us round trip is the tightest.
    ahead = 5_000_000_000
    samples = [(0, ahead + 900, 10_000),       # answered late: 10 us round trip
               (20_000, ahead + 21_000, 22_000),
               (30_000, ahead + 30_500, 36_000)]
    off = best_offset(samples)
    assert off.offset_ns == ahead + 21_000 - 21_000 and off.error_ns == 1_000
    assert off.samples == 3
    # Whatever the other samples say, the truth is within the error of the best one.
    for t0, r, t1 in samples:
        assert abs((r - (t0 + t1) // 2) - off.offset_ns) <= (t1 - t0) // 2 + off.error_ns
    with pytest.raises(ValueError, match="answered before it was sent"):
        best_offset([(10, 0, 5)])
    with pytest.raises(ValueError, match="no clock samples"):
        best_offset([])


def test_a_real_ping_pong_with_this_machines_own_clock_finds_no_offset():
    off = measure(("sh", "-c"), samples=10)  # "sh -c" stands in for "ssh root@SERVER"
    assert off.samples == 10
    # The bound is what matters; its size is the load on this shared machine.
    assert abs(off.offset_ns) <= off.error_ns < 1_000_000_000
    with pytest.raises(OSError, match="clock ping-pong over false failed"):
        measure(("false",), samples=2)


def test_an_offset_moves_linearly_from_the_start_to_the_end_over_the_run():
    start = ClockOffset(offset_ns=1_000_000, error_ns=10, samples=5, at_ns=1_000)
    end = ClockOffset(offset_ns=1_000_400, error_ns=10, samples=5, at_ns=5_000)
    assert offset_at(start, None, 99) == 1_000_000
    assert offset_at(start, end, 1_000_000 + 1_000) == 1_000_000
    assert offset_at(start, end, 1_000_000 + 3_000) == 1_000_200  # half way
    assert offset_at(start, end, 1_000_000 + 9_000) == 1_000_400  # after the end: the end's
    assert offset_at(start, end, 0) == 1_000_000  # before the start: the start's
    assert from_record(start.describe()) == start
    assert from_record({"error": "ssh failed"}) is None
