"""Roles are declarations placed on a spec's hosts; the runner starts them by phase and
ends the run when the roles that decide it have exited. Real local processes, no root."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agents.core import config as cfgmod
from agents.core.events import EventLog, read_jsonl
from controller import runner as runner_mod
from controller.roles import (
    Role,
    RoleCommand,
    RoleContext,
    RoleError,
    get,
    names,
    placement,
    plan_commands,
    register,
)
from controller.runner import RoleRunner
from topo.shapes import shape_spec
from topo.spec import HostSpec, NetSpec

REPO = Path(__file__).resolve().parents[2]


def cfg(*overrides: str) -> cfgmod.ExperimentConfig:
    return cfgmod.load(REPO / "configs/digits.toml", list(overrides))


def test_the_data_parallel_roles_are_registered_as_data():
    assert {"ps", "worker", "flowgen"} <= set(names())
    ps, worker, flowgen = get("ps"), get("worker"), get("flowgen")
    assert ps.ends_run and ps.wait_ready and ps.phase < worker.phase < flowgen.phase
    assert not worker.ends_run and not flowgen.ends_run
    assert flowgen.sections == ("background",) and flowgen.session is not None
    with pytest.raises(RoleError, match="role 'nonesuch' is not registered; known roles: .*ps"):
        get("nonesuch")


def test_role_declarations_import_without_torch():
    code = ("import sys, controller.roles as r; r.names(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_star_places_ps_then_workers_then_flowgen_with_their_command_lines(tmp_path):
    c = cfg("net.workers=2", "net.background_hosts=1", "background.flows=1")
    ctx = RoleContext(c, shape_spec(c), tmp_path, python="PY")
    assert [(r.name, [h.name for h in hs]) for r, hs in placement(ctx.spec)] == [
        ("ps", ["ps"]), ("worker", ["w0", "w1"]), ("flowgen", ["bg0"])]
    planned = [(r.name, c.host, c.argv) for r, c in plan_commands(ctx)]
    assert planned[0] == ("ps", "ps", ("PY", "-m", "agents.dp.ps", "--run-dir", str(tmp_path),
                                       "--expect", ctx.spec.host("w0").ip,
                                       "--expect", ctx.spec.host("w1").ip))
    assert planned[2] == ("worker", "w1", ("PY", "-m", "agents.dp.worker", "--run-dir",
                                           str(tmp_path), "--worker", "1", "--ps", "10.0.0.1",
                                           "--port", "5000", "--gso-segs",
                                           str(ctx.spec.host("w1").gso_segs)))
    assert [(r, h) for r, h, _ in planned[3:]] == [("flowgen", "ps"), ("flowgen", "bg0")]


def test_a_role_on_a_kind_it_does_not_run_on_is_refused():
    spec = NetSpec("t", (HostSpec("w0", "background", "worker", "10.0.0.10"),), (), ())
    with pytest.raises(RoleError, match="host w0 \\(kind 'background'\\) has role 'worker'"):
        placement(spec)


# -- the runner, with real processes (no namespaces: the starter is plain Popen) -------

def script(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def make_role(name: str, code: str, *, ends_run: bool, phase: int = 1,
              wait_ready: bool = False) -> Role:
    return register(Role(name=name, sections=(), host_kinds=("test",), ends_run=ends_run,
                         phase=phase, wait_ready=wait_ready,
                         commands=lambda ctx, hosts: [RoleCommand(h.name, script(code))
                                                      for h in hosts]))


def run_roles(tmp_path: Path, hosts: list[tuple[str, str]], timeout_s: float = 20.0,
              ready_from: tuple[str, ...] = (), heard_from: tuple[str, ...] = (),
              sets: tuple[str, ...] = (), watch: Any = None
              ) -> tuple[str, RoleRunner, float]:
    spec = NetSpec("t", tuple(HostSpec(n, "test", r, f"10.0.0.{10 + i}")
                              for i, (n, r) in enumerate(hosts)), (), ())
    events = EventLog.for_node(tmp_path, "t", "controller")
    said: list[str] = []
    holder: dict[str, RoleRunner] = {}

    def start(cmd: RoleCommand) -> subprocess.Popen[bytes]:
        if cmd.host in ready_from:  # stands in for the agent's "ready" control report
            holder["r"].on_report({"type": "ready", "node": cmd.host})
        if cmd.host in heard_from:  # one heartbeat, then silence (a hung agent)
            holder["r"].on_report({"type": "heartbeat", "node": cmd.host})
        return subprocess.Popen(list(cmd.argv))

    r = RoleRunner(RoleContext(cfg(*sets), spec, tmp_path), start, said.append, events)
    holder["r"] = r
    t0 = time.monotonic()
    r.start_agents()
    reason = r.wait(timeout_s, watch=watch)
    return reason, r, time.monotonic() - t0


def test_a_watch_that_answers_ends_the_wait_with_its_reason(tmp_path):
    make_role("t_end_never", "import time; time.sleep(60)", ends_run=True)
    lost_at = time.monotonic() + 0.5
    reason, r, took = run_roles(
        tmp_path, [("w0", "t_end_never")],
        watch=lambda: "server lost: 10.99.0.2 (gone)" if time.monotonic() > lost_at else "")
    assert reason == "server lost: 10.99.0.2 (gone)" and took < 5.0
    for _, _, p in r.procs:
        p.kill()
        p.wait()


def test_the_run_ends_when_every_deciding_role_has_exited(tmp_path, monkeypatch):
    monkeypatch.setattr(runner_mod, "GRACE_S", 0.5)
    make_role("t_end_fast", "import time; time.sleep(0.2)", ends_run=True)
    make_role("t_end_slow", "import time; time.sleep(1.0)", ends_run=True)
    make_role("t_forever", "import time; time.sleep(60)", ends_run=False)
    reason, r, took = run_roles(tmp_path, [("w0", "t_end_fast"), ("w1", "t_end_slow"),
                                           ("w2", "t_forever")])
    assert reason == "completed"
    assert 1.0 <= took < 5.0  # waited for the slow one, not for the one that never ends
    forever = [p for role, _, p in r.procs if role.name == "t_forever"][0]
    assert forever.poll() is None  # left to the network's teardown
    forever.kill()
    forever.wait()


def test_a_failing_deciding_role_names_its_host(tmp_path, monkeypatch):
    monkeypatch.setattr(runner_mod, "GRACE_S", 0.1)
    make_role("t_fail", "raise SystemExit(3)", ends_run=True)
    reason, _, _ = run_roles(tmp_path, [("w0", "t_fail")])
    assert reason == "w0 exited with status 3; see logs/w0.log"


def test_a_killed_deciding_process_ends_the_run_at_once_naming_it(tmp_path, monkeypatch):
    """Its peers would wait for it until run.timeout_s (a pipeline stage's neighbours)."""
    monkeypatch.setattr(runner_mod, "GRACE_S", 0.1)
    make_role("t_long_end", "import time; time.sleep(30)", ends_run=True)
    make_role("t_killed", "import os, signal, time; time.sleep(0.3); "
              "os.kill(os.getpid(), signal.SIGKILL)", ends_run=True)
    reason, r, took = run_roles(tmp_path, [("w0", "t_long_end"), ("w1", "t_killed")])
    assert reason == "w1 exited with status -9; see logs/w1.log" and took < 10, (reason, took)
    r.events.close()
    (lost,) = [e for e in read_jsonl(tmp_path / "events" / "controller.jsonl")
               if e["event"] == "agent_lost"]
    assert (lost["host"], lost["action"]) == ("w1", "stop")
    for _, _, p in r.procs:
        p.kill()
        p.wait()


def test_a_killed_process_of_a_role_that_does_not_end_the_run_is_declared_once(
        tmp_path, monkeypatch):
    """A flow generator source killed mid-run: the run goes on to its end, and the loss is
    one ``agent_lost`` event naming it, ``peers decide`` (on main at 5c16cbd: a line in
    run.log only)."""
    monkeypatch.setattr(runner_mod, "GRACE_S", 0.1)
    make_role("t_end_later", "import time; time.sleep(1.5)", ends_run=True)
    make_role("t_source", "import os, signal, time; time.sleep(0.3); "
              "os.kill(os.getpid(), signal.SIGKILL)", ends_run=False)
    reason, r, took = run_roles(tmp_path, [("w0", "t_end_later"), ("bg0", "t_source")])
    assert reason == "completed" and took >= 1.5, (reason, took)
    r.events.close()
    lost = [e for e in read_jsonl(tmp_path / "events" / "controller.jsonl")
            if e["event"] == "agent_lost"]
    assert [(e["host"], e["role"], e["action"], e["reason"]) for e in lost] == [
        ("bg0", "t_source", "peers decide", "bg0 exited with status -9; see logs/bg0.log")]


def test_the_killed_process_is_named_even_when_its_neighbours_failure_is_seen_first(
        tmp_path, monkeypatch):
    """A killed stage's neighbours exit with an error because it died, and their exits
    may reach the controller first (the warm process reaps in its own order): the stop
    reason must still name the killed one, whether the wait is running or has ended."""
    monkeypatch.setattr(runner_mod, "GRACE_S", 0.1)
    gone = tmp_path / "neighbour-gone"
    make_role("t_neighbour", f"import pathlib, time; time.sleep(0.3); "
              f"pathlib.Path({str(gone)!r}).touch(); raise SystemExit(2)", ends_run=True)
    make_role("t_cause", f"import os, pathlib, signal, time\n"
              f"while not pathlib.Path({str(gone)!r}).exists(): time.sleep(0.01)\n"
              f"time.sleep(0.3); os.kill(os.getpid(), signal.SIGKILL)", ends_run=True)
    make_role("t_lives_on", "import time; time.sleep(30)", ends_run=True)
    # Alone, the two end the wait by both exiting; with a third, the wait goes on.
    for hosts in ([("w0", "t_neighbour"), ("w1", "t_cause")],
                  [("w0", "t_neighbour"), ("w1", "t_cause"), ("w2", "t_lives_on")]):
        gone.unlink(missing_ok=True)
        reason, r, took = run_roles(tmp_path, hosts)
        assert reason == "w1 exited with status -9; see logs/w1.log", (hosts, reason)
        for _, _, p in r.procs:
            p.kill()
            p.wait()


def test_an_agent_silent_for_stall_timeout_s_is_declared_lost_and_killed(
        tmp_path, monkeypatch):
    monkeypatch.setattr(runner_mod, "GRACE_S", 0.1)
    make_role("t_hung", "import time; time.sleep(30)", ends_run=True)
    reason, r, took = run_roles(tmp_path, [("w0", "t_hung")], heard_from=("w0",),
                                sets=("run.stall_timeout_s=3",))
    assert reason.startswith("w0 lost: no heartbeat for 3.") and took < 8, (reason, took)
    assert reason.endswith("(run.stall_timeout_s = 3)")
    (_, _, p), = r.procs
    assert p.returncode == -9  # killed: what follows is what follows its death


def test_timeout_and_ready_wait(tmp_path, monkeypatch):
    monkeypatch.setattr(runner_mod, "GRACE_S", 0.1)
    make_role("t_long", "import time; time.sleep(30)", ends_run=True)
    reason, r, took = run_roles(tmp_path, [("w0", "t_long")], timeout_s=0.5)
    assert reason == "timeout after 0.5 s" and took < 5
    for _, _, p in r.procs:
        p.kill()
        p.wait()
    make_role("t_never_ready", "raise SystemExit(2)", ends_run=True, phase=0, wait_ready=True)
    with pytest.raises(RuntimeError, match="w0 exited with status 2 before it was ready"):
        run_roles(tmp_path, [("w0", "t_never_ready")])
    # A ready role lets the next phase start.
    make_role("t_ready", "import time; time.sleep(0.3)", ends_run=True, phase=0,
              wait_ready=True)
    make_role("t_after_ready", "pass", ends_run=False, phase=1)
    reason, r, _ = run_roles(tmp_path, [("w0", "t_ready"), ("w1", "t_after_ready")],
                             ready_from=("w0",))
    assert reason == "completed" and [c.host for _, c, _ in r.procs] == ["w0", "w1"]


def test_a_network_without_a_deciding_role_is_refused(tmp_path):
    make_role("t_idle", "pass", ends_run=False)
    spec = NetSpec("t", (HostSpec("w0", "test", "t_idle", "10.0.0.10"),), (), ())
    with pytest.raises(RoleError, match="no host of this t runs a role that ends the run"):
        RoleRunner(RoleContext(cfg(), spec, tmp_path), lambda c: None,  # type: ignore[arg-type,return-value]
                   print, EventLog.for_node(tmp_path, "t", "controller"))


def test_the_fabric_puts_topo_role_on_every_host_and_refuses_none(tmp_path):
    from controller.run import plan_commands as dry_run

    register(Role(name="t_stage", sections=(), host_kinds=("t_stage",), ends_run=True,
                  commands=lambda ctx, hosts: [RoleCommand(h.name, ("stage", str(h.rank)))
                                               for h in hosts]))
    c = cfg('topo.shape="fabric"', "topo.hosts=3", 'topo.role="t_stage"')
    lines = dry_run(c, {"netem": False})
    assert [ln for ln in lines if ln.startswith("$ stage")] == [
        f"$ stage {i}   # in gbh{i}, role t_stage" for i in range(3)]
    with pytest.raises(RoleError, match="no host of this fabric runs a role that ends"):
        dry_run(cfg('topo.shape="fabric"'), {"netem": False})
