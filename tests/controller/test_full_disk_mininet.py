"""A run directory whose file system fills up mid-run still ends with its summary
(controller/rundir.py: a provisional summary first, room kept for the final one, every
other file best effort), no temporary file and no registry entry left, in real Mininet
with a small tmpfs as ``--out``."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from analysis.load import load_run
from controller import rundir
from tests.support.mininet_run import leftovers, start_run, wait_for_iterations

pytestmark = pytest.mark.mininet


def _fill(folder: Path) -> None:
    with open(folder / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:  # ENOSPC: the file system is full
            pass


def test_a_full_disk_mid_run_still_leaves_a_summary(tmp_path: Path) -> None:
    out = tmp_path / "small"
    out.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(out)], check=True)
    try:
        proc = start_run("configs/test_tiny.toml",
                         ["run.iterations=100000", "run.timeout_s=40"], out)
        run_dir = wait_for_iterations(out, proc, 3)
        _fill(out)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode in (4, 5), (proc.returncode, err[-3000:])  # lost or timed out
        s = load_run(run_dir).summary
        assert not s.get("provisional") and s["stop_reason"] != rundir.RUNNING, s
        assert s["iterations"] >= 3
        assert not list(run_dir.rglob("*.tmp")) and not list(run_dir.rglob(".*.tmp"))
        assert not (rundir.ACTIVE_DIR / f"{run_dir.name}.json").exists()
        assert leftovers() == []
    finally:
        subprocess.run(["umount", "-l", str(out)], check=False)
