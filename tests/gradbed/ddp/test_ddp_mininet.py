"""gradbed.ddp inside ``gradbed torchrun`` on real Mininet (root): the adaptive top-k hook
with one host's uplink at a tenth of the other's finishes (no all_gather with unequal
shapes, no deadlock) and keeps fewer elements than with equal links; the instrumentation's
events land in the run directory and in ``trace.json``, and its bucket windows give each
run's ``agent_limited``. Two runs of 2 hosts (a ring's
ranks agree on the slowest rate whatever their number), no report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from controller.summary import torchrun_agent_limited
from tests.support.mininet_run import REPO, events, summary

pytestmark = pytest.mark.mininet

TRAIN = REPO / "examples" / "torchrun_ddp" / "train.py"
CONFIG = REPO / "examples" / "torchrun_ddp" / "fabric4.toml"
LINK_MBPS = 100
STEPS = 8
HOSTS = ["gbh0", "gbh1"]


def torchrun(out: Path, overrides: list[str]) -> Path:
    argv = [sys.executable, "-m", "controller.cli", "torchrun", str(CONFIG), "--out", str(out),
            "--no-progress", "--no-report", "--set", f"net.workers={len(HOSTS)}",
            "--set", "net.delay_ms=0",
            "--set", "net.loss_pct=0", "--set", f"net.worker_link_mbps={LINK_MBPS}"]
    for o in overrides:
        argv += ["--set", o]
    argv += ["--", str(TRAIN), "--steps", str(STEPS), "--hidden", "2048", "--batch", "48",
             "--hook", "topk", "--policy", "adaptive", "--instrument"]
    proc = subprocess.run(argv, cwd=out, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])


def bucket_events(run_dir: Path) -> pd.DataFrame:
    frames = [pd.read_parquet(p) for p in (run_dir / "events").glob("gbh*.parquet")]
    ev = pd.concat(frames, ignore_index=True)
    return ev[ev["event"] == "ddp_bucket"]


def test_adaptive_topk_with_one_slow_uplink_agrees_on_a_smaller_k(tmp_path: Path) -> None:
    slow_trace = tmp_path / "tenth.log"
    slow_trace.write_text("".join(f"{t}.0 {LINK_MBPS / 10}\n" for t in range(60)))
    equal = torchrun(tmp_path, ["topo.traces={}"])
    slow = torchrun(tmp_path, [f'topo.traces={{"{HOSTS[-1]}.up" = "{slow_trace}"}}'])
    keeps = {}
    for name, run_dir in (("equal", equal), ("slow", slow)):
        assert summary(run_dir)["stop_reason"] == "completed"
        ev = bucket_events(run_dir)
        assert sorted(ev["node"].unique()) == HOSTS
        late = ev[ev["iter"] >= STEPS - 3]
        # Every rank used the same keep for every bucket of an iteration.
        assert (late.groupby(["iter", "bucket"])["keep"].nunique() == 1).all(), late
        keeps[name] = float(late["keep"].mean())
        # The run's regime, over the ranks' bucket windows on the busiest access link of
        # the class samples: a reading either way (this machine's load decides which),
        # and the one the definition gives from the run's own files.
        s = summary(run_dir)
        want = torchrun_agent_limited(events(run_dir), pd.read_parquet(run_dir / "classes.parquet"),
                                      len(HOSTS), 0.0)
        assert s["agent_limited"] is not None, s["agent_limited_why"]
        assert (s["agent_limited"], s["agent_limited_why"]) == want, (s, want)
        assert "the ranks' DDP buckets" in s["agent_limited_why"]
    assert keeps["slow"] < 0.5 * keeps["equal"], keeps
    # The events are on the timeline: trace.json has the buckets' intervals.
    trace = json.loads((slow / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert any(str(n).startswith("b") for n in names), sorted(map(str, names))[:20]
    iters = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"] == "ddp_iter"]
    assert len(iters) >= len(HOSTS) * (STEPS - 1)
