"""The synchronous-iteration floor: hand arithmetic and invariants."""

from __future__ import annotations

import itertools

import pytest

from analysis.bounds import sync_iteration_floor_s

BASE = dict(workers=16, gradient_bytes=2_000_000, chunks=16, up_bps=100e6, down_bps=100e6,
            compute_s=0.05)


def test_incast_row_by_hand() -> None:
    # 16 x 2 MB up at 100 Mbit/s, 1514 wire bytes per 1448 payload: 2.6770 s; the last of
    # 16 chunks down: 0.1673 s; 50 ms compute.
    up = 16 * 2_000_000 * 1514 / 1448 * 8 / 100e6
    assert sync_iteration_floor_s(**BASE) == pytest.approx(0.05 + up + up / 16)
    assert sync_iteration_floor_s(**BASE) == pytest.approx(2.894, abs=1e-3)


def test_slow_downlink_sets_the_floor() -> None:
    # A downlink 4x slower than the uplink: the first chunk's upload, then all of it down.
    up = 16 * 2_000_000 * 1514 / 1448 * 8 / 100e6
    got = sync_iteration_floor_s(**{**BASE, "down_bps": 25e6, "compute_s": 0.0})
    assert got == pytest.approx(up / 16 + 4 * up)


@pytest.mark.parametrize("key,more", [("workers", 32), ("gradient_bytes", 4_000_000),
                                      ("compute_s", 0.2), ("up_bps", 50e6),
                                      ("down_bps", 50e6), ("chunks", 4)])
def test_monotone(key: str, more: float) -> None:
    """More workers, bytes or compute, slower links or fewer chunks never lower it."""
    assert sync_iteration_floor_s(**{**BASE, key: more}) > sync_iteration_floor_s(**BASE)


def test_bounded_by_serial_and_pipelined_extremes() -> None:
    for n, c, up, down in itertools.product([1, 16], [1, 2, 64], [10e6, 1e9], [10e6, 1e9]):
        kw = dict(workers=n, gradient_bytes=1_000_000, chunks=c, up_bps=up, down_bps=down)
        wire = n * 1_000_000 * 1514 / 1448 * 8
        got = sync_iteration_floor_s(**kw)
        # No better than either direction alone, no worse than one after the other.
        assert max(wire / up, wire / down) <= got <= wire / up + wire / down + 1e-12


@pytest.mark.parametrize("key,bad", [("workers", 0), ("chunks", 0), ("up_bps", 0.0),
                                     ("down_bps", -1.0), ("gradient_bytes", -1),
                                     ("compute_s", -0.1), ("wire_per_payload", 0.9)])
def test_bad_input_names_the_argument(key: str, bad: float) -> None:
    with pytest.raises(ValueError, match=f"{key}="):
        sync_iteration_floor_s(**{**BASE, key: bad})
