"""Link/N shaping in a real run (seeds/004): caps follow membership.

Four replay workers share a 100 Mbit/s bottleneck under link/N; worker 3 leaves after
iteration 3 for good. The controller must then re-cap the remaining three at B/3 (``shape``
events) and, with more rate each, their per-iteration send time must drop. Runs the real
``gradbed run`` CLI, so it also covers config -> driver -> tc/pacing -> events end to end.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from analysis.load import load_events

pytestmark = pytest.mark.mininet

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "incast.toml"
LEAVE_ITER = 4


def gradbed_run(tmp_path: Path, *overrides: str) -> Path:
    argv = [sys.executable, "-m", "controller.cli", "run", str(CONFIG), "--no-progress",
            "--no-report", "--out", str(tmp_path)]
    for o in overrides:
        argv += ["--set", o]
    res = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return Path(res.stdout.strip().splitlines()[-1])


def run_leave(tmp_path: Path, method: str, pace_guard: float) -> tuple[pd.DataFrame, dict]:
    run_dir = gradbed_run(
        tmp_path, "net.workers=4", "net.bottleneck_mbps=100", "net.queue_bytes=1000000",
        "workload.replay_bytes=1000000", "workload.compute_ms=50", "run.iterations=8",
        f'shaping.method="{method}"', f"shaping.pace_guard={pace_guard}",
        f"membership.schedule=[[3, {LEAVE_ITER}, -1]]")
    return load_events(run_dir), json.loads((run_dir / "summary.json").read_text())


@pytest.mark.parametrize("method, pace_guard", [("tc", 0.0), ("pacing", 0.0), ("tc", 1.1)])
def test_caps_recomputed_on_leave_and_remaining_workers_speed_up(tmp_path: Path, method: str,
                                                                 pace_guard: float) -> None:
    ev, summary = run_leave(tmp_path, method, pace_guard)
    assert summary["stop_reason"] == "completed", summary
    assert not (ev["event"] == "worker_error").any(), ev[ev["event"] == "worker_error"]
    shape = ev[(ev["event"] == "shape") & (ev["reason"] == "cap")
               & (ev["direction"] == "up")].sort_values("ts_ns")
    assert (shape["method"] == method).all()
    leave_ts = int(ev[(ev["event"] == "membership") & (ev["iter"] == LEAVE_ITER)]["ts_ns"].min())
    before = shape[shape["ts_ns"] < leave_ts]
    after = shape[shape["ts_ns"] >= leave_ts]
    assert sorted(before["worker"].astype(int)) == [0, 1, 2, 3]
    assert before["rate_mbps"].to_numpy() == pytest.approx([25.0] * 4)
    assert sorted(after["worker"].astype(int)) == [0, 1, 2]
    assert after["rate_mbps"].to_numpy() == pytest.approx([100.0 / 3] * 3)
    # The downlink gets the same B/N rule (the PS paces its socket to each worker).
    down = ev[(ev["event"] == "shape") & (ev["direction"] == "down") & (ev["reason"] == "cap")]
    assert sorted(down[down["ts_ns"] < leave_ts]["worker"].astype(int)) == [0, 1, 2, 3]
    assert sorted(down[down["ts_ns"] >= leave_ts]["rate_mbps"].round(3)) == [33.333] * 3

    paced = ev[(ev["event"] == "paced") & (ev["iter"] >= LEAVE_ITER)
               & ev["node"].str.startswith("w")]
    if method == "pacing" or pace_guard:
        # Every remaining worker really applied its pacing rate on its socket: B/3, or
        # pace_guard x B/3 above its tc cap.
        assert sorted(set(paced["node"])) == ["w0", "w1", "w2"], paced
        rate = 100e6 / 3 * (pace_guard or 1.0)
        assert paced["rate_bps"].to_numpy() == pytest.approx([rate] * len(paced))
    else:
        assert paced.empty, paced
    sends = ev[(ev["event"] == "send_done") & ev["node"].isin(["w0", "w1", "w2"])]
    # Skip iteration 0 (connection warm-up) and the iteration of the change itself.
    t_before = sends[sends["iter"].between(1, LEAVE_ITER - 1)]["send_s"].median()
    t_after = sends[sends["iter"] > LEAVE_ITER]["send_s"].median()
    # Ideal ratio 25/33.3 = 0.75; allow a little for the socket buffer's share.
    assert t_after < 0.88 * t_before, (t_before, t_after)
