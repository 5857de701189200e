"""Pipeline stages in real Mininet (issue 18): 4 stages on the fabric, every access link
shaped both ways at 100 Mbit/s; each schedule runs to completion, its loss falls, and the
per-host timeline shows every action of every stage."""

from __future__ import annotations

import pytest

from agents.core.schedules import make
from analysis.timeline import host_timeline
from tests.mininet_run import events, gradbed_run, leftovers

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
    assert leftovers() == []
