"""End to end in real Mininet: ``gradbed run`` (as ``sudo gradbed run`` by a user) trains,
writes a complete run directory that belongs to that user, and leaves nothing behind. (Interrupted runs: test_signals_mininet.py, whose SIGINT case
also checks what an interrupted run's directory holds.)"""

from __future__ import annotations

import pandas as pd
import pytest

from tests.support import real_run
from tests.support.mininet_run import events, leftovers, summary

pytestmark = pytest.mark.mininet

SUMMARY_KEYS = {"workers", "iterations", "wall_s", "iter_time_s_p50", "iter_time_s_p99",
                "bytes_up", "bytes_down", "final_loss", "final_accuracy",
                "bottleneck_utilization", "jain_fairness"}


def test_two_worker_run_learns_and_cleans_up(tmp_path_factory: pytest.TempPathFactory) -> None:
    # The dense digits run test_compress_mininet.py compares top-k with (one run for both).
    run_dir, proc = real_run.digits_dense(tmp_path_factory.mktemp("run"))
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
    # Made with sudo by a user: all of it is the user's, the --out folder gradbed made
    # included, so the user can read, move and delete it without root.
    user = real_run.SUDO_USER_UID
    owners = {p: (p.lstat().st_uid, p.lstat().st_gid)
              for p in (run_dir.parent, run_dir, *run_dir.rglob("*"))}
    assert {p: o for p, o in owners.items() if o != (user, user)} == {}
    assert len(owners) > 20 and (run_dir / "report" / "index.html") in owners
    assert leftovers() == []
