"""The controller samplers' shared periodic loop (controller/sampler.py): a fixed grid,
no burst of catch-up reads after a stall, a read that raises ends the loop with its
message kept, and the first and last reads are taken when the run starts and stops it. Both samplers (links.parquet, classes.parquet) are this loop."""

from __future__ import annotations

import time

import pytest

from controller.class_sampler import ClassSampler
from controller.run import LinkSampler
from controller.sampler import PeriodicSampler


class _Recorder(PeriodicSampler):
    def __init__(self, period_s: float, stall_at: int, stall_s: float, fail_at: int) -> None:
        super().__init__("test-sampler", period_s)
        self.ts: list[float] = []
        self.stall_at, self.stall_s, self.fail_at = stall_at, stall_s, fail_at

    def sample(self) -> None:
        self.ts.append(time.monotonic())
        if len(self.ts) == self.stall_at:
            time.sleep(self.stall_s)  # a stalled read (the cores busy elsewhere)
        if len(self.ts) == self.fail_at:
            raise OSError("device gone")


def test_loop_keeps_its_period_skips_catch_up_and_stops_on_error() -> None:
    s = _Recorder(0.01, stall_at=5, stall_s=0.1, fail_at=15)
    s.start()
    s.join(5)
    assert not s.is_alive()
    assert s.error == "device gone" and len(s.ts) == 15
    gaps = [b - a for a, b in zip(s.ts, s.ts[1:], strict=False)]
    assert gaps[4] >= 0.1  # the stall
    # After the stall the grid restarts: no burst of ~10 reads at once to catch up.
    assert min(gaps[5:]) >= 0.005, gaps


def test_stop_event_ends_the_loop_and_bad_periods_are_refused() -> None:
    s = _Recorder(0.005, stall_at=0, stall_s=0, fail_at=10**9)
    s.start()
    time.sleep(0.05)
    s.stop_event.set()
    s.join(2)
    assert not s.is_alive() and s.error is None and len(s.ts) >= 3


def test_a_stop_takes_one_last_read_so_the_samples_reach_the_runs_end() -> None:
    # A run's last upload window can end between two reads; without a read at the stop
    # its end lies past the last sample and the window is left out (agent_limited null).
    s = _Recorder(60.0, stall_at=0, stall_s=0, fail_at=10**9)
    s.start()
    time.sleep(0.05)
    stopped = time.monotonic()
    s.stop_event.set()
    s.join(2)
    assert not s.is_alive() and s.error is None
    assert len(s.ts) == 2 and s.ts[-1] >= stopped, s.ts
    with pytest.raises(ValueError, match="test-sampler: period_s=0"):
        _Recorder(0, 0, 0, 0)
    assert issubclass(LinkSampler, PeriodicSampler) and issubclass(ClassSampler, PeriodicSampler)


def test_start_reads_before_it_returns_and_finish_reads_once_more() -> None:
    # A run's first window may begin before the thread is first scheduled (a busy
    # machine): the first read is the caller's, so the samples begin before the agents.
    s = _Recorder(60.0, stall_at=0, stall_s=0, fail_at=10**9)
    before = time.monotonic()
    s.start()
    assert len(s.ts) == 1 and s.ts[0] >= before
    s.finish()
    assert not s.is_alive() and len(s.ts) == 2 and s.error is None
    s.finish()  # idempotent
    assert len(s.ts) == 2
