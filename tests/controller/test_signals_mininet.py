"""SIGHUP, SIGTERM and SIGINT at any moment of a run, and again while it finishes, leave a
loadable run directory whose summary names the signal, exit 128+n, and leave no network,
agent, control socket or registry entry behind (controller/signals.py), in real Mininet.
A run stopped mid-training keeps what it trained, converted to Parquet as a finished run's."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pandas as pd
import pytest

from agents.net.control import control_path
from analysis.load import load_run
from controller import rundir
from tests.support.mininet_run import leftovers, start_run, wait_for_iterations

pytestmark = pytest.mark.mininet


def _run_dir_appears(out: Path, timeout_s: float = 600) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = list(out.glob("*/run.log"))
        if found and found[0].stat().st_size > 0:
            return found[0].parent
        time.sleep(0.02)
    raise AssertionError("no run directory appeared")


@pytest.mark.parametrize("when, signals", [
    ("training", [signal.SIGHUP]),                      # a closed terminal
    ("setup", [signal.SIGTERM]),                        # while the network is being built
    ("training", [signal.SIGINT, signal.SIGTERM, signal.SIGTERM, signal.SIGINT]),  # impatient
])
def test_a_signal_leaves_a_complete_run_and_nothing_else(tmp_path: Path, when: str,
                                                         signals: list[int]) -> None:
    proc = start_run("configs/test_tiny.toml", ["run.iterations=100000"], tmp_path)
    run_dir = wait_for_iterations(tmp_path, proc, 3) if when == "training" \
        else _run_dir_appears(tmp_path)
    for s in signals:
        proc.send_signal(s)
        time.sleep(0.3)  # the later ones land in the teardown and the finalisation
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 128 + signals[0], err[-3000:]
    run = load_run(run_dir)
    assert run.summary["stop_reason"] == f"interrupted by {signal.Signals(signals[0]).name}"
    assert run.summary["interrupted"] is True
    if when == "training":  # what it trained before the signal is kept, in Parquet
        assert 3 <= run.summary["iterations"] < 100000, run.summary
        assert (run.events["event"] == "iter_done").sum() >= 3
        assert list((run_dir / "events").glob("*.parquet"))
        pd.read_parquet(run_dir / "links.parquet")
    assert not control_path(run_dir).exists()
    assert not (rundir.ACTIVE_DIR / f"{run_dir.name}.json").exists()
    assert not list(run_dir.rglob("*.tmp"))
    assert leftovers() == []
