"""The PS's weight sends as spans (agents/dp/weight_sends.py), pure: a send opens with the
iteration's first chunk queued and closes once the kernel has taken every byte queued up to
the iteration's last chunk, never before; a lost worker's sends never close."""

from __future__ import annotations

from agents.dp.weight_sends import WeightSend, WeightSends


def test_a_send_ends_when_the_kernel_took_the_last_chunks_last_byte() -> None:
    s = WeightSends()
    s.queued(0, 5, 100, 100, last=False, now_ns=10)
    s.queued(1, 5, 100, 100, last=False, now_ns=11)
    assert s.finished({0: 100, 1: 100}, 12) == []  # the last chunk is not even queued
    s.queued(0, 5, 60, 160, last=True, now_ns=20)
    s.queued(1, 5, 60, 160, last=True, now_ns=21)
    assert s.finished({0: 159, 1: 160}, 30) == [WeightSend(1, 5, 11, 30, 160)]
    assert s.finished({0: 160, 1: 160}, 40) == [WeightSend(0, 5, 10, 40, 160)]
    assert s.finished({0: 500, 1: 500}, 50) == []  # each send closes once


def test_the_next_iteration_waits_behind_an_unfinished_one_and_a_lost_worker_is_dropped(
        ) -> None:
    s = WeightSends()
    s.queued(0, 1, 50, 50, last=True, now_ns=1)
    s.queued(0, 2, 50, 100, last=True, now_ns=2)
    assert [x.iteration for x in s.finished({0: 60}, 3)] == [1]
    assert [(x.iteration, x.start_ns) for x in s.finished({0: 100}, 4)] == [(2, 2)]
    s.queued(3, 7, 10, 10, last=True, now_ns=5)
    s.forget(3)
    assert s.finished({3: 10}, 6) == []
