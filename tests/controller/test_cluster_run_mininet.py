"""``gradbed run`` over fake servers (``scripts/fake_cluster.sh``): the agents run on the
servers' Mininet hosts, speak to the controller through forwarded control sockets, and
their events come back onto the controller's clock. Real Mininet, ssh and training; root.

One cluster of two servers serves the module; the test that kills a server runs last.
Each kind of run (data-parallel, pipeline, MoE, a killed controller, a killed delay line,
a killed server) is one ``gradbed run``, the smallest that still shows what its test
asserts; the reference for identical weights is a loopback run of the same config (no
network at all).
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import pytest

from controller.exit_status import FAILED, SERVER_LOST, status_for
from controller.loopback.dp import run_loopback
from controller.remote import cleanup_run
from controller.run import SERVER_GRACE_S
from controller.warm_remote import WARM_ROOT
from tests.support.mininet_run import REPO, events, gradbed_run, start_run, summary
from topo.cluster import SshAccess
from topo.fake_cluster import FakeCluster, fake_cluster
from topo.server_lock import ServerLock

pytestmark = [pytest.mark.mininet,
              pytest.mark.skipif(not Path("/usr/sbin/sshd").exists(),
                                 reason="no sshd: GRADBED_WITH_SSHD=1 scripts/setup.sh")]

REMOTE_ROOT = "/run/gradbed/remote"
# A run may first wait minutes for the machine-wide network lock behind other runs.
RUN_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeCluster]:
    with fake_cluster(tmp_path_factory.mktemp("fc") / "cluster", n=2) as c:
        yield c


def _placed(c: FakeCluster, ps: str, worker: str, *extra: str) -> list[str]:
    servers = ", ".join(f'"{s}"' for s in dict.fromkeys([ps, worker]))
    return [f"cluster.servers=[{servers}]", f'cluster.pins={{ps="{ps}", worker="{worker}"}}',
            f'cluster.ssh_config="{c.ssh_config}"', "run.seed=7", *extra]


def _weights_digest(run_dir: Path) -> str:
    import torch

    flat = torch.load(run_dir / "ps_final_weights.pt")
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def _eval_losses(events_jsonl: Path) -> list[float]:
    rows = [json.loads(ln) for ln in events_jsonl.read_text().splitlines() if ln.strip()]
    return [r["loss"] for r in sorted((r for r in rows if r.get("event") == "eval"),
                                      key=lambda r: r["iter"])]


def _server_leftovers(c: FakeCluster) -> list[str]:
    """Agents (and their warm processes and clients), delay lines, host shells, gradbed
    links, run directories and warm sockets still on any server."""
    def on(s: str) -> list[str]:
        try:
            text = c.ssh(s, "ps -eo args | grep -E '[a]gents\\.|[m]ininet:|[w]arm_remote|"
                            "[t]opo[.]delayline' || true; "
                            "ip -o link show | grep -E ': (gbsw|ps-|w[0-9])' || true; "
                            f"ls {REMOTE_ROOT} 2>/dev/null; ls {WARM_ROOT} 2>/dev/null; "
                            "true").stdout
        except subprocess.CalledProcessError as e:
            return [f"{s}: ssh failed: {e.stderr}"]
        return [f"{s}: {ln}" for ln in text.splitlines() if ln.strip()]

    with ThreadPoolExecutor() as pool:  # each ssh is mostly waiting: all servers at once
        return [ln for lines in pool.map(on, c.servers) for ln in lines]


# configs/digits.toml made small: 2 workers, 12 iterations, sparse (top-k with error
# feedback) so that every worker's residual must match too.
DIGITS_SMALL = ("net.workers=2", "run.iterations=12", "run.eval_every=3",
                "workload.hidden=256", "compress.name='topk'", "compress.ratio=0.1",
                "run.seed=7")


def test_digits_in_one_process_tree_and_on_two_servers_end_with_identical_weights(
        cluster, tmp_path):
    s1, s2 = cluster.servers
    # w0's uplink replays a trace: its rate changes run on w0's server; and every host
    # drops 0.5 % of what arrives (netfilter rules on that host's server).
    shaped = ('topo.traces={"w0.up"="traces/data/square_10_50.log"}', "net.loss_pct=0.5")
    p2 = start_run("configs/digits.toml", _placed(cluster, s1, s2, *DIGITS_SMALL, *shaped),
                   tmp_path / "two")
    try:
        # The reference, while the cluster run mostly waits on ssh: the same agents and
        # config over loopback TCP on this machine, no network in between at all.
        one, rc = run_loopback(tmp_path / "one", list(DIGITS_SMALL))
        out, err = p2.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if p2.poll() is None:
            p2.kill()
            p2.communicate()
    assert rc == 0, (one / "ps.log").read_text()[-3000:]
    assert p2.returncode == 0, err[-3000:]
    two = Path(out.strip().splitlines()[-1])
    # The network changes timing, never the numbers.
    assert _weights_digest(one) == _weights_digest(two)
    losses = [_eval_losses(one / "events" / "ps.jsonl"),
              events(two).query("event == 'eval'").sort_values("iter")["loss"].tolist()]
    assert losses[0] == losses[1] and len(losses[0]) >= 3
    # The workers ran on server 2 and their events came back, moved onto this clock:
    # inside the controller's run_start .. run_end, not 2000 s ahead.
    meta = json.loads((two / "meta.json").read_text())
    assert meta["cluster"]["placement"]["w0"] == s2
    start = meta["cluster"]["clocks"]["start"]
    assert abs(start[s2]["offset_s"] - 2000) < 1 and abs(start[s1]["offset_s"] - 1000) < 1
    ev = events(two)
    ctl = ev[ev["node"] == "controller"].set_index("event")["ts_ns"]
    for node in ("ps", "w0", "w1"):
        ts = ev[ev["node"] == node]["ts_ns"]
        assert len(ts) > 0, node
        assert ctl["run_start"] <= ts.min() and ts.max() <= ctl["run_end"], node
    assert summary(two)["iterations"] == 12
    assert (ev["event"] == "trace_step").sum() >= 1
    changes = [ln for ln in (two / "run.log").read_text().splitlines()
               if "$ tc class change dev w0-eth0 " in ln]
    assert changes and all(ln.endswith(f"in w0, on {s2}") for ln in changes), changes[:3]
    loss_rules = [ln for ln in (two / "run.log").read_text().splitlines()
                  if "$ iptables" in ln and "statistic" in ln and "in w1," in ln]
    assert loss_rules and all(ln.endswith(f"on {s2}") for ln in loss_rules), loss_rules
    assert _server_leftovers(cluster) == []


def test_a_pipeline_spread_round_robin_sends_its_activations_across_servers(cluster, tmp_path):
    s1, s2 = cluster.servers
    run_dir, proc = gradbed_run("configs/pipeline.toml", [
        "pipeline.stages=2", "topo.hosts=3", "run.iterations=2", "pipeline.schedule='gpipe'",
        f'cluster.servers=["{s1}", "{s2}"]', 'cluster.placement="roundrobin"',
        f'cluster.ssh_config="{cluster.ssh_config}"'], tmp_path, timeout_s=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    placement = json.loads((run_dir / "meta.json").read_text())["cluster"]["placement"]
    # Stage 0 and the PS on server 2, stage 1 on server 1: every step crosses the tunnel.
    assert (placement["gbh0"], placement["gbh1"], placement["gbh2"]) == (s2, s1, s2)
    ev = events(run_dir)
    assert sorted(ev[ev["event"] == "pp_done"]["node"]) == ["s0", "s1"]
    loss = ev[(ev["event"] == "pp_step_done") & ev["loss"].notna()]
    assert len(loss) == 2
    # Every stage's final weights came back from its server.
    assert (run_dir / "s0_final_weights.pt").exists() and (run_dir / "s1_final_weights.pt").exists()
    assert _server_leftovers(cluster) == []


def test_moe_expert_hosts_on_two_servers_exchange_tokens_across_them(cluster, tmp_path):
    s1, s2 = cluster.servers
    run_dir, proc = gradbed_run("configs/moe.toml", [
        "topo.hosts=2", "moe.hosts=2", "moe.experts=4", "run.iterations=2",
        "moe.eval_every=100", f'cluster.servers=["{s1}", "{s2}"]',
        'cluster.placement="roundrobin"', f'cluster.ssh_config="{cluster.ssh_config}"'],
        tmp_path, timeout_s=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    placement = json.loads((run_dir / "meta.json").read_text())["cluster"]["placement"]
    assert {placement["gbh0"], placement["gbh1"]} == {s1, s2}
    ev = events(run_dir)
    assert sorted(ev[ev["event"] == "moe_done"]["node"]) == ["e0", "e1"]
    assert _server_leftovers(cluster) == []


def _wait_remote_iterations(c: FakeCluster, server: str, proc: subprocess.Popen[str],
                            iterations: int, timeout_s: float = 600) -> None:
    """Until the PS on ``server`` logged ``iterations`` iterations (its events are there
    until the run ends). The network lock may be another run's for a while first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        got = c.ssh(server, f"cat {REMOTE_ROOT}/*/events/ps.jsonl 2>/dev/null "
                            "| grep -c ps_iter_done || true").stdout.strip()
        if got.isdigit() and int(got) >= iterations:
            return
        time.sleep(0.5)
    if proc.poll() is None:
        proc.kill()
    _, err = proc.communicate(timeout=60)
    raise AssertionError(f"no {iterations} iterations on {server} (status {proc.poll()}): "
                         f"{err[-3000:]}")


def _forked_from_warm(c: FakeCluster, server: str, module: str) -> bool:
    """Whether ``module``'s agent on ``server`` is a child of that server's warm process
    (``controller.warm_remote``), not a fresh interpreter under its ssh session."""
    rows = [ln.split(None, 2) for ln in c.ssh(server, "ps -eo pid=,ppid=,args=").stdout
            .splitlines() if ln.strip()]
    warm = {pid for pid, _, args in rows if "controller.warm_remote serve" in args}
    agents = [ppid for _, ppid, args in rows
              if f"-m {module} " in args and "warm_remote" not in args]
    return len(warm) == 1 and len(agents) == 1 and agents[0] in warm


def test_a_killed_controller_leaves_nothing_on_the_servers_after_cleanup(cluster, tmp_path):
    s1, s2 = cluster.servers
    # One worker: what is left and cleaned on server 2 is the same for one as for two.
    proc = start_run("configs/test_tiny.toml",
                     _placed(cluster, s1, s2, "net.workers=1", "run.iterations=5000"),
                     tmp_path)
    _wait_remote_iterations(cluster, s1, proc, 1)
    # Each server's agents fork from its warm process, which dies with the controller.
    assert _forked_from_warm(cluster, s1, "agents.dp.ps")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert list(Path(tempfile.gettempdir()).glob(f"gbssh-{proc.pid}-*"))  # left behind
    (run_dir,) = tmp_path.glob("tiny-*")
    cleaned = subprocess.run([sys.executable, "-m", "controller.cli", "cleanup", "--wait-s",
                              "600", str(run_dir)],
                             cwd=REPO, capture_output=True, text=True, timeout=700)
    assert cleaned.returncode == 0, cleaned.stderr
    # Done on the servers themselves, over ssh: their lines name them.
    assert f"{s2}: " in cleaned.stdout and f"{s1}: gathered" in cleaned.stdout, cleaned.stdout
    assert _server_leftovers(cluster) == []
    # The dead controller's shared ssh connections and their folder are gone too.
    assert list(Path(tempfile.gettempdir()).glob(f"gbssh-{proc.pid}-*")) == [], cleaned.stdout
    assert summary(run_dir)["stop_reason"] == "controller killed"
    assert not (Path("/run/gradbed/runs") / f"{run_dir.name}.json").exists()
    assert (run_dir / "events" / "ps.parquet").exists()  # the PS's events, from server 1
    assert len(pd.read_parquet(run_dir / "events" / "w0.parquet")) > 0


def test_cleanup_leaves_a_server_whose_lock_another_run_holds_and_names_that_run(
        cluster, tmp_path):
    s1, s2 = cluster.servers
    record = {"servers": {s1: s1, s2: s2}, "ssh": {"ssh_config": str(cluster.ssh_config)},
              "remote_dir": f"{REMOTE_ROOT}/{tmp_path.name}"}
    access = SshAccess(ssh_config=str(cluster.ssh_config))
    other = ServerLock(s2, access.argv(s2), timeout_s=5, who="the other run")
    other.acquire()
    try:
        lines = cleanup_run(tmp_path, record, wait_s=1)
    finally:
        other.release()
    assert f"{s1}: network lock taken" in lines, lines
    busy = [ln for ln in lines if ln.startswith(f"{s2}: ")]
    assert len(busy) == 1 and busy[0].startswith(f"{s2}: not cleaned: another run holds "
                                                 "its network lock"), lines
    assert "the other run" in busy[0], busy
    # Once that run has let go, the server is cleaned under its lock.
    assert f"{s2}: network lock taken" in cleanup_run(tmp_path, record, wait_s=5)


def _seconds_after(clock: time.struct_time, line: str) -> int:
    """Whole seconds from the local time ``clock`` to a ``run.log`` line's stamp (the
    local time of day, to the second)."""
    h, m, sec = (int(x) for x in line.split()[0].split(":"))
    return ((h * 3600 + m * 60 + sec)
            - (clock.tm_hour * 3600 + clock.tm_min * 60 + clock.tm_sec)) % 86400


def _kill_delay_line_of(c: FakeCluster, server: str, host: str) -> int:
    """SIGKILL ``host``'s delay line on ``server`` (the one in its shell's network
    namespace, there); its pid on that server."""
    out = c.ssh(server, f"""
        ns=$(readlink /proc/$(pgrep -f 'mininet:{host}$' | head -1)/ns/net)
        for p in $(pgrep -f '[t]opo[.]delayline'); do
            if [ "$(readlink /proc/$p/ns/net)" = "$ns" ]; then kill -9 $p && echo $p; fi
        done""").stdout.split()
    assert len(out) == 1, f"{host}'s delay line on {server}: {out}"
    return int(out[0])


def test_a_delay_line_killed_on_a_server_ends_the_run_naming_host_and_server(
        cluster, tmp_path):
    s1, s2 = cluster.servers
    # 1 ms on the bottleneck: a delay line in the PS (server 1) and in w0 (server 2).
    proc = start_run("configs/test_tiny.toml",
                     _placed(cluster, s1, s2, "net.workers=1", "run.iterations=5000",
                             "net.delay_ms=1"), tmp_path)
    _wait_remote_iterations(cluster, s1, proc, 1)
    killed_clock = time.localtime()
    _kill_delay_line_of(cluster, s2, "w0")  # the delay line alone: its server lives on
    killed_at = time.monotonic()
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # not stopped: the test fails; the run tears down on SIGTERM
            proc.terminate()
            proc.communicate(timeout=120)
    (run_dir,) = tmp_path.glob("tiny-*")
    reason = summary(run_dir)["stop_reason"]
    # The watch sees the delay line's session end at once and gives its server's own watch
    # SERVER_GRACE_S to say the server died with it; the kill's ssh, reading the delay
    # line's stderr there and the log's whole seconds take a few more on a loaded machine.
    stopping = [ln for ln in (run_dir / "run.log").read_text().splitlines()
                if "delay line on" in ln and ln.endswith(": stopping")]
    assert stopping and _seconds_after(killed_clock, stopping[0]) <= SERVER_GRACE_S + 7, \
        stopping
    assert time.monotonic() - killed_at < 60, reason
    assert proc.returncode == FAILED == status_for(reason), (reason, err[-3000:])
    assert reason.startswith(f"failed: host w0: delay line on {s2} died (exit 137") \
        and reason.endswith("its link drops every packet"), reason
    w0 = next(h for h in json.loads((run_dir / "meta.json").read_text())["impairment"]
              ["hosts"] if h["host"] == "w0")
    assert str(w0["delay_line_died"]).startswith("exit 137"), w0
    # Nothing is left on either server, nor the run's records here.
    assert _server_leftovers(cluster) == []
    assert not (Path("/run/gradbed/runs") / f"{run_dir.name}.json").exists()
    assert not (Path("/run/gradbed/clusters") / f"{run_dir.name}.json").exists()


def test_a_killed_server_ends_the_run_with_status_6_naming_it(cluster, tmp_path):
    s1, s2 = cluster.servers
    # A delay on every link: the killed server's delay line (w0's, its one worker) dies
    # with it, and the run still names the server, not a delay line.
    proc = start_run("configs/test_tiny.toml",
                     _placed(cluster, s1, s2, "net.workers=1", "run.iterations=5000",
                             "net.delay_ms=1"), tmp_path)
    _wait_remote_iterations(cluster, s1, proc, 1)
    killed_at = time.monotonic()
    killed_clock = time.localtime()
    subprocess.run(["kill", "-9", str(cluster.sshd_pid(s2))], check=True)  # all of server 2
    _, err = proc.communicate(timeout=120)
    (run_dir,) = tmp_path.glob("tiny-*")
    reason = summary(run_dir)["stop_reason"]
    assert proc.returncode == SERVER_LOST == status_for(reason), (reason, err[-3000:])
    assert reason.startswith(f"server lost: {s2}"), reason
    ended = [ln for ln in (run_dir / "run.log").read_text().splitlines()
             if "server lost" in ln and ln.endswith(": stopping")]
    assert ended, "the run log does not say the server was lost"
    # Noticed within 30 s (run.log stamps each line with the local time of day).
    assert 0 <= _seconds_after(killed_clock, ended[0]) <= 30, ended[0]
    assert time.monotonic() - killed_at < 120  # stopped, torn down and finished
    # Server 1 is left clean; server 2 is gone.
    assert [ln for ln in _server_leftovers(cluster) if ln.startswith(f"{s1}: ")] == []
