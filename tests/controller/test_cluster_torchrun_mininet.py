"""``gradbed torchrun`` over two fake servers (``scripts/fake_cluster.sh``): the ranks of
each emulated host start on that host's server, are watched there and stopped there, and
their logs come back. Real Mininet, ssh, torchrun and gloo; root.

One cluster for the module, several short runs on a fabric of 2 hosts, one on each
server (no delay line, no trace); each run is as small as its checks allow:

- the example's DDP script for 2 steps, beside the same script over loopback on this
  machine (the reference). After training, rank 0 exits with status 3 and rank 1
  sleeps: the run must name rank 0 from its server's torchrun output and stop rank 1's
  tree on the other server;
- last (it kills server 2): one step, then both ranks sleep, and server 2's sshd is
  killed: the run ends with status 6 naming server 2, server 1's ranks stopped and its
  logs gathered.

A cluster of its own: the other cluster file kills a server in its last test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import pytest
import torch

from controller.exit_status import SERVER_LOST, status_for
from tests.support.fake_cluster import FakeCluster, fake_cluster
from tests.support.mininet_run import REPO, events, leftovers, summary

pytestmark = [pytest.mark.mininet,
              pytest.mark.skipif(not Path("/usr/sbin/sshd").exists(),
                                 reason="no sshd: GRADBED_WITH_SSHD=1 scripts/setup.sh")]

EXAMPLE = REPO / "examples" / "torchrun_ddp"
STEPS = 2
# The script's model: 64 -> 128 -> 10, float32; one all-reduce of it per step.
MODEL_BYTES = (64 * 128 + 128 + 128 * 10 + 10) * 4
REMOTE_ROOT = "/run/gradbed/remote"
# A run may first wait minutes for the machine-wide network lock behind other runs.
RUN_TIMEOUT_S = 900
#: The example's script (rank 0 saves the parameters), then rank 0 fails and rank 1
#: sleeps: its torchrun, on server 2, would never end by itself.
FAIL_AND_SLEEP = f"""import os, runpy, sys, time
runpy.run_path({str(EXAMPLE / "train.py")!r}, run_name="__main__")
if os.environ["RANK"] == "0":
    sys.exit(3)
time.sleep(600)
"""


#: One step, then both ranks sleep: a run that only its end (here, its server's) can stop.
SLEEP_AFTER_ONE = f"""import runpy, time
runpy.run_path({str(EXAMPLE / "train.py")!r}, run_name="__main__")
print("trained", flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeCluster]:
    with fake_cluster(tmp_path_factory.mktemp("fc") / "cluster", n=2) as c:
        yield c


def _server_leftovers(c: FakeCluster, servers: list[str] | None = None) -> list[str]:
    """torchrun trees, samplers, host shells, gradbed links and run directories still on
    ``servers`` (every server by default)."""
    def on(s: str) -> list[str]:
        text = c.ssh(s, "ps -eo args | grep -E '[t]orch[.]distributed|[h]ost_sampler|"
                        "[m]ininet:|[t]rain[.]py|[f]ail_and_sleep[.]py' || true; "
                        "ip -o link show | grep -E ': (gbsw|gbh)' || true; "
                        f"ls {REMOTE_ROOT} 2>/dev/null; true").stdout
        return [f"{s}: {ln}" for ln in text.splitlines() if ln.strip()]

    with ThreadPoolExecutor() as pool:
        return [ln for lines in pool.map(on, servers or c.servers) for ln in lines]


def test_ddp_ranks_on_two_servers_train_as_on_loopback_and_leave_nothing(
        cluster: FakeCluster, tmp_path: Path) -> None:
    s1, s2 = cluster.servers
    script = tmp_path / "fail_and_sleep.py"
    script.write_text(FAIL_AND_SLEEP)
    ref = tmp_path / "loopback"
    ref.mkdir()
    # The reference beside the run: 2 local processes, no emulation, one step more.
    loopback = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", str(EXAMPLE / "train.py"), "--steps", str(STEPS + 1), "--history",
         str(ref / "hist.pt")], cwd=ref, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    overrides = ["net.workers=2", "topo.traces={}", "net.delay_ms=0", "net.loss_pct=0",
                 f'cluster.servers=["{s1}", "{s2}"]',
                 f'cluster.pins={{gbh0="{s1}", gbh1="{s2}"}}',
                 f'cluster.ssh_config="{cluster.ssh_config}"']
    argv = [sys.executable, "-m", "controller.cli", "torchrun",
            str(EXAMPLE / "fabric4.toml"), "--out", str(tmp_path), "--no-progress",
            "--no-report", *(a for o in overrides for a in ("--set", o)), "--",
            str(script), "--steps", str(STEPS), "--save", str(tmp_path / "net.pt")]
    # As under sudo by root: each server looks the user up by name and the ranks run as
    # that user there (root is the one user every fake server has).
    env = {**os.environ, "PYTHONPATH": str(REPO), "SUDO_UID": "0", "SUDO_GID": "0"}
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=RUN_TIMEOUT_S)
    out, err = loopback.communicate(timeout=300)
    assert loopback.returncode == 0, err[-3000:]
    run_dir = Path(proc.stdout.strip().splitlines()[-1])
    reason = summary(run_dir)["stop_reason"]
    # Named from torchrun's own report, which came over ssh from server 1.
    assert reason == "rank 0 (host gbh0) exited with status 3; see logs/gbh0.log", \
        proc.stderr[-3000:]
    assert proc.returncode == status_for(reason)

    # The network changes timing, never the numbers; one step more is far away.
    got, history = torch.load(tmp_path / "net.pt"), torch.load(ref / "hist.pt")
    gap = [max(float((x - y).abs().max()) for x, y in zip(got, h, strict=True))
           for h in history]
    assert gap[STEPS - 1] <= 1e-6 and gap[STEPS] > 1e-3, gap

    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["cluster"]["placement"]["gbh0"] == s1
    assert meta["cluster"]["placement"]["gbh1"] == s2
    log = (run_dir / "run.log").read_text()
    assert f"start gbh1: torchrun node 1, rank 1, on {s2}" in log
    assert "--reuid=0" in log  # the user, as that server knows it
    # gbh1's torchrun still ran: its tree (torchrun and its sleeping rank, in a session
    # of its own) was stopped on server 2; server 1's had ended with its rank.
    stopped = [ln for ln in log.splitlines() if f"ranks stopped on {s2}: stopped " in ln]
    assert stopped and int(stopped[0].split("stopped ")[-1].split()[0]) >= 2, stopped
    assert f"ranks stopped on {s1}: stopped 0 process(es)" in log
    assert tr_codes(run_dir) == {"0": 3, "1": -15}

    # Watched on each server: the rank's connections to the other server's host, and
    # the interface counters, carry at least one all-reduce of the model per step, all
    # of it over the tunnel between the servers.
    tr = summary(run_dir)["torchrun"]
    assert tr["sampler_error"] is None, tr
    b = tr["bytes"]
    for h in ("gbh0", "gbh1"):
        trained = b["payload_sent_bytes"][h] - b["store_sent_bytes"][h]
        assert trained >= STEPS * MODEL_BYTES, b
        assert b["interface_tx_bytes"][h] >= b["payload_sent_bytes"][h], b
    tcp = pd.read_parquet(run_dir / "tcp.parquet")
    crossing = tcp[(tcp["host"] == "gbh1") & (tcp["dst"] == "10.0.0.10") & tcp["final"]]
    assert crossing["bytes_acked"].sum() >= STEPS * MODEL_BYTES
    # Stamped on this machine's clock, not server 2's (2000 s ahead).
    ev = events(run_dir)
    ctl = ev[ev["node"] == "controller"].set_index("event")["ts_ns"]
    g1 = tcp[tcp["host"] == "gbh1"]["ts_ns"]
    assert ctl["run_start"] <= g1.min() and g1.max() <= ctl["run_end"]

    # torchrun's output came back live; its per-rank logs by the gathering.
    assert "step 2/" in (run_dir / "logs" / "gbh0.log").read_text(errors="replace")
    rank_logs = [p for p in (run_dir / "logs" / "ranks" / "gbh1").rglob("*.log")
                 if p.stat().st_size > 0]
    assert rank_logs, sorted((run_dir / "logs").rglob("*"))
    # gbh1's torchrun, stopped by SIGTERM, wrote its error file on server 2.
    assert json.loads((run_dir / "logs" / "ranks" / "gbh1" / "error.json").read_text())
    assert not (run_dir / "torchrun-pids").exists()

    assert _server_leftovers(cluster) == []
    assert [x for x in leftovers() if "gbh" in x or "torch.distributed" in x] == []


def tr_codes(run_dir: Path) -> dict[str, int]:
    return dict(summary(run_dir)["torchrun"]["exit_codes"])


def _start(c: FakeCluster, tmp_path: Path, script_text: str, *extra: str
           ) -> subprocess.Popen[str]:
    """``gradbed torchrun`` of ``script_text`` for one step on gbh0 (server 1) and gbh1
    (server 2), in the background."""
    s1, s2 = c.servers
    script = tmp_path / "script.py"
    script.write_text(script_text)
    overrides = ["net.workers=2", "topo.traces={}", "net.delay_ms=0", "net.loss_pct=0",
                 f'cluster.servers=["{s1}", "{s2}"]',
                 f'cluster.pins={{gbh0="{s1}", gbh1="{s2}"}}',
                 f'cluster.ssh_config="{c.ssh_config}"', *extra]
    argv = [sys.executable, "-m", "controller.cli", "torchrun",
            str(EXAMPLE / "fabric4.toml"), "--out", str(tmp_path), "--no-progress",
            "--no-report", *(a for o in overrides for a in ("--set", o)), "--",
            str(script), "--steps", "1"]
    # As under sudo by root, as the first run (no warm process here: no host is here).
    env = {**os.environ, "PYTHONPATH": str(REPO), "SUDO_UID": "0", "SUDO_GID": "0"}
    return subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _wait_trained(tmp_path: Path, proc: subprocess.Popen[str], timeout_s: float = 600
                  ) -> Path:
    """The run directory once rank 0 (gbh0, its output live over ssh) has trained."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        for log in tmp_path.glob("torchrun-ddp-*/logs/gbh0.log"):
            if "trained" in log.read_text(errors="replace"):
                return log.parents[1]
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    _, err = proc.communicate(timeout=60)
    raise AssertionError(f"rank 0 never trained (status {proc.returncode}): {err[-3000:]}")


def test_a_server_lost_mid_torchrun_ends_with_status_6_and_server_1_clean(
        cluster: FakeCluster, tmp_path: Path) -> None:
    """Last: server 2 is gone afterwards."""
    s1, s2 = cluster.servers
    proc = _start(cluster, tmp_path, SLEEP_AFTER_ONE)
    run_dir = _wait_trained(tmp_path, proc)
    subprocess.run(["kill", "-9", str(cluster.sshd_pid(s2))], check=True)  # all of server 2
    _, err = proc.communicate(timeout=120)
    reason = summary(run_dir)["stop_reason"]
    assert reason.startswith(f"server lost: {s2} "), (reason, err[-3000:])
    assert proc.returncode == SERVER_LOST == status_for(reason)
    log = (run_dir / "run.log").read_text()
    assert f"{reason}: stopping" in log
    # Server 1's ranks were stopped there; server 2 was not waited for.
    stopped = [ln for ln in log.splitlines() if f"ranks stopped on {s1}: stopped " in ln]
    assert stopped and int(stopped[0].split("stopped ")[-1].split()[0]) >= 2, stopped
    assert f"ranks stopped on {s2}: not reached (server lost)" in log
    assert f"{s1}: gathered" in log
    assert list((run_dir / "logs" / "ranks" / "gbh0").rglob("*.log"))
    assert json.loads((run_dir / "meta.json").read_text())["cluster"]["lost"].keys() == {s2}
    assert _server_leftovers(cluster, [s1]) == []
    assert [x for x in leftovers() if "gbh" in x or "torch.distributed" in x] == []
