"""``gradbed torchrun`` in real Mininet (root), on the example's fabric and on the star.

A run costs a network, a torch import per rank (each host's torchrun agent is a fork of
one process that imported it) and a teardown on a shared 2-core machine, so there are six,
each as small as its checks allow, and a run that several tests read is made once per
module:

- the example's DDP script on its 4 fabric hosts (5 ms and 0.1 % loss on every uplink,
  gbh3's replaying the cellular trace) ends with the parameters of the same script on
  loopback, and its run directory records every rank, connection and shaping point
  (tcp.parquet in trace.json; the report's per-host table and plot);
- on the star through c10d rendezvous, each uplink capped by tc at B/N: three ranks'
  ring all-reduce moves 2(N-1)/N x S per host no faster than the cap allows, while the
  fourth rank's group never leaves its host and the run fails naming it (a bypass);
- an FSDP script on 2 hosts: its parameters match DDP's on loopback, its bytes those of
  its collectives;
- on 2 hosts without delay lines: a rank that exits non-zero, one that never reaches
  init_process_group, and Ctrl-C each end the run naming the cause, with a loadable run
  directory and nothing left behind; the Ctrl-C run is ``sudo gradbed torchrun`` by
  nobody, whose torchrun agents fork from a warm process that runs as nobody, and whose
  agents and ranks run as nobody without a capability.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import torch

from analysis.load import load_run
from controller.summary import UNINSTRUMENTED_WHY
from tests.support.mininet_run import REPO, events, leftovers, summary

pytestmark = pytest.mark.mininet

EXAMPLE = REPO / "examples" / "torchrun_ddp"
CONFIG = EXAMPLE / "fabric4.toml"
#: DDP and FSDP both train this many steps; the loopback reference runs one more.
STEPS = 3
#: The runs that check how a run ends: 2 of the fabric's hosts, no trace, no delay line.
SMALL = ["net.workers=2", "topo.traces={}", "net.delay_ms=0", "net.loss_pct=0"]
#: torchrun.stall_s of the rank that never reaches init_process_group (see its test).
LATE_STALL_S = 5


def mine_left() -> list[str]:
    """What these runs could leave: the fabric's hosts (gbh*) and torchrun processes.
    Other engineers' networks on this machine (stars, fake clusters) are not counted."""
    return [x for x in leftovers() if "gbh" in x or "torch.distributed" in x]


def torchrun_argv(out: Path, script: Path, args: list[str], overrides: list[str],
                  report: bool) -> list[str]:
    argv = [sys.executable, "-m", "controller.cli", "torchrun", str(CONFIG), "--out",
            str(out), "--no-progress", *([] if report else ["--no-report"])]
    for o in overrides:
        argv += ["--set", o]
    return [*argv, "--", str(script), *args]


def start_torchrun(out: Path, script: Path, args: list[str], overrides: list[str] = (),
                   report: bool = False, sudo_uid: int | None = None
                   ) -> subprocess.Popen[str]:
    """``sudo_uid``: as ``sudo gradbed torchrun`` run by that user (SUDO_UID, SUDO_GID)."""
    # From the test's folder (the ranks start where gradbed was started), with this
    # checkout first on the path.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if sudo_uid is not None:
        env |= {"SUDO_UID": str(sudo_uid), "SUDO_GID": str(sudo_uid)}
    return subprocess.Popen(torchrun_argv(out, script, args, list(overrides), report),
                            cwd=out, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


@dataclass(frozen=True)
class Done:
    run_dir: Path
    status: int
    stderr: str


def finish(proc: subprocess.Popen[str], timeout_s: float = 1200) -> Done:
    """Wait for ``gradbed torchrun`` (the timeout covers waiting for the machine-wide network
    lock, which other runs may hold for minutes) and check it left nothing behind."""
    out, err = proc.communicate(timeout=timeout_s)
    lines = out.strip().splitlines()
    assert lines, f"gradbed torchrun printed nothing; stderr:\n{err[-3000:]}"
    assert mine_left() == []
    return Done(Path(lines[-1]), proc.returncode, err)


def gradbed_torchrun(out: Path, script: Path, args: list[str], overrides: list[str] = (),
                     report: bool = False) -> Done:
    return finish(start_torchrun(out, script, args, overrides, report))


def write_script(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def loopback_started(tmp_path_factory: pytest.TempPathFactory
                     ) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """The DDP script on loopback (4 local processes, no emulation), STEPS + 1 steps, started
    before the example's Mininet run so that it runs beside that run's network set-up,
    waits and teardown. Its ranks are forks of one process that imported torch
    (tests.support.fork_ranks): 4 ranks and a torchrun agent each importing it would take
    the CPU the emulated run's own imports need."""
    d = tmp_path_factory.mktemp("loopback")
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.fork_ranks", "4",
                             str(EXAMPLE / "train.py"),
                             "--steps", str(STEPS + 1), "--history", str(d / "hist.pt")],
                            cwd=d, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    yield proc, d
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def loopback(loopback_started: tuple[subprocess.Popen[str], Path]
             ) -> list[list[torch.Tensor]]:
    """The loopback run's parameters after every step."""
    proc, d = loopback_started
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return list(torch.load(d / "hist.pt"))


def gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


# -- the example's DDP run ------------------------------------------------------------------


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory,
        loopback_started: tuple[subprocess.Popen[str], Path]) -> tuple[Done, Path]:
    d = tmp_path_factory.mktemp("ddp")
    done = gradbed_torchrun(d, EXAMPLE / "train.py",
                            ["--steps", str(STEPS), "--save", str(d / "net.pt")], report=True)
    assert done.status == 0, done.stderr[-3000:]
    return done, d / "net.pt"


def test_ddp_parameters_equal_loopback_and_one_more_step_is_far(
        ddp: tuple[Done, Path], loopback: list[list[torch.Tensor]]) -> None:
    got = torch.load(ddp[1])
    assert gap(got, loopback[STEPS - 1]) <= 1e-6
    assert gap(got, loopback[STEPS]) > 1e-3  # the check can fail: one extra step is far away


def test_ddp_run_directory_records_ranks_bytes_and_shaping(ddp: tuple[Done, Path]) -> None:
    run_dir = ddp[0].run_dir
    s = summary(run_dir)
    assert s["stop_reason"] == "completed", s
    assert s["torchrun"]["exit_codes"] == {"0": 0, "1": 0, "2": 0, "3": 0}
    b = s["torchrun"]["bytes"]
    # Every host's ranks crossed its link, beyond the rendezvous.
    assert all(b["payload_sent_bytes"][h] > b["store_sent_bytes"][h] for h in
               b["payload_sent_bytes"]), b
    assert load_run(run_dir).summary == s
    assert 0 < s["torchrun"]["points_busy_utilization"]["gbh3.up"] <= 1.05  # the traced uplink
    hosts = json.loads((run_dir / "meta.json").read_text())["torchrun"]["hosts"]
    assert hosts["gbh2"]["env"]["GLOO_SOCKET_IFNAME"] == "gbh2-eth0"
    # Every host's torchrun agent was a fork of the process that imported torch once.
    assert all(h["forked"] for h in hosts.values()), hosts
    # The example does not instrument DDP: no transfer window, so no regime, and why.
    assert s["agent_limited"] is None and s["agent_limited_why"] == UNINSTRUMENTED_WHY, s
    # The class sampler ran, on every access link of the fabric.
    points = set(pd.read_parquet(run_dir / "classes.parquet")["point"])
    assert points == {f"gbh{i}.{d}" for i in range(4) for d in ("up", "down")}, points


def test_ddp_connections_appear_in_the_trace_and_the_report(ddp: tuple[Done, Path]) -> None:
    run = load_run(ddp[0].run_dir)
    remote = run.tcp[~run.tcp["local"].astype(bool)]
    assert set(remote["host"]) == {"gbh0", "gbh1", "gbh2", "gbh3"}
    evs = json.loads((run.path / "trace.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in evs if e["name"] == "process_name"}
    rates = [e for e in evs if e["ph"] == "C" and e["name"].startswith("tcp ")
             and e["name"].endswith("(Mbit/s)")]
    # Each host's connections are counter tracks of its own process.
    assert {names[e["pid"]] for e in rates} == {"gbh0", "gbh1", "gbh2", "gbh3"}
    ips = {h: v["ip"] for h, v in run.summary["torchrun"]["hosts"].items()}
    for e in rates:  # "tcp SRC:PORT>DST:PORT (Mbit/s)", SRC the host's own address
        assert ips[names[e["pid"]]] in e["name"].split()[1].split(">")[0], e["name"]
    assert max(e["args"]["sent"] for e in rates) > 0
    page = (run.path / "report" / "index.html").read_text(encoding="utf-8")
    assert "TCP connections between hosts (tcp.parquet" in page
    # The hosts' table: each host, its rank's exit code and its payload as the summary has it.
    table = page.split("Hosts of the torchrun run: ranks, exit codes and bytes")[1]
    table = table[:table.index("</table>")]
    sent = run.summary["torchrun"]["bytes"]["payload_sent_bytes"]
    rows = {r.split("</td>")[0].split(">")[-1]: r for r in table.split("<tr>")[1:]}
    assert sorted(rows) == ["gbh0", "gbh1", "gbh2", "gbh3"], table
    for rank, host in enumerate(["gbh0", "gbh1", "gbh2", "gbh3"]):  # on the host's own row
        assert f"<td>{rank}:0</td>" in rows[host] and f">{sent[host]}</td>" in rows[host], \
            (host, rows[host])
    # The regime in words: unknown for an uninstrumented script, and why.
    assert "Regime: unknown: the script&#x27;s collectives" in page


# -- a ring of three, a bypass and link/N caps by tc, in one run on the star --------------

RING_FLOATS = 1_000_000
#: The star's bottleneck B: with shaping.method = "tc" each of the 4 workers' uplinks is
#: capped at B/4 = 25 Mbit/s (their links run at 1000).
RING_B_MBPS = 100

RING_SCRIPT = (
    "import os, json, time, datetime, torch, torch.distributed as dist\n"
    "rank, wait = int(os.environ['RANK']), datetime.timedelta(seconds=120)\n"
    "# Stores of its own (an init_method URL would be read as torchrun's agent store).\n"
    "if rank == 2:  # ignores the launcher: a group of one on loopback\n"
    "    store = dist.TCPStore('127.0.0.1', 29601, 1, True, wait)\n"
    "    dist.init_process_group('gloo', store=store, rank=0, world_size=1)\n"
    "else:\n"
    "    store = dist.TCPStore(os.environ['MASTER_ADDR'], 29602, 3, rank == 0, wait)\n"
    "    dist.init_process_group('gloo', store=store, rank=[0, 1, 3].index(rank),\n"
    "                            world_size=3)\n"
    f"t = torch.ones({RING_FLOATS})\n"
    "dist.barrier()\n"
    "t0 = time.monotonic()\n"
    "dist.all_reduce(t)\n"
    "if rank == 0:\n"
    "    print(json.dumps({'allreduce_s': time.monotonic() - t0}), flush=True)\n"
    "    # Hold the run while the test knocks on the store from other hosts.\n"
    "    with open('store_probe.wait', 'w') as f:\n"
    "        f.write(os.environ['MASTER_ADDR'] + ' ' + os.environ['MASTER_PORT'])\n"
    "    end = time.monotonic() + 90\n"
    "    while not os.path.exists('store_probe.done') and time.monotonic() < end:\n"
    "        time.sleep(0.1)\n"
    "dist.barrier()\n"
    "dist.destroy_process_group()\n")

PROBE = ("import socket, sys\n"
         "try:\n"
         "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()\n"
         "    print('connected')\n"
         "except ConnectionRefusedError:\n"
         "    print('refused')\n"
         "except OSError as e:\n"
         "    print(type(e).__name__)\n")


def _host_shell_pid(host: str) -> int:
    """The pid of Mininet's shell for ``host`` (its network namespace)."""
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and (p / "cmdline").read_bytes().split(b"\0")[-2:-1] == \
                    [f"mininet:{host}".encode()]:
                return int(p.name)
        except OSError:
            continue
    raise AssertionError(f"no Mininet shell for {host}")


def _knock_on_the_store(d: Path, proc: subprocess.Popen[str]) -> None:
    """While rank 0 holds the run, connect to the c10d store from the PS host (not a
    training host) and from w1 (one), and write what each got to store_probe.json."""
    wait = d / "store_probe.wait"
    deadline = time.monotonic() + 900  # the network lock may be another run's first
    while not wait.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    got: dict[str, str] = {}
    try:
        if wait.exists():
            time.sleep(0.2)  # the address is written
            addr, port = wait.read_text().split()
            for host in ("ps", "w1"):
                out = subprocess.run(["nsenter", "-t", str(_host_shell_pid(host)), "-n",
                                      sys.executable, "-c", PROBE, addr, port],
                                     capture_output=True, text=True, timeout=30)
                got[host] = out.stdout.strip() or out.stderr.strip()[-300:]
    finally:
        (d / "store_probe.json").write_text(json.dumps(got))
        (d / "store_probe.done").touch()


@pytest.fixture(scope="module")
def ring(tmp_path_factory: pytest.TempPathFactory) -> Done:
    """4 workers of the star through c10d rendezvous, each uplink capped by tc at B/4:
    ranks 0, 1 and 3 all-reduce RING_FLOATS floats over the emulated links, rank 2 makes
    a group of its own on 127.0.0.1, so only its rendezvous crosses its link. Every rank
    exits 0; the run fails naming rank 2 and the loopback."""
    d = tmp_path_factory.mktemp("ring")
    script = write_script(d, "ring.py", RING_SCRIPT)
    proc = start_torchrun(d, script, [], [
        "topo.shape='star'", "topo.traces={}", "net.loss_pct=0", "net.delay_ms=0",
        "net.worker_link_mbps=1000", f"net.bottleneck_mbps={RING_B_MBPS}",
        "shaping.method='tc'", "torchrun.rdzv='c10d'"])
    _knock_on_the_store(d, proc)
    return finish(proc)


def test_only_training_hosts_reach_the_c10d_store(ring: Done) -> None:
    """torch's stores and gloo's listeners are outside gradbed's admission: a training
    host lets only the training hosts connect (roles.torchrun.admission_rules). The PS
    host, which trains nothing in a torchrun run, is reset at the ranks' store on rank 0's
    host (the port torchrun picked); w1 connects."""
    got = json.loads((ring.run_dir.parent / "store_probe.json").read_text())
    assert got == {"ps": "refused", "w1": "connected"}, got
    log = (ring.run_dir / "run.log").read_text()
    assert log.count("--comment gradbed-torchrun-admission -j REJECT") == 4, log[-3000:]


def test_ring_allreduce_through_c10d_rendezvous_moves_two_n_minus_one_over_n(
        ring: Done) -> None:
    argv = json.loads((ring.run_dir / "meta.json").read_text())["torchrun"]["hosts"]
    assert argv["w1"]["argv"][argv["w1"]["argv"].index("--rdzv-backend") + 1] == "c10d"
    b = summary(ring.run_dir)["torchrun"]["bytes"]
    members = 3
    want = 2 * (members - 1) / members * 4 * RING_FLOATS
    for host in ("w0", "w1", "w3"):
        sent = b["payload_sent_bytes"][host]
        assert abs(sent - want) / want < 0.02, (host, sent, want)
        assert abs(b["payload_received_bytes"][host] - want) / want < 0.02
        # Headers and ACKs ride on top of the payload on the emulated interface.
        assert sent < b["interface_tx_bytes"][host] < 1.1 * sent + 200_000


def test_a_rank_whose_group_never_leaves_its_host_is_a_bypass(ring: Done) -> None:
    assert ring.status == 1, ring.stderr[-3000:]
    s = load_run(ring.run_dir).summary
    assert s["stop_reason"].startswith("failed: training traffic bypassed the emulated "
                                       "links: hosts w2 (rank 2) sent no TCP payload to "
                                       "another host but rendezvous (w2 over loopback"), s
    assert s["torchrun"]["exit_codes"] == {"0": 0, "1": 0, "2": 0, "3": 0}
    assert "w2 (rank 2)" in ring.stderr


def test_tc_caps_every_rank_s_uplink_at_b_over_n(ring: Done) -> None:
    """shaping.method = "tc" under torchrun: each worker's egress class is set to B/N
    (the controller's shape events) and the ring's all-reduce could go no faster (its
    links alone would carry it 40 times faster)."""
    ev = events(ring.run_dir)
    shape = ev[ev["event"] == "shape"]
    # Only uplinks: the downlink's caps are the PS pacing its sockets, and no PS runs.
    assert set(shape["direction"]) == {"up"}, shape
    caps = {int(w): r for w, r, m in zip(shape["worker"], shape["rate_mbps"],
                                         shape["method"], strict=True) if m == "tc"}
    assert caps == {w: RING_B_MBPS / 4 for w in range(4)}, shape
    line = next(ln for ln in (ring.run_dir / "logs" / "w0.log").read_text().splitlines()
                if "allreduce_s" in ln)
    took_s = json.loads(line[line.index("{"):])["allreduce_s"]
    members = 3
    floor_s = 2 * (members - 1) / members * 4 * RING_FLOATS * 8 / (RING_B_MBPS / 4 * 1e6)
    assert took_s > 0.9 * floor_s, (took_s, floor_s)


# -- FSDP ------------------------------------------------------------------------------------


def test_an_fsdp_script_shards_over_the_emulated_links(
        tmp_path: Path, loopback: list[list[torch.Tensor]]) -> None:
    """FSDP2 (``fully_shard``) over gloo on 2 hosts: the parameters after K steps are the
    4-rank DDP script's on loopback (both average the gradient over the same global batch;
    a reduce-scatter sums in another order: 1e-5), and every host sends between one
    all-gather plus one reduce-scatter of the parameters per step and five times that
    (forward and backward all-gathers, a reduce-scatter gloo may run as an all-reduce),
    plus the rendezvous."""
    hosts, hidden = 2, 128
    done = gradbed_torchrun(tmp_path, EXAMPLE / "fsdp.py",
                            ["--steps", str(STEPS), "--save", str(tmp_path / "f.pt")],
                            SMALL)
    assert done.status == 0, done.stderr[-3000:]
    params_bytes = 4 * (64 * hidden + hidden + hidden * 10 + 10)
    shard = (hosts - 1) / hosts * params_bytes
    sent = summary(done.run_dir)["torchrun"]["bytes"]["payload_sent_bytes"]
    assert sorted(sent) == ["gbh0", "gbh1"]
    for host, n in sent.items():
        assert 2 * shard * STEPS < n < 5 * shard * (STEPS + 1) + 100_000, (host, n)
    assert gap(torch.load(tmp_path / "f.pt"), loopback[STEPS - 1]) < 1e-5


# -- runs that end otherwise (2 hosts, no delay line) ----------------------------------------


def test_a_rank_that_fails_ends_the_run_naming_it(tmp_path: Path) -> None:
    """Rank 1 exits 3 while rank 0 waits in a barrier, which then fails (status 1): the
    run names rank 1, the first to fail, not its peer."""
    script = write_script(tmp_path, "fails.py",
                          "import sys, torch.distributed as dist\n"
                          "dist.init_process_group('gloo')\n"
                          "dist.barrier()\n"
                          "if dist.get_rank() == 1:\n    sys.exit(3)\n"
                          "dist.barrier()\n")
    done = gradbed_torchrun(tmp_path, script, [], SMALL)
    assert done.status == 4, done.stderr[-3000:]
    s = load_run(done.run_dir).summary
    assert s["stop_reason"].startswith("rank 1 (host gbh1) exited with status 3"), s
    codes = s["torchrun"]["exit_codes"]
    assert sorted(codes) == ["0", "1"] and codes["1"] == 3, codes
    assert "rank 1 (host gbh1) exited with status 3" in done.stderr


def test_a_rank_that_never_reaches_init_process_group_is_named(tmp_path: Path) -> None:
    """Rank 1 sleeps before it imports torch and calls init_process_group; rank 0 waits in
    its. After torchrun.stall_s without a byte or CPU the run ends naming rank 1 and its
    variables, long before gloo's 30-minute timeout. stall_s is far below the 10-20 s a
    torch import takes on a loaded 2-core machine: rank 0's host, importing, uses CPU, so
    it is not judged, and once its rank waits in init_process_group for rank 1, it is not
    judged either."""
    script = write_script(tmp_path, "late.py",
                          "import os, time\n"
                          "if os.environ['RANK'] == '1':\n    time.sleep(600)\n"
                          "import torch.distributed as dist\n"
                          "dist.init_process_group('gloo')\n"
                          "dist.barrier()\n")
    done = gradbed_torchrun(tmp_path, script, [], [*SMALL, f"torchrun.stall_s={LATE_STALL_S}"])
    assert done.status == 3, done.stderr[-3000:]  # a rank that never came up: failed start
    reason = load_run(done.run_dir).summary["stop_reason"]
    assert reason.startswith("failed to start: rank 1 (host gbh1) never reached "
                             "init_process_group"), reason
    assert "GLOO_SOCKET_IFNAME=gbh1-eth0" in reason and "10.0.0.10:29500" in reason
    assert summary(done.run_dir)["wall_s"] < 200


def _identities(cwd: Path) -> dict[str, dict[str, list[str]]]:
    """The ids and capabilities (``/proc/PID/status``) of every torchrun agent and rank
    that runs in ``cwd`` (the run's own: gradbed starts them where it was started), by
    ``PID command``."""
    out = {}
    for p in Path("/proc").iterdir():
        try:
            if not p.name.isdigit() or os.readlink(p / "cwd") != str(cwd):
                continue
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "train.py" not in cmd or "controller.cli" in cmd:
                continue
            status = dict(ln.split(":", 1) for ln in (p / "status").read_text().splitlines()
                          if ":" in ln)
        except OSError:  # gone meanwhile
            continue
        out[f"{p.name} {cmd[:80]}"] = {k: status[k].split() for k in
                                       ("Uid", "Gid", "CapPrm", "CapEff", "CapAmb")}
    return out


def test_ctrl_c_during_training_stops_the_run_cleanly() -> None:
    """SIGINT to ``sudo gradbed torchrun`` (as nobody) once rank 0 trains (as a terminal's
    Ctrl-C reaches it; the ranks run in sessions of their own): status 130, a run directory
    that loads and says so, every rank stopped, nothing left behind. Until then, each
    host's torchrun agent, a fork of the warm process, and every rank it started ran as
    the user, without a capability: the warm process ran as the user too (as root, its
    forks would be root)."""
    # A folder the user may enter, as the one a user runs sudo from is (the test's own
    # temporary folders are root's alone).
    d = Path(tempfile.mkdtemp(prefix="gradbed-torchrun-sudo-"))
    d.chmod(0o755)
    try:
        _ctrl_c_as_nobody(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _ctrl_c_as_nobody(d: Path) -> None:
    nobody = 65534
    proc = start_torchrun(d, EXAMPLE / "train.py", ["--steps", "1000000"], SMALL,
                          sudo_uid=nobody)
    deadline = time.monotonic() + 1200  # the network lock may be another run's first
    while time.monotonic() < deadline and proc.poll() is None:
        logs = list(d.glob("*/logs/gbh0.log"))
        if logs and "step 2/" in logs[0].read_text(errors="replace"):
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    seen = _identities(d)
    proc.send_signal(signal.SIGINT)
    done = finish(proc, timeout_s=120)
    assert done.status == 130, done.stderr[-3000:]
    # Two hosts: each a torchrun agent and its rank.
    assert sum("torch.distributed.run" in k for k in seen) == 2, seen
    assert len(seen) == 4, seen
    for who, ids in seen.items():
        assert ids["Uid"] == [str(nobody)] * 4 and ids["Gid"] == [str(nobody)] * 4, (who, ids)
        assert {int(ids[c][0], 16) for c in ("CapPrm", "CapEff", "CapAmb")} == {0}, (who, ids)
    torchrun = json.loads((done.run_dir / "meta.json").read_text())["torchrun"]
    assert torchrun["run_as"] == [nobody, nobody]
    assert {h: v["forked"] for h, v in torchrun["hosts"].items()} == {"gbh0": True,
                                                                     "gbh1": True}
    assert done.run_dir.stat().st_uid == nobody  # handed over, as every sudo run's
    run = load_run(done.run_dir)
    assert run.summary["stop_reason"] == "interrupted by SIGINT", run.summary
    assert run.summary["interrupted"] is True
    # torchrun was stopped with SIGTERM (after which it would have ended its ranks).
    assert set(run.summary["torchrun"]["exit_codes"].values()) <= {-signal.SIGTERM, -9}
    assert (run.path / "tcp.parquet").exists() and (run.path / "trace.json").exists()
