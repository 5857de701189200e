"""Pipeline stages in real Mininet, every access link shaped both ways at 10 Mbit/s: two
replicas of a 3-stage two-group pipeline (6 stage hosts) and the pipeline's PS on the
fabric. The run completes, every replica's loss falls, the per-host timeline and
trace.json show every action of every stage, the PS's evaluation gives the summary its
final accuracy, the replicas' data-parallel bytes are the planner's, and the summary says
the links, not the agents, set the pace of the stages' messages.

One run carries every check: two-group uses every link the other schedules use (each
stage to its neighbours, middle stages both ways) plus the last stage's link back to the
first, and each stage holds two slices, so the PS averages two per stage. GPipe and 1F1B
are the same stage executor, links and PS in another order of actions; their exact
weights, link bytes and averaging over TCP are checked on loopback
(test_pipeline_transparency, test_pipeline_accuracy).

A second, small run gives the other answer: two stages whose CPU a cgroup caps, on
1 Gbit/s links, read agent-limited, and the report's words name the stages."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from agents.core import config as cfgmod
from agents.core.schedules import make
from agents.pipeline.partition import balance_by_params, split
from agents.workloads.base import FlatModel
from agents.workloads.factory import make_workload
from analysis.planner import pipeline_dp_link_bytes
from analysis.timeline import host_timeline
from tests.support.cpu_cap import assert_agent_limited, capped_run, cpu_cap_kind
from tests.support.mininet_run import events, gradbed_run, leftovers, summary

pytestmark = pytest.mark.mininet

STEPS = 6


def _stage_nodes(stages: int, replicas: int) -> list[str]:
    if replicas == 1:
        return [f"s{s}" for s in range(stages)]
    return [f"r{r}s{s}" for r in range(replicas) for s in range(stages)]


def check_schedule_ran(run_dir: Path, ev: pd.DataFrame, schedule: str, stages: int,
                       replicas: int) -> None:
    """Every stage finished, every replica's loss fell, every action of every stage's
    schedule is on the timeline and in trace.json, and the summary's final accuracy is
    the PS's final evaluation."""
    nodes = _stage_nodes(stages, replicas)
    done = ev[ev["event"] == "pp_done"]
    assert sorted(done["node"]) == sorted(nodes)
    loss = ev[(ev["event"] == "pp_step_done") & ev["loss"].notna()].sort_values("iter")
    assert loss["node"].nunique() == replicas, loss[["node", "iter", "loss"]]
    for node, mine in loss.groupby("node"):
        assert len(mine) == STEPS, node
        assert mine["loss"].iloc[-1] < mine["loss"].iloc[0] - 0.1, mine[["iter", "loss"]]
    sch = make(schedule, stages, 4, steps=STEPS)
    act = ev[ev["event"] == "pp_action"]
    for node in nodes:
        s = int(node.split("s")[-1])
        assert len(act[act["node"] == node]) == len(sch.actions[s]), node
    tl = host_timeline(ev)
    assert {"forward", "backward", "receive", "send"} <= set(tl["category"])
    # The controller wrote trace.json: one span per schedule action on each stage's thread.
    trace = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    host = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    lane = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    for node in nodes:
        s = int(node.split("s")[-1])
        assert len(sch.actions[s]) == sum(
            1 for e in trace if e["ph"] == "X" and host[e["pid"]] == node
            and lane[(e["pid"], e["tid"])] == "compute"), node
    final = ev[(ev["event"] == "final_eval") & (ev["node"] == "ps")]
    assert len(final) == 1 and summary(run_dir)["final_accuracy"] == final["accuracy"].iloc[0]


def test_two_group_replicas_train_and_average_through_the_ps_on_the_fabric(
        tmp_path: Path) -> None:
    p, d = 3, 2
    run_dir, proc = gradbed_run("configs/pipeline.toml", [
        f"pipeline.stages={p}", f"pipeline.replicas={d}", f"topo.hosts={p * d + 1}",
        "pipeline.schedule='two_group'", f"run.iterations={STEPS}",
        # 10 Mbit/s: each 16 KB activation takes 13 ms on the wire, so the links, not the
        # agents, set the pace even on a loaded machine.
        "net.worker_link_mbps=10"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_schedule_ran(run_dir, events(run_dir), "two_group", p, d)
    got = summary(run_dir)["pipeline"]["dp_link_bytes_per_step"]
    model = make_workload(cfgmod.load(run_dir / "config.toml").workload).build_model(0)
    # 2p slices: slice i on stage i % p, two gradients up and two means down per stage.
    numels = [FlatModel(x).numel for x in split(model, balance_by_params(model, 2 * p))]
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


@pytest.mark.skipif(cpu_cap_kind() is None, reason="no cgroup cpu controller")
def test_stages_with_their_cpu_capped_at_1gbit_are_agent_limited(tmp_path: Path) -> None:
    """The other answer of the run above: a 2-stage pipeline on 1 Gbit/s links whose two
    stages share a fifth of a core (a cgroup's CPU bandwidth limit, from their connection
    to the pipeline's PS on): the links idle while activations wait in the stages."""
    p = 2
    port = cfgmod.load("configs/pipeline.toml").net.port
    # The trailing space leaves out the pipeline's PS (agents.pipeline.stage_ps).
    run_dir = capped_run("gradbed-test-cap-stages", "agents.pipeline.stage ", port, p,
                         "configs/pipeline.toml", [
                             f"pipeline.stages={p}", f"topo.hosts={p + 1}",
                             "run.iterations=3", "net.worker_link_mbps=1000"], tmp_path)
    assert_agent_limited(run_dir, "pipeline stages")
