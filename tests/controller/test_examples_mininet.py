"""The examples and ``gradbed run --cli`` in real Mininet (root): a star run, a dumbbell
run with two background iperf3 flows on the trunk, and a star where one worker's uplink
replays the cellular trace while the others run at 100 Mbit/s."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.mininet_run import REPO, events, leftovers, summary

pytestmark = pytest.mark.mininet


def example(name: str, iterations: int, out: Path, timeout_s: float = 240
            ) -> tuple[Path, str]:
    proc = subprocess.run([sys.executable, str(REPO / "examples" / f"{name}.py"),
                           "--iterations", str(iterations), "--out", str(out), "--quiet",
                           "--no-report"],
                          capture_output=True, text=True, timeout=timeout_s, cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    return Path(lines[-1]), proc.stdout


def test_star_demo(tmp_path: Path) -> None:
    run_dir, out = example("star_demo", 6, tmp_path)
    s = summary(run_dir)
    assert s["iterations"] == 6 and s["stop_reason"] == "completed", s
    assert "up: gbsw0-eth1 (switch), 100 Mbit/s" in out
    net = json.loads((run_dir / "network.json").read_text())
    assert net["shape"] == "star" and net["points"]["down"]["dev"] == "ps-eth0"
    assert not (run_dir / "report").exists()  # --no-report: the page costs seconds a run
    assert leftovers() == []


def test_dumbbell_with_two_background_flows_on_the_trunk(tmp_path: Path) -> None:
    run_dir, out = example("dumbbell_cross_traffic", 6, tmp_path)
    s = summary(run_dir)
    assert s["iterations"] == 6 and s["stop_reason"] == "completed", s
    ev = events(run_dir)
    bg = ev[ev["event"] == "background"]
    assert list(bg["host"]) == ["bg0"] and bg["bytes"].iloc[0] > 1e6, bg
    report = json.loads((run_dir / "background" / "bg0.json").read_text())
    assert len(report["start"]["connected"]) == 2  # two flows
    assert report["start"]["connected"][0]["remote_host"] == "10.0.0.200"  # to sink0
    # Both traffics crossed the trunk's up direction (gbsw0-eth1): it sent at least the
    # gradients and the background bytes together (headers make it more).
    import pandas as pd

    links = pd.read_parquet(run_dir / "links.parquet")
    up = links[links["direction"] == "up"]
    assert set(up["dev"]) == {"gbsw0-eth1"}
    trunk_bytes = up["sent_bytes"].max() - up["sent_bytes"].min()
    assert trunk_bytes >= 0.9 * (s["bytes_up"] + bg["bytes"].iloc[0]), (trunk_bytes, s)
    assert "trunk: gbsw0-eth1 -> gbsw1-eth1, 100 Mbit/s" in out
    assert leftovers() == []


def test_one_worker_behind_a_cellular_uplink(tmp_path: Path) -> None:
    run_dir, out = example("heterogeneous_workers", 5, tmp_path)
    s = summary(run_dir)
    assert s["iterations"] == 5 and s["stop_reason"] == "completed", s
    ev = events(run_dir)
    steps = ev[(ev["event"] == "trace_step") & (ev["direction"] == "w0.up")]
    assert len(steps) >= 10 and steps["rate_mbps"].max() <= 22.0, steps
    assert not ((ev["event"] == "trace_step") & (ev["direction"] != "w0.up")).any()
    # The replayed rates reached w0's uplink HTB, and only w0's.
    import pandas as pd

    links = pd.read_parquet(run_dir / "links.parquet")
    w0 = links[links["direction"] == "w0.up"]
    assert set(w0["dev"]) == {"w0-eth0"}
    # Built at the link's 100 Mbit/s; from the trace's first step on, the trace's rates.
    replaying = w0[w0["ts_ns"] > steps["ts_ns"].min()]
    assert len(replaying) >= 10 and replaying["rate_mbps"].max() <= 22.0, replaying
    sends = ev[ev["event"] == "send_done"].groupby("node")["send_s"].median()
    others = sends.drop("w0")
    # ~10 Mbit/s against 100: w0's uploads take several times the others'.
    assert sends["w0"] >= 3 * others.max(), sends
    assert leftovers() == []


def test_cli_starts_the_network_and_exits_on_eof(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "controller.cli", "run",
                           str(REPO / "configs" / "test_tiny.toml"), "--cli"],
                          input="w0 ping -c 1 -W 2 ps\nps tc qdisc show dev ps-eth0\n",
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr  # Mininet's CLI writes its commands' output to stderr
    assert "star up, no roles started" in out and "point up" in out
    assert "1 received" in out, out[-2000:]
    assert "htb 1: root" in out, out[-2000:]
    assert leftovers() == []
