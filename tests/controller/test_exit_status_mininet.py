"""``gradbed run``'s exit status tells how the run ended (controller/exit_status.py), in real
Mininet: a killed PS, a hung PS and a start that fails each give their own status, and the
summary says the same. (A completed run's 0: test_run_mininet.py; a run past ``run.timeout_s``, 5:
test_adaptive_run.py, whose run ends on its timeout; a signal's 128 + n:
test_signals_mininet.py.)"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import pytest

from agents.core.config import HEARTBEAT_S
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


def test_a_hung_ps_is_declared_lost_and_the_run_exits_4_naming_it(tmp_path: Path) -> None:
    # SIGSTOP: the PS's sockets stay open, so its workers would wait on the data path until
    # run.timeout_s (5); its silence on the control channel is what gives it away.
    stall_s = 6
    proc = start_run("configs/test_tiny.toml", [*LONG, f"run.stall_timeout_s={stall_s}",
                                                "run.timeout_s=300"], tmp_path)
    run_dir = wait_for_iterations(tmp_path, proc, 3)
    (pid,) = agent_pids(run_dir, "agents.dp.ps")
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    _, err = proc.communicate(timeout=120)
    took_s = time.monotonic() - stopped
    assert proc.returncode == 4, err[-3000:]
    s = load_run(run_dir).summary
    assert s["stop_reason"].startswith("ps lost: no heartbeat for "), s["stop_reason"]
    # Its last heartbeat may have come up to HEARTBEAT_S before the SIGSTOP; teardown included.
    assert stall_s - HEARTBEAT_S <= took_s < stall_s + 20, took_s
    assert leftovers() == []


def test_a_start_that_fails_exits_3(tmp_path: Path) -> None:
    # A broken scikit-learn on the user's PYTHONPATH (no digits data in it): the controller
    # does not touch it, the digits workload's agents read their data set from it, and die
    # before they are ready.
    broken = tmp_path / "pylib" / "sklearn"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('this sklearn is broken')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "pylib")}
    tmp = Path(tempfile.gettempdir())
    before = set(tmp.iterdir())
    proc = start_run("configs/test_tiny.toml", [], tmp_path / "runs", env=env)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 3, err[-3000:]
    run_dir = Path(out.strip().splitlines()[-1])
    s = load_run(run_dir).summary
    assert s["stop_reason"].startswith("failed to start: "), s["stop_reason"]
    assert "before it was ready" in s["stop_reason"]
    assert leftovers() == []
    # The PS's log names the data set it could not find. The warm process preloads no
    # scikit-learn (the digits are read from its file), so it had nothing to say: no
    # warm.log (test_warm.py keeps a failed preload's), and the run left nothing in /tmp
    # (on main at 5c16cbd: /tmp/gradbed-warm-PID-*.log, each run).
    assert "digits.csv.gz" in (run_dir / "logs" / "ps.log").read_text()
    assert not (run_dir / "warm.log").exists()
    left = [p.name for p in set(tmp.iterdir()) - before if str(proc.pid) in p.name]
    assert left == [], left
