"""gradbed.ddp inside ``gradbed torchrun`` on real Mininet (root): the adaptive top-k hook
with one host's uplink at a tenth of the other's finishes (no all_gather with unequal
shapes, no deadlock) and keeps fewer elements than with equal links; the instrumentation's
events land in the run directory and in ``trace.json``, and its bucket windows give each
run's ``agent_limited``. Two runs of 2 hosts (a ring's
ranks agree on the slowest rate whatever their number), no report. A third, dense at
1 Gbit/s with one rank's CPU capped by a cgroup, reads agent-limited."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import pandas as pd
import pytest

from analysis.report import regime
from controller.summary import torchrun_agent_limited
from tests.support.cpu_cap import CpuCap, cap_rank_after_event, cpu_cap_kind
from tests.support.mininet_run import REPO, events, summary

pytestmark = pytest.mark.mininet

TRAIN = REPO / "examples" / "torchrun_ddp" / "train.py"
CONFIG = REPO / "examples" / "torchrun_ddp" / "fabric4.toml"
LINK_MBPS = 100
STEPS = 8
HOSTS = ["gbh0", "gbh1"]
#: The script's arguments in the adaptive runs.
ADAPTIVE = ("--steps", str(STEPS), "--hidden", "2048", "--batch", "48", "--hook", "topk",
            "--policy", "adaptive", "--instrument")


def torchrun(out: Path, overrides: list[str], script_args: tuple[str, ...] = ADAPTIVE) -> Path:
    argv = [sys.executable, "-m", "controller.cli", "torchrun", str(CONFIG), "--out", str(out),
            "--no-progress", "--no-report", "--set", f"net.workers={len(HOSTS)}",
            "--set", "net.delay_ms=0",
            "--set", "net.loss_pct=0", "--set", f"net.worker_link_mbps={LINK_MBPS}"]
    for o in overrides:
        argv += ["--set", o]
    argv += ["--", str(TRAIN), *script_args]
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


@pytest.mark.skipif(cpu_cap_kind() is None, reason="no cgroup cpu controller")
def test_a_rank_with_its_cpu_capped_at_1gbit_is_agent_limited(tmp_path: Path) -> None:
    """Dense DDP (gradbed's recorded all_reduce) on 1 Gbit/s links, gbh0's rank held to a
    tenth of a core from its first iteration's end to its last bucket: the links idle while
    the ring waits on that rank, and the summary says so over the iterations after
    warm-up, every one of which ran capped."""
    steps, warmup = 4, 2
    stop = threading.Event()
    with CpuCap("gradbed-test-cap-rank", cores=0.1) as cap:
        watcher, times_ns = cap_rank_after_event(
            cap, tmp_path, HOSTS[0], "ddp_iter", f'"iter": {steps - 1}', stop, timeout_s=900)
        try:
            run_dir = torchrun(tmp_path, [
                "topo.traces={}", "net.worker_link_mbps=1000", f"run.iterations={steps}",
                f"run.warmup_iterations={warmup}"],
                ("--steps", str(steps), "--hidden", "2048", "--batch", "48", "--instrument"))
        finally:
            stop.set()
            watcher.join(timeout=5)
        assert len(times_ns) == 2, f"the rank was not capped and freed: {times_ns}"
        assert cap.throttled_us() > 0, "the cap never bit"
    ev = bucket_events(run_dir)
    judged = ev[ev["iter"] >= warmup]
    assert sorted(judged["node"].unique()) == HOSTS, ev[["node", "iter"]]
    launched_ns = judged["end_ns"] - (judged["comm_s"] * 1e9).round()
    assert launched_ns.min() > times_ns[0], "an iteration after warm-up began uncapped"
    assert judged.loc[judged["node"] == HOSTS[0], "end_ns"].max() < times_ns[1], \
        "the cap was lifted before the capped rank's last bucket"
    s = summary(run_dir)
    assert s["agent_limited"] is True, s["agent_limited_why"]
    assert s["agent_limited_why"].startswith("agent-limited") \
        and "data waited in the ranks" in s["agent_limited_why"], s["agent_limited_why"]
    # The report says so in words: the times measure the script's ranks, not gradbed.
    words = regime(s, tomllib.loads((run_dir / "config.toml").read_text()))
    assert "the script&#x27;s ranks (its compute and gloo) on this machine" in words, words
