"""Pipeline stages in real Mininet: 4 stages and the pipeline's PS on the fabric,
every access link shaped both ways at 100 Mbit/s; each schedule runs to completion, its
loss falls, the per-host timeline shows every action of every stage, and the PS's
evaluation gives the summary its final accuracy. Two replicas of a 2-stage pipeline average
through the PS with the planner's data-parallel bytes, and at 10 Mbit/s the summary says
the links, not the agents, set the pace of the stages' messages."""

from __future__ import annotations

import json
import re

import pytest

from agents.core import config as cfgmod
from agents.core.schedules import make
from agents.pipeline.partition import balance_by_params, split
from agents.workloads.base import FlatModel
from agents.workloads.factory import make_workload
from analysis.planner import pipeline_dp_link_bytes
from analysis.timeline import host_timeline
from tests.support.mininet_run import events, gradbed_run, leftovers, summary

pytestmark = pytest.mark.mininet


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "two_group"])
def test_four_stages_on_the_fabric(tmp_path, schedule):
    steps = 6
    run_dir, proc = gradbed_run("configs/pipeline.toml", [
        f"pipeline.schedule='{schedule}'", f"run.iterations={steps}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ev = events(run_dir)
    done = ev[ev["event"] == "pp_done"]
    assert sorted(done["node"]) == ["s0", "s1", "s2", "s3"], proc.stderr[-3000:]
    loss = ev[(ev["event"] == "pp_step_done") & ev["loss"].notna()].sort_values("iter")
    assert len(loss) == steps
    assert loss["loss"].iloc[-1] < loss["loss"].iloc[0] - 0.1, loss[["iter", "loss"]]
    # Every action of every stage's schedule ran and is on the timeline.
    sch = make(schedule, 4, 4, steps=steps)
    act = ev[ev["event"] == "pp_action"]
    for s in range(4):
        assert len(act[act["node"] == f"s{s}"]) == len(sch.actions[s])
    tl = host_timeline(ev)
    assert {"forward", "backward", "receive", "send"} <= set(tl["category"])
    # The controller wrote trace.json: one span per schedule action on each stage's thread.
    trace = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    host = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    lane = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    for s in range(4):
        assert len(sch.actions[s]) == sum(
            1 for e in trace if e["ph"] == "X" and host[e["pid"]] == f"s{s}"
            and lane[(e["pid"], e["tid"])] == "compute")
    final = ev[(ev["event"] == "final_eval") & (ev["node"] == "ps")]
    assert len(final) == 1 and summary(run_dir)["final_accuracy"] == final["accuracy"].iloc[0]
    assert leftovers() == []


def test_two_replicas_average_through_the_ps_on_the_fabric(tmp_path):
    p, d = 2, 2
    run_dir, proc = gradbed_run("configs/pipeline.toml", [
        f"pipeline.stages={p}", f"pipeline.replicas={d}", f"topo.hosts={p * d + 1}",
        "pipeline.schedule='gpipe'", "run.iterations=4",
        # 10 Mbit/s: each 16 KB activation takes 13 ms on the wire, so the links, not the
        # agents, set the pace even on a loaded machine.
        "net.worker_link_mbps=10"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = summary(run_dir)["pipeline"]["dp_link_bytes_per_step"]
    model = make_workload(cfgmod.load(run_dir / "config.toml").workload).build_model(0)
    numels = [FlatModel(x).numel for x in split(model, balance_by_params(model, p))]
    want = pipeline_dp_link_bytes(numels, p, d)
    assert len(got) == 2 * p * d
    for (r, s), v in want.items():
        for key in (f"r{r}s{s}->ps", f"ps->r{r}s{s}"):
            assert abs(got[key] - v) <= 0.01 * v, (key, got[key], v)
    # The stages' messages were judged on the access links' class samples, which the
    # controller took by itself: busy links, so network-limited.
    run_summary = summary(run_dir)
    assert run_summary["agent_limited"] is False, run_summary["agent_limited_why"]
    assert re.search(r"gbh\d\.(up|down).* busy \d\.\d\d", run_summary["agent_limited_why"]), run_summary
    assert leftovers() == []

