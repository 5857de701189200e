"""``topo.cleanup``'s folders of shared ssh connections (``topo.cluster``): a dead
controller's are removed with the ssh processes still using them; a live one's, and one
whose owner cannot be told, stay. Real processes, a temporary folder in place of /tmp."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from topo.cleanup import ssh_dir_owner, stale_ssh_dirs


def test_a_folder_names_its_owner() -> None:
    assert ssh_dir_owner("gbssh-4711-ab_c9") == 4711
    for other in ("gbssh-ab_c9xyz", "gbssh-47x-a", "gbssh--a", "other-4711-a", "gbssh-١-a"):
        assert ssh_dir_owner(other) is None


def test_only_a_dead_controller_s_folder_and_its_ssh_processes_go(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid nobody has now
    gone = tmp_path / f"gbssh-{dead.pid}-x1"
    live = tmp_path / f"gbssh-{os.getpid()}-x2"
    legacy = tmp_path / "gbssh-oldstyle"  # before the pid was in the name: left alone
    for d in (gone, live, legacy):
        d.mkdir()
    # A connection master of the dead controller, still persisting, and a live one's: one
    # process each that carries ssh's arguments and never forks (a shell running `sleep`
    # forks, and its child holds the shell's arguments until it execs, which a scan under
    # load can see as a second user of the folder).
    def stand_in(folder: Path) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "ssh",
                                 "-o", f"ControlPath={folder}/%C"])

    master, mine = stand_in(gone), stand_in(live)
    try:
        lines = stale_ssh_dirs(str(tmp_path))
        assert lines == [f"removed {gone} (ssh connections of dead controller pid "
                         f"{dead.pid}, 1 ssh process(es) stopped)"]
        assert master.wait(timeout=5) != 0
        assert mine.poll() is None
        assert not gone.exists() and live.is_dir() and legacy.is_dir()
        assert stale_ssh_dirs(str(tmp_path)) == []  # idempotent
    finally:
        for p in (master, mine):
            p.kill()
            p.wait()
