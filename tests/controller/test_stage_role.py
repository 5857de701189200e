"""The stage role's command lines from a fabric spec (no processes, no root)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.core import config as cfgmod
from controller.roles import RoleContext, RoleError, get, plan_commands
from topo.shapes import shape_spec

REPO = Path(__file__).resolve().parents[2]


def test_replica_r_stage_s_runs_on_host_r_times_p_plus_s_and_the_ps_on_the_last(tmp_path):
    cfg = cfgmod.load(REPO / "configs/pipeline.toml",
                      ["pipeline.stages=2", "pipeline.replicas=2", "topo.hosts=5"])
    role = get("stage")
    assert role.ends_run and role.host_kinds == ("stage",) and "pipeline" in role.sections
    planned = [(c.host, c.argv) for _, c in plan_commands(RoleContext(
        cfg, shape_spec(cfg), tmp_path, python="PY"))]
    assert sorted(h for h, _ in planned) == ["gbh0", "gbh1", "gbh2", "gbh3", "gbh4"]
    by_host = dict(planned)
    assert by_host["gbh3"] == ("PY", "-m", "agents.pipeline.stage", "--run-dir", str(tmp_path),
                               "--stage", "1", "--replica", "1", "--peers",
                               "10.0.0.12:5000,10.0.0.13:5001", "--auth", "stdin",
                               "--ps", "10.0.0.14:5000")
    assert by_host["gbh4"] == ("PY", "-m", "agents.pipeline.stage_ps", "--run-dir", str(tmp_path),
                               "--port", "5000", "--auth", "stdin",
                               # each stage's host keeps an admission slot of its own
                               "--expect", "10.0.0.10", "--expect", "10.0.0.11",
                               "--expect", "10.0.0.12", "--expect", "10.0.0.13")


def test_host_count_must_be_stages_times_replicas_plus_the_ps(tmp_path):
    cfg = cfgmod.load(REPO / "configs/pipeline.toml", ["topo.hosts=4"])
    with pytest.raises(RoleError, match=r"4 stage hosts for pipeline.stages=4 x "
                                        r"pipeline.replicas=1 and the PS \(set topo.hosts = "
                                        r"5\)"):
        plan_commands(RoleContext(cfg, shape_spec(cfg), tmp_path, python="PY"))
