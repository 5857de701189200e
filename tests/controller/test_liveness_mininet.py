"""Every agent's liveness, in real Mininet: a hung (SIGSTOP'ed) agent is declared lost after
``run.stall_timeout_s`` of silence on the control channel, whatever its role, and a killed
pipeline stage ends the run at once with the lost-agent status (4), naming the agent,
instead of leaving its peers waiting until ``run.timeout_s``."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from analysis.load import load_run
from tests.support.mininet_run import (
    agent_pid,
    events,
    leftovers,
    start_run,
    wait_for_event,
    wait_for_iterations,
)

pytestmark = pytest.mark.mininet

STALL_S = 8  # the default is 10; a stage starting on a loaded 2-core machine once went 4 s silent
# A run that would go on far longer than any of these tests: only the fault ends it. (Not
# 100,000 steps: a stage builds and checks its whole schedule before it starts.)
PIPELINE = ["pipeline.stages=2", "topo.hosts=3", "pipeline.schedule='gpipe'",
            "run.iterations=400", "run.timeout_s=300", f"run.stall_timeout_s={STALL_S}"]


def _lost(run_dir: Path) -> list[dict]:
    ev = events(run_dir)
    return ev[ev["event"] == "agent_lost"].to_dict("records")


def test_a_hung_worker_is_declared_lost_and_the_run_goes_on_without_it(tmp_path: Path) -> None:
    proc = start_run("configs/test_tiny.toml", [
        "run.iterations=30", "run.on_agent_death='continue'", "run.timeout_s=120",
        f"run.stall_timeout_s={STALL_S}"], tmp_path)
    run_dir = wait_for_iterations(tmp_path, proc, 3)
    os.kill(agent_pid(run_dir, "agents.dp.worker", "--worker", "1"), signal.SIGSTOP)
    stopped_ns = time.time_ns()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    (lost,) = _lost(run_dir)
    assert lost["role"] == "worker" and "no heartbeat" in lost["reason"], lost
    assert (lost["ts_ns"] - stopped_ns) / 1e9 < STALL_S + 3, lost
    s = load_run(run_dir).summary
    assert [w["worker"] for w in s["workers_lost"]] == [1], s["workers_lost"]
    assert s["iterations"] == 30 and s["stop_reason"] == "completed", s["stop_reason"]
    assert leftovers() == []


def test_a_killed_stage_ends_the_pipeline_at_once_with_status_4(tmp_path: Path) -> None:
    proc = start_run("configs/pipeline.toml", PIPELINE, tmp_path)
    run_dir = wait_for_event(tmp_path, proc, "pp_step_done", 2)
    os.kill(agent_pid(run_dir, "agents.pipeline.stage", "--stage", "1"), signal.SIGKILL)
    killed = time.monotonic()
    _, err = proc.communicate(timeout=120)
    took_s = time.monotonic() - killed
    assert proc.returncode == 4, err[-3000:]
    (lost,) = _lost(run_dir)
    assert lost["role"] == "stage" and "exited with status -9" in lost["reason"], lost
    s = load_run(run_dir).summary
    assert s["stop_reason"] == lost["reason"], (s["stop_reason"], lost)
    assert took_s < 20, took_s  # teardown included; run.timeout_s is 120
    assert leftovers() == []


def test_a_hung_stage_is_declared_lost_and_ends_the_run_with_status_4(tmp_path: Path) -> None:
    proc = start_run("configs/pipeline.toml", PIPELINE, tmp_path)
    run_dir = wait_for_event(tmp_path, proc, "pp_step_done", 2)
    os.kill(agent_pid(run_dir, "agents.pipeline.stage", "--stage", "0"), signal.SIGSTOP)
    stopped_ns = time.time_ns()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 4, err[-3000:]
    (lost,) = _lost(run_dir)
    assert lost["role"] == "stage" and "no heartbeat" in lost["reason"], lost
    assert (lost["ts_ns"] - stopped_ns) / 1e9 < STALL_S + 3, lost
    s = load_run(run_dir).summary
    assert s["stop_reason"] == lost["reason"], s["stop_reason"]
    assert leftovers() == []
