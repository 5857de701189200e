"""End to end in real Mininet: ``gradbed run`` trains, writes a complete run directory,
and leaves nothing behind -- also when interrupted with SIGINT mid-run."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from tests.support.mininet_run import REPO, events, gradbed_run, leftovers, summary

pytestmark = pytest.mark.mininet

SUMMARY_KEYS = {"workers", "iterations", "wall_s", "iter_time_s_p50", "iter_time_s_p99",
                "bytes_up", "bytes_down", "final_loss", "final_accuracy",
                "bottleneck_utilization", "jain_fairness"}


def test_two_worker_run_learns_and_cleans_up(tmp_path):
    run_dir, proc = gradbed_run("configs/digits.toml",
                                ["net.workers=2", "run.iterations=20", "run.eval_every=5"],
                                tmp_path, report=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # What a user opens first: the page, with the run's figures and its timeline.
    page = (run_dir / "report" / "index.html").read_text(encoding="utf-8")
    assert f"Run {run_dir.name}" in page and "Iteration time CDF" in page
    assert page.count("data:image/png;base64,") >= 5 and 'class="gb-timeline"' in page
    s = summary(run_dir)
    assert SUMMARY_KEYS <= s.keys(), SUMMARY_KEYS - s.keys()
    assert s["iterations"] == 20 and s["workers"] == 2
    for f in ("config.toml", "meta.json", "links.parquet", "run.log"):
        assert (run_dir / f).exists(), f
    ev = events(run_dir)
    evals = ev[ev["event"] == "eval"].sort_values("iter")
    assert evals["loss"].iloc[-1] < evals["loss"].iloc[0] - 0.3, evals[["iter", "loss"]]
    assert s["final_accuracy"] > 0.6
    links = pd.read_parquet(run_dir / "links.parquet")
    assert (links["direction"] == "up").sum() > 10 and links["sent_bytes"].max() > s["bytes_up"] / 2
    assert "$ tc " in (run_dir / "run.log").read_text()  # every tc command is echoed
    assert not (run_dir / "secret").exists()
    assert leftovers() == []


def test_sigint_mid_run_leaves_a_loadable_directory_and_no_state(tmp_path):
    argv = [sys.executable, "-m", "controller.cli", "run", str(REPO / "configs/digits.toml"),
            "--out", str(tmp_path), "--no-progress", "--set", "net.workers=2",
            "--set", "run.iterations=500"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 90
    ps_events = None
    while time.monotonic() < deadline:
        found = list(Path(tmp_path).glob("digits-*/events/ps.jsonl"))
        if found and found[0].read_text().count('"ps_iter_done"') >= 3:
            ps_events = found[0]
            break
        time.sleep(0.2)
    assert ps_events is not None, "the run never got going"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    run_dir = Path(out.strip().splitlines()[-1])
    s = summary(run_dir)
    assert s["interrupted"] is True and 3 <= s["iterations"] < 500
    ev = events(run_dir)  # Parquet written and loadable
    assert (ev["event"] == "iter_done").sum() >= 3
    pd.read_parquet(run_dir / "links.parquet")
    assert leftovers() == []
