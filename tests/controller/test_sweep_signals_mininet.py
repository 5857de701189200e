"""``gradbed sweep`` stopped by SIGHUP (its terminal closed), in real Mininet: the run under
way is stopped cleanly and says so, the sweep's table keeps it, nothing is left behind,
and the sweep's exit status is 128 + SIGHUP."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from analysis.load import load_run
from tests.support.mininet_run import REPO, leftovers

pytestmark = pytest.mark.mininet


def test_sighup_stops_the_sweep_and_leaves_a_loadable_run(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "controller.cli", "sweep", str(REPO / "configs/test_tiny.toml"),
         "--grid", "run.seed=1,2", "--set", "run.iterations=100000", "--out", str(tmp_path),
         "--no-progress", "--no-report"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not any(p.read_text().count('"ps_iter_done"') >= 3
                  for p in tmp_path.glob("sweep-*/*/events/ps.jsonl")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
        time.sleep(0.1)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 128 + signal.SIGHUP, err[-3000:]
    (run_dir,) = [p.parents[1] for p in tmp_path.glob("sweep-*/*/events/ps.jsonl")]
    s = load_run(run_dir).summary
    assert s["stop_reason"] == "interrupted by SIGHUP", s["stop_reason"]
    (table,) = tmp_path.glob("sweep-*/sweep.md")
    assert "interrupted" in table.read_text(), table.read_text()
    assert leftovers() == []
