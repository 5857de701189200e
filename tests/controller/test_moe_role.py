"""The expert role's command lines from a fabric spec (pure: no processes, no torch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.core import config as cfgmod
from controller.roles import RoleContext, RoleError, plan_commands
from topo.shapes import shape_spec

REPO = Path(__file__).resolve().parents[2]


def test_expert_hosts_on_the_fabric() -> None:
    cfg = cfgmod.load(REPO / "configs" / "moe.toml")
    spec = shape_spec(cfg)
    cmds = plan_commands(RoleContext(cfg, spec, Path("/tmp/run")))
    assert [c.host for _, c in cmds] == ["gbh0", "gbh1", "gbh2", "gbh3"]
    role, first = cmds[0]
    assert role.name == "expert" and role.ends_run
    addrs = "10.0.0.10:5000,10.0.0.11:5000,10.0.0.12:5000,10.0.0.13:5000"
    assert first.argv[1:] == ("-m", "agents.moe.expert", "--run-dir", "/tmp/run", "--host", "0",
                              "--addrs", addrs, "--auth", "stdin")
    # Every access link is shaped both ways at net.worker_link_mbps.
    points = {p.name: p for e in spec.edges for p in (e.a_to_b, e.b_to_a)}
    assert {f"gbh{i}.{d}" for i in range(4) for d in ("up", "down")} <= set(points)
    assert all(points[f"gbh{i}.down"].link.rate_mbps == 100.0 for i in range(4))


def test_host_count_must_match() -> None:
    cfg = cfgmod.load(REPO / "configs" / "moe.toml", ["topo.hosts=2"])
    with pytest.raises(RoleError, match="moe.hosts = 4"):
        plan_commands(RoleContext(cfg, shape_spec(cfg), Path("/tmp/run")))
