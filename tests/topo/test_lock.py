"""The network lock cannot be taken by another user (topo/lock.py): its file is 0600 in a
root-owned folder, so a user who opens it to flock it is refused and ``gradbed cleanup``
is not blocked; a message names the live process that holds the lock, never a stale pid
left in the file."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from topo.lock import DEFAULT_LOCK_PATH, LockTimeout, NetLock

pytestmark = pytest.mark.netlock  # one test cleans the machine and takes the real lock

REPO = Path(__file__).resolve().parents[2]
ROOT_AND_SETPRIV = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                      reason="needs root, and setpriv to act as another user")
HOLD = ("import fcntl, sys, time\n"
        "f = open(sys.argv[1])\n"                    # read-only: flock needs no more
        "fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n")


def gradbed(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "controller.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=700)


@ROOT_AND_SETPRIV
def test_another_user_cannot_take_the_network_lock() -> None:
    # As an older gradbed left it: readable by everyone. A cleanup (waiting for any run in
    # progress) opens it as gradbed keeps it now.
    if os.path.exists(DEFAULT_LOCK_PATH):
        os.chmod(DEFAULT_LOCK_PATH, 0o644)
    assert gradbed("cleanup", "-q", "--wait-s", "600").returncode == 0
    st = os.stat(DEFAULT_LOCK_PATH)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
    folder = os.stat(os.path.dirname(DEFAULT_LOCK_PATH))
    assert folder.st_uid == 0 and not folder.st_mode & 0o022
    hostile = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                sys.executable, "-c", HOLD, DEFAULT_LOCK_PATH],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = hostile.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        hostile.kill()
        hostile.communicate()
        pytest.fail("another user holds the network lock")
    assert hostile.returncode != 0 and "PermissionError" in err, (out, err)
    p = gradbed("cleanup", "--wait-s", "5")
    assert p.returncode == 0, p.stderr


def test_a_message_names_the_live_holder_not_a_stale_pid(tmp_path: Path) -> None:
    path = str(tmp_path / "gb" / "net.lock")
    with NetLock(path):
        pass  # made as gradbed makes it
    Path(path).write_text("999999")  # what a holder long gone wrote
    holder = subprocess.Popen([sys.executable, "-c", HOLD, path], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with pytest.raises(LockTimeout) as info:
            NetLock(path, timeout_s=0.3).acquire()
        assert time.monotonic() - t0 < 5
        assert f"pid {holder.pid} (python" in str(info.value)
        assert "999999" not in str(info.value)
    finally:
        holder.kill()
        holder.wait()
    with NetLock(path, timeout_s=5) as lock:  # the kernel released it with its holder
        assert lock.held
