"""``gradbed run``'s exit status tells how the run ended (controller/exit_status.py), in real
Mininet: a killed PS and a start that fails each give their own status, and the summary says
the same. (A completed run's 0: test_run_mininet.py; a run past ``run.timeout_s``, 5:
test_adaptive_run.py, whose run ends on its timeout; a signal's 128 + n:
test_signals_mininet.py.)"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from analysis.load import load_run
from tests.support.mininet_run import (
    agent_pids,
    leftovers,
    start_run,
    wait_for_iterations,
)

pytestmark = pytest.mark.mininet

LONG = ["run.iterations=100000"]


def test_a_killed_ps_exits_4_and_names_the_ps(tmp_path: Path) -> None:
    proc = start_run("configs/test_tiny.toml", LONG, tmp_path)
    run_dir = wait_for_iterations(tmp_path, proc, 3)
    pids = agent_pids(run_dir, "agents.dp.ps")
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 4, err[-3000:]
    s = load_run(run_dir).summary
    assert s["stop_reason"].startswith("ps exited with status -9"), s["stop_reason"]
    assert leftovers() == []


def test_a_start_that_fails_exits_3(tmp_path: Path) -> None:
    # A broken scikit-learn on the user's PYTHONPATH: the controller does not import it,
    # the digits workload's agents do (its data set), and die before they are ready.
    broken = tmp_path / "pylib" / "sklearn"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('this sklearn is broken')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "pylib")}
    proc = start_run("configs/test_tiny.toml", [], tmp_path / "runs", env=env)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 3, err[-3000:]
    run_dir = Path(out.strip().splitlines()[-1])
    s = load_run(run_dir).summary
    assert s["stop_reason"].startswith("failed to start: "), s["stop_reason"]
    assert "before it was ready" in s["stop_reason"]
    assert leftovers() == []
