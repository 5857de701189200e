"""Each server's network lock (``topo.server_lock``): the order every run takes them in,
the holder process and its protocol, and every way a lock is let go. The holder runs
here through ``sh -c`` in place of ssh (the fake servers' test, over real ssh, is in
``test_cluster_mininet.py``); real processes and real flocks on a file of the test's."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from topo.lock import LockTimeout, NetLock
from topo.server_lock import LockSet, ServerLock, lock_order

LOCAL_SH = ["sh", "-c"]


def test_servers_are_locked_in_the_numeric_order_of_their_addresses():
    addresses = {"b": "10.0.0.10", "a": "10.0.0.9", "localhost": "10.0.0.254",
                 "c": "192.168.1.1", "odd": "not-an-address"}
    assert lock_order(addresses) == ["a", "b", "localhost", "c", "odd"]
    # The same set in any order of the config gives the same order: no two runs cross.
    assert lock_order(dict(reversed(list(addresses.items())))) == lock_order(addresses)


class _Recorder:
    def __init__(self, name: str, log: list[str], fail: bool = False) -> None:
        self.name, self.log, self.fail = name, log, fail

    def acquire(self) -> None:
        if self.fail:
            raise LockTimeout(f"{self.name} is held")
        self.log.append(f"+{self.name}")

    def release(self) -> None:
        self.log.append(f"-{self.name}")


def test_a_lock_set_releases_what_it_took_when_a_later_lock_fails():
    log: list[str] = []
    with LockSet([_Recorder("a", log), _Recorder("b", log)]):
        assert log == ["+a", "+b"]
    assert log == ["+a", "+b", "-b", "-a"]  # reverse order
    log.clear()
    with pytest.raises(LockTimeout, match="c is held"):
        LockSet([_Recorder("a", log), _Recorder("b", log), _Recorder("c", log, fail=True)]
                ).acquire()
    assert log == ["+a", "+b", "-b", "-a"]


class _SlowToLetGo(ServerLock):
    """A holder (run here by ``sh``) that takes ``linger_s`` to end once its pipe closes,
    as a far server's ssh session takes its round trip."""

    def __init__(self, name: str, linger_s: float) -> None:
        super().__init__(name, LOCAL_SH, timeout_s=5)
        self.linger_s = linger_s

    def command(self) -> str:
        return f"echo locked; cat >/dev/null; sleep {self.linger_s}"


def test_a_lock_set_lets_every_server_go_at_once():
    linger_s = 2.0
    locks = LockSet([_SlowToLetGo(f"s{i}", linger_s) for i in range(3)])
    locks.acquire()
    t0 = time.monotonic()
    locks.release()
    took_s = time.monotonic() - t0
    # One after another would take 3 x 2 s: the holders end side by side.
    assert linger_s <= took_s < 2 * linger_s, took_s
    assert not any(lock.held for lock in locks.locks if isinstance(lock, ServerLock))


def _free(path: Path) -> bool:
    try:
        NetLock(str(path), timeout_s=0).acquire()
    except LockTimeout:
        return False
    return True


def test_the_holder_keeps_the_lock_until_its_pipe_closes_and_names_its_run(tmp_path):
    path = tmp_path / "locks" / "net.lock"
    first = ServerLock("s1", LOCAL_SH, timeout_s=5, who="run A", lock_path=str(path))
    first.acquire()
    assert first.held
    seen: list[str] = []
    second = ServerLock("s1", LOCAL_SH, timeout_s=1, who="run B", lock_path=str(path),
                        log=seen.append)
    with pytest.raises(LockTimeout, match=r"server s1: its network lock was not taken: .*"
                                          r"run A"):
        second.acquire()
    assert any("waiting for another gradbed network" in s and "run A" in s for s in seen)
    first.release()
    assert not first.held
    second.timeout_s = 5
    second.acquire()  # free again
    second.release()
    assert _free(path)


def test_a_killed_owner_lets_the_lock_go(tmp_path):
    """The controller killed with SIGKILL: its pipe to the holder closes with it."""
    path = tmp_path / "locks" / "net.lock"
    owner = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\nfrom topo.server_lock import ServerLock\n"
         f"ServerLock('s1', ['sh', '-c'], 5, who='doomed', lock_path={str(path)!r}).acquire()\n"
         "print('held', flush=True)\ntime.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    assert owner.stdout is not None and owner.stdout.readline().strip() == "held"
    assert not _free(path)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 10
    while not _free(path):
        assert time.monotonic() < deadline, "the lock outlived its owner"
        time.sleep(0.1)
