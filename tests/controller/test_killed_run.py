"""SIGKILL of the controller mid-run, then ``gradbed cleanup``, in real
Mininet: no process, interface, qdisc, secret or control socket is left, and the run
directory loads with a summary that says the controller was killed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agents.net.control import control_path
from analysis.load import load_run
from controller import rundir
from tests.support.mininet_run import REPO, leftovers

pytestmark = pytest.mark.mininet


def _processes_naming(text: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            found.append(f"{pid}: {cmd}")
    return found


def test_cleanup_after_sigkill_of_the_controller(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "controller.cli", "run", "configs/test_tiny.toml", "--out",
            str(tmp_path), "--no-progress", "--set", "run.iterations=2000"]
    ctl = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600  # the network lock may be another run's for a while
    run_dir = None
    while time.monotonic() < deadline and ctl.poll() is None:
        found = list(tmp_path.glob("tiny-*/events/ps.jsonl"))
        if found and found[0].read_text().count('"ps_iter_done"') >= 3:
            run_dir = found[0].parents[1]
            break
        time.sleep(0.2)
    assert run_dir is not None, "the run never got going"
    sock = control_path(run_dir)
    assert sock.exists()
    assert (rundir.ACTIVE_DIR / f"{run_dir.name}.json").exists()

    ctl.kill()  # SIGKILL: no finally, no summary, the network stays up
    ctl.wait(timeout=30)
    assert not rundir.complete(run_dir)  # only the provisional summary written at the start

    p = subprocess.run([sys.executable, "-m", "controller.cli", "cleanup", "--wait-s", "600"],
                       cwd=REPO, capture_output=True, text=True, timeout=700)
    assert p.returncode == 0, p.stderr
    assert f"{run_dir}: wrote summary.json (stop_reason: controller killed)" in p.stdout

    assert _processes_naming(str(run_dir)) == []       # agents gone, whatever they were doing
    assert leftovers() == []                           # no bridge, veth, host shell or agent
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert "gbsw" not in links, links
    assert not (run_dir / "secret").exists() and not sock.exists()
    assert not (rundir.ACTIVE_DIR / f"{run_dir.name}.json").exists()

    run = load_run(run_dir)
    assert run.summary["stop_reason"] == "controller killed"
    assert run.summary["interrupted"] is True and run.summary["iterations"] >= 3
    assert (run.events["event"] == "ps_iter_done").sum() >= 3
    assert list((run_dir / "events").glob("*.parquet"))  # converted, as a finished run's
    # Idempotent: a second cleanup finds this run finished and leaves its summary alone.
    again = subprocess.run([sys.executable, "-m", "controller.cli", "cleanup"], cwd=REPO,
                           capture_output=True, text=True, timeout=700)
    assert again.returncode == 0 and str(run_dir) not in again.stdout
    assert json.loads((run_dir / "summary.json").read_text()) == run.summary
