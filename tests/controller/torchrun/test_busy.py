"""The busy clock that keeps a host importing torch from being judged stalled before its
ranks reach init_process_group: CPU readings in, the last busy time out; and the /proc
reader on real processes (one spinning, one asleep)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from controller.torchrun.busy import BusyClock, tree_cpu_s

S = 1_000_000_000


def test_a_host_is_busy_while_its_processes_use_a_twentieth_of_a_core() -> None:
    clock = BusyClock(window_s=1.0, fraction=0.05)
    clock.update("h", 10.0, 0)
    clock.update("h", 10.5, S // 2)  # half a window: not judged yet
    assert clock.busy_since("h") == 0
    clock.update("h", 10.5, S)  # 0.5 s of CPU in 1 s
    assert clock.busy_since("h") == S
    clock.update("h", 10.54, 2 * S)  # 0.04 of a core: idle (torchrun's agent: 0.003)
    assert clock.busy_since("h") == S
    clock.update("h", 10.6, 3 * S)  # exactly 0.06 of a core
    assert clock.busy_since("h") == 3 * S
    assert clock.busy_since("other") == 0  # never fed, never busy


def test_a_process_gone_restarts_the_window_rather_than_counting_negative_time() -> None:
    clock = BusyClock(window_s=1.0, fraction=0.05)
    clock.update("h", 5.0, 0)
    clock.update("h", 1.0, S)  # a rank exited: its CPU time left the sum
    assert clock.busy_since("h") == 0
    clock.update("h", 1.5, 2 * S)
    assert clock.busy_since("h") == 2 * S


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="window_s must be > 0"):
        BusyClock(window_s=0)
    with pytest.raises(ValueError, match="fraction in"):
        BusyClock(fraction=0)


def test_the_proc_reader_sums_a_process_and_its_children() -> None:
    """A parent asleep whose child spins: the tree's CPU grows; a sleeper's does not."""
    parent = subprocess.Popen(["sh", "-c", "sh -c 'while :; do :; done' & echo $!; sleep 30"],
                              stdout=subprocess.PIPE, text=True)
    sleeper = subprocess.Popen(["sleep", "30"])
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        before = tree_cpu_s({"spin": parent.pid, "sleep": sleeper.pid})
        time.sleep(1.0)
        after = tree_cpu_s({"spin": parent.pid, "sleep": sleeper.pid, "gone": 2**22 + 7})
        # Even at a load of 12 on 2 cores the spinning child gets a sixth of a core.
        assert after["spin"] - before["spin"] > 0.1, (before, after)
        assert after["sleep"] - before["sleep"] < 0.03, (before, after)
        assert after["gone"] == 0.0
    finally:
        os.kill(child, signal.SIGKILL)
        for p in (parent, sleeper):
            p.kill()
            p.wait()
