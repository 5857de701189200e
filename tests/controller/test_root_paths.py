"""Nothing root does follows a user's file (controller/rundir.py, controller/cleanup.py):
``sudo gradbed cleanup DIR`` removes only what it derives from the run's name, never the
path a file in DIR names, refuses a DIR that is a link or belongs to another user, and a
run directory is never made in a folder another user owns."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from controller import rundir

REPO = Path(__file__).resolve().parents[2]
USER = 65534
pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as sudo would"),
              pytest.mark.netlock]  # ``gradbed cleanup`` waits for the network lock


def sudo_cleanup(*dirs: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "SUDO_UID": str(USER), "SUDO_GID": str(USER)}
    return subprocess.run([sys.executable, "-m", "controller.cli", "cleanup", "--wait-s", "600",
                           *map(str, dirs)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=700)


def test_cleanup_removes_no_file_a_run_directory_names(tmp_path: Path) -> None:
    victim = tmp_path / "root-only" / "precious"
    victim.parent.mkdir()
    victim.write_text("root's")
    run = tmp_path / "mine" / "tiny-20260101-000000-abcd"
    (run / "events").mkdir(parents=True)
    (run / "control.path").write_text(f"{victim}\n")  # the user's note: "my socket is there"
    (run / "secret").symlink_to(victim)
    for p in (run.parent, run, run / "events", run / "control.path"):
        os.chown(p, USER, USER, follow_symlinks=False)
    p = sudo_cleanup(run)
    assert p.returncode == 0, p.stderr
    assert victim.read_text() == "root's"
    assert not (run / "secret").is_symlink() and not (run / "control.path").exists()
    # What cleanup wrote as root is the user's, as a finished sudo run's files are.
    assert (run / "summary.json").stat().st_uid == USER


def test_cleanup_refuses_a_link_and_another_users_folder(tmp_path: Path) -> None:
    target = tmp_path / "etc-like"
    (target / "events").mkdir(parents=True)
    link = tmp_path / "run-link"
    link.symlink_to(target)
    theirs = tmp_path / "theirs"
    (theirs / "run" / "events").mkdir(parents=True)
    os.chown(theirs, 4242, 4242)  # neither root nor the user who ran sudo
    p = sudo_cleanup(link, theirs / "run")
    assert p.returncode == 0, p.stderr
    assert f"{link}: not finished: not a gradbed run directory" in p.stdout
    assert f"{theirs / 'run'}: not finished: {theirs} belongs to uid 4242" in p.stdout
    assert not (target / "summary.json").exists()
    assert not (theirs / "run" / "summary.json").exists()


def test_no_run_directory_in_another_users_folder(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUDO_UID", str(USER))
    monkeypatch.setenv("SUDO_GID", str(USER))
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 4242, 4242)
    with pytest.raises(PermissionError, match="belongs to uid 4242"):
        rundir.create(theirs, "tiny")
    assert list(theirs.iterdir()) == []
    made = rundir.create(tmp_path / "mine", "tiny")
    assert (made / "events").is_dir() and not made.is_symlink()
