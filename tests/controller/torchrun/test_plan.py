"""The torchrun role's plan, pure: which hosts train on each shape, every host's command
and the variables that keep its traffic on the emulated interface, the scaled store
timeouts, the refusals (NCCL without a GPU per host, a missing or non-Python script), and
the per-rank exit codes read from torchrun's failure report. No root, no torch run."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from agents.core import config as cfgmod
from controller.roles import RoleContext, get, plan_commands
from controller.roles.torchrun import (
    TorchrunError,
    admission_rules,
    check_gpus,
    check_script,
    check_shaping,
    failure_time,
    rank_exit_codes,
    rank_plans,
    store_timeouts_s,
    torchrun_spec,
    training_hosts,
)
from topo.shapes import shape_spec

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "torchrun_ddp"


def cfg(*overrides: str) -> cfgmod.ExperimentConfig:
    return cfgmod.load(EXAMPLE / "fabric4.toml", list(overrides))


@pytest.mark.parametrize("shape,hosts", [("star", ["w0", "w1", "w2", "w3"]),
                                         ("dumbbell", ["w0", "w1", "w2", "w3"]),
                                         ("fabric", ["gbh0", "gbh1", "gbh2", "gbh3"])])
def test_the_training_hosts_of_each_shape_run_torchrun_and_nothing_else_of_gradbed(
        shape: str, hosts: list[str]) -> None:
    c = cfg(f"topo.shape={shape!r}", "topo.traces={}")
    spec = torchrun_spec(shape_spec(c))
    assert [h.name for h in training_hosts(spec)] == hosts
    roles = {h.name: h.role for h in spec.hosts}
    assert {roles[h] for h in hosts} == {"torchrun"}
    assert "ps" not in roles.values() and "worker" not in roles.values()
    assert get("torchrun").ends_run


def test_every_host_gets_torchrun_at_rank_0s_ip_and_its_own_interface() -> None:
    c = cfg("torchrun.nproc_per_node=2", "torchrun.port=29999")
    spec = torchrun_spec(shape_spec(c))
    plans = rank_plans(c, spec, "/py", Path("/s/train.py"), Path("/run/logs/ranks"))
    assert [p.ranks for p in plans] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    p = plans[2]
    argv = list(p.argv)
    assert argv[:3] == ["/py", "-m", "torch.distributed.run"]
    opt = {argv[i]: argv[i + 1] for i in range(3, argv.index("/s/train.py"), 2)}
    assert opt["--nnodes"] == "4" and opt["--node-rank"] == "2"
    assert opt["--nproc-per-node"] == "2" and opt["--rdzv-backend"] == "static"
    assert opt["--master-addr"] == "10.0.0.10" and opt["--master-port"] == "29999"
    assert opt["--local-addr"] == "10.0.0.12"
    assert p.env["GLOO_SOCKET_IFNAME"] == p.env["TP_SOCKET_IFNAME"] == "gbh2-eth0"
    assert not any(k.startswith("NCCL") for k in p.env)
    # The role's commands (the dry run) are these very command lines.
    ctx = RoleContext(cfgmod.from_dict({**c.to_dict(), "torchrun": {
        **c.torchrun.__dict__, "script": "/s/train.py", "python": "/py"}}), spec, Path("/run"))
    assert [cm.argv for _, cm in plan_commands(ctx)] == [q.argv for q in plans]


def test_nccl_gets_its_socket_transport_and_a_distinct_host_id_and_needs_a_gpu_each() -> None:
    c = cfg("torchrun.backend='nccl'")
    spec = torchrun_spec(shape_spec(c))
    plans = rank_plans(c, spec, "py", Path("t.py"), Path("l"))
    for i, p in enumerate(plans):
        assert p.env["NCCL_P2P_DISABLE"] == p.env["NCCL_SHM_DISABLE"] == "1"
        assert p.env["NCCL_IB_DISABLE"] == "1" and p.env["NCCL_SOCKET_IFNAME"] == f"gbh{i}-eth0"
    assert len({p.env["NCCL_HOSTID"] for p in plans}) == 4
    check_gpus(c, 4, 4)
    with pytest.raises(TorchrunError, match="one GPU per emulated host: 4 hosts, 1 GPU"):
        check_gpus(c, 4, 1)
    with pytest.raises(TorchrunError, match="nproc_per_node = 1"):
        check_gpus(cfg("torchrun.backend='nccl'", "torchrun.nproc_per_node=2"), 4, 8)


def test_store_timeouts_grow_with_delay_and_loss() -> None:
    assert store_timeouts_s(0, 0) == (60.0, 600.0)
    assert store_timeouts_s(50, 0) == (120.0, 1200.0)  # 100 ms RTT doubles them
    lossy = store_timeouts_s(0, 0.1)
    assert lossy[0] == pytest.approx(60 / 0.9 ** 4, abs=0.1)
    # The example's 5 ms and 0.1 % per uplink, counted on two hops (10 ms one way, 0.2 %):
    # 600 s x 1.2 / 0.998^4 reaches torchrun as its rendezvous timeout.
    c = cfg()
    plan = rank_plans(c, torchrun_spec(shape_spec(c)), "py", Path("t.py"), Path("l"))[0]
    assert plan.argv[plan.argv.index("--rdzv-conf") + 1] == "timeout=725"
    # c10d: node 0 hosts the store (the hosts share one hostname, which c10d would match).
    c = cfg("torchrun.rdzv='c10d'")
    confs = [p.argv[p.argv.index("--rdzv-conf") + 1]
             for p in rank_plans(c, torchrun_spec(shape_spec(c)), "py", Path("t.py"), Path("l"))]
    assert confs == ["join_timeout=725,read_timeout=72,is_host=true"] + [
        "join_timeout=725,read_timeout=72,is_host=false"] * 3


def test_a_missing_or_non_python_script_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(TorchrunError, match="no script"):
        check_script("")
    with pytest.raises(TorchrunError, match=r"nope\.py: no such file"):
        check_script(str(tmp_path / "nope.py"))
    (tmp_path / "a.sh").write_text("echo hi\n")
    with pytest.raises(TorchrunError, match="not a Python script"):
        check_script(str(tmp_path / "a.sh"))
    (tmp_path / "bad.py").write_text("def (:\n")
    with pytest.raises(TorchrunError, match="not valid Python"):
        check_script(str(tmp_path / "bad.py"))
    (tmp_path / "ok.py").write_text("print(1)\n")
    assert check_script(str(tmp_path / "ok.py")) == tmp_path / "ok.py"


REPORT = """\
Failures:
[1]:
  time      : 2026-11-27_06:27:19
  host      : localhost
  rank      : 4 (local_rank: 0)
  exitcode  : -15 (pid: 31965)  (SIGTERM)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-27_06:27:18
  host      : localhost
  rank      : 5 (local_rank: 1)
  exitcode  : 3 (pid: 31966)
"""


def test_exit_codes_per_rank_come_from_torchrun_s_failure_report() -> None:
    c = cfg("torchrun.nproc_per_node=2")
    plan = rank_plans(c, torchrun_spec(shape_spec(c)), "py", Path("t.py"), Path("l"))[2]
    assert rank_exit_codes(plan, 1, REPORT) == {4: -15, 5: 3}
    assert rank_exit_codes(plan, 0, "") == {4: 0, 5: 0}
    assert rank_exit_codes(plan, None, "") == {4: None, 5: None}
    assert rank_exit_codes(plan, -9, "") == {4: -9, 5: -9}  # torchrun itself killed
    assert failure_time(REPORT, 5) == "2026-11-27_06:27:18"
    assert failure_time(REPORT, 4) == "2026-11-27_06:27:19"
    assert failure_time(REPORT, 7) == "~"


def test_the_config_section_refuses_bad_values_naming_the_field() -> None:
    with pytest.raises(cfgmod.ConfigError) as e:
        cfg("torchrun.rdzv='etcd'", "torchrun.backend='mpi'", "torchrun.stall_s=0",
            "torchrun.script='train.sh'")
    text = str(e.value)
    for field in ("torchrun.rdzv", "torchrun.backend", "torchrun.stall_s", "torchrun.script"):
        assert field in text


def test_under_tc_each_rank_plans_for_its_link_n_cap() -> None:
    """shaping.method = "tc" caps each of the star's 4 workers at B/4: the adaptive hook's
    planned rate (GRADBED_LINK_MBPS) is that cap, not the link's rate; pacing and
    pace_guard, which only gradbed's own agents obey, are refused by name."""
    star = ["topo.shape='star'", "topo.traces={}", "net.worker_link_mbps=1000",
            "net.bottleneck_mbps=100"]

    def planned(*more: str) -> list[str]:
        c = cfg(*star, *more)
        check_shaping(c)
        plans = rank_plans(c, torchrun_spec(shape_spec(c)), "/py", Path("/t.py"), Path("/l"))
        return [p.env["GRADBED_LINK_MBPS"] for p in plans]

    assert planned() == ["1000"] * 4
    assert planned("shaping.method='tc'") == ["25"] * 4
    assert planned("shaping.method='tc'", "shaping.headroom=0.8") == ["20"] * 4
    with pytest.raises(TorchrunError, match="shaping.method = 'pacing' paces the sockets"):
        planned("shaping.method='pacing'")
    with pytest.raises(TorchrunError, match="shaping.pace_guard = 2 paces the sockets"):
        planned("shaping.method='tc'", "shaping.pace_guard=2")


def test_training_hosts_admit_each_other_and_reset_every_other_host() -> None:
    c = cfg("topo.shape='star'", "topo.traces={}")
    spec = torchrun_spec(shape_spec(c))
    rules = admission_rules(spec, c.guard)
    assert admission_rules(spec, replace(c.guard, kernel_admission=False)) == {}
    assert list(rules) == ["w0", "w1", "w2", "w3"]  # not the PS host: it trains nothing
    for cmds in rules.values():
        accepted = [cmd[cmd.index("-s") + 1] for cmd in cmds if cmd[-1] == "ACCEPT"]
        assert accepted == ["127.0.0.1", *(h.ip for h in training_hosts(spec))]
        assert spec.ip("ps") not in accepted
        assert cmds[-1][-4:] == ["-j", "REJECT", "--reject-with", "tcp-reset"]
        assert all(cmd[:2] == ["iptables", "-w"] and "--syn" in cmd for cmd in cmds)
