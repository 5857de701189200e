"""Admission of unauthenticated connections (agents.net.admission, the handshake driver's
``accept_forever``): the pure policy and its aggregated refusals, then a real PS process
under a flood of slow connections from other loopback addresses while its real workers
join and train."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agents.core.config import ConfigError
from agents.core.config import load as load_config
from agents.core.events import read_jsonl
from agents.net.admission import Admission, AdmissionLimits, RefusalLog, Ticket
from controller import warm
from controller.loopback import hostile
from controller.loopback.dp import REPO, free_port, make_run_dir, start_ps, start_worker

LIMITS = AdmissionLimits(per_source=2, total=4, connects_per_source_per_s=5,
                         report_interval_s=1.0)


def test_a_source_holds_at_most_per_source_slots_and_gets_them_back() -> None:
    gate = Admission(LIMITS)
    a, b = gate.admit("10.0.0.9", 0.0), gate.admit("10.0.0.9", 0.1)
    assert isinstance(a, Ticket) and isinstance(b, Ticket)
    assert gate.admit("10.0.0.9", 0.2) == "2 unauthenticated connections already"
    gate.release(a)
    assert isinstance(gate.admit("10.0.0.9", 0.3), Ticket)
    assert gate.unauthenticated == 2


def test_connects_per_second_are_counted_even_when_slots_are_free() -> None:
    gate = Admission(LIMITS)
    for i in range(5):
        t = gate.admit("10.0.0.9", 0.1 * i)
        assert isinstance(t, Ticket)
        gate.release(t)
    assert gate.admit("10.0.0.9", 0.6) == "more than 5 connections a second"
    assert isinstance(gate.admit("10.0.0.9", 1.2), Ticket)  # a new second


def test_an_expected_source_gets_in_while_strangers_hold_every_shared_slot() -> None:
    gate = Admission(LIMITS, expected=["10.0.0.2", "10.0.0.3"])
    # Two shared slots (4 - 2 reserved), taken by two flooding hosts.
    assert isinstance(gate.admit("10.0.0.100", 0.0), Ticket)
    assert isinstance(gate.admit("10.0.0.101", 0.0), Ticket)
    assert gate.admit("10.0.0.102", 0.0) == "4 unauthenticated connections at once"
    w2 = gate.admit("10.0.0.2", 0.0)
    assert isinstance(w2, Ticket) and w2.reserved
    assert isinstance(gate.admit("10.0.0.3", 0.0), Ticket)
    # Its own slot is one: a second connection from it waits like a stranger's.
    assert gate.admit("10.0.0.2", 0.0) == "4 unauthenticated connections at once"
    gate.release(w2)
    assert isinstance(gate.admit("10.0.0.2", 0.1), Ticket)


def test_refusals_are_one_report_per_source_and_reason_per_interval() -> None:
    log = RefusalLog(1.0)
    first = log.note("10.0.0.9", "limit", "e1", 0.0)
    assert [(r.source, r.reason, r.count) for r in first] == [("10.0.0.9", "limit", 1)]
    for i in range(999):
        assert log.note("10.0.0.9", "limit", f"e{i + 2}", 0.0005 * i) == []
    (later,) = log.note("10.0.0.9", "limit", "last", 1.0)
    assert (later.count, later.example) == (1000, "last")
    other = log.note("10.0.0.8", "limit", "x", 1.1)  # another source: its own report
    assert [r.source for r in other] == ["10.0.0.8"]
    log.note("10.0.0.8", "limit", "y", 1.2)
    assert [r.count for r in log.due(1.3, everything=True)] == [1]


def test_guard_admission_fields_are_validated_with_the_field_named() -> None:
    for bad, field in (("guard.max_handshakes_per_source=0", "max_handshakes_per_source"),
                       ("guard.max_handshakes=4", "max_handshakes"),
                       ("guard.max_connects_per_source_per_s=0", "max_connects_per_source_per_s"),
                       ("guard.refusal_report_interval_s=inf", "refusal_report_interval_s")):
        with pytest.raises(ConfigError, match=f"guard.{field}"):
            load_config(Path("configs/digits.toml"), [bad])


# -- a real PS under a flood --------------------------------------------------------------

# The PS's pool is made small through config (guard.max_handshakes) so that a flood of a
# few dozen slow connections from two background addresses could fill it: only the bound
# per source keeps room for the workers (both dial from 127.0.0.1, whose own slot admits
# one handshake at a time). Ten times the connections would show nothing more, and their
# reconnect loop takes the CPU the test's workers need.
FLOOD_SOURCES = ["127.0.0.2", "127.0.0.3"]
POOL = 32
FLOOD_PER_SOURCE = 40
PER_SOURCE = 8
ITERATIONS = 10


def _events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(run_dir / "events" / "ps.jsonl") if e["event"] == kind]


@pytest.mark.loopback
def test_workers_join_and_train_while_two_hosts_flood_the_ps(tmp_path: Path) -> None:
    assert len(FLOOD_SOURCES) * FLOOD_PER_SOURCE > POOL  # the flood alone could fill it
    run_dir, cfg = make_run_dir(tmp_path, [
        "net.workers=2", "workload.hidden=32", f"run.iterations={ITERATIONS}",
        "run.eval_every=50", "compress.name=none", "run.seed=3", "run.timeout_s=60",
        f"guard.max_handshakes={POOL}", f"guard.max_handshakes_per_source={PER_SOURCE}",
        # The flood's admitted connections hold their slots for the whole test, so the
        # workers cannot slip in when they time out.
        "guard.handshake_timeout_s=60"])
    ps = start_ps(run_dir, expect=("127.0.0.1",))
    flood = hostile.Flood(cfg.net.port, FLOOD_SOURCES, FLOOD_PER_SOURCE)
    workers = []
    try:
        hostile.connect(cfg.net.port).close()  # the PS listens
        flood.start()
        deadline = time.monotonic() + 20
        while flood.opened < len(FLOOD_SOURCES) * FLOOD_PER_SOURCE:  # all at once, once
            assert time.monotonic() < deadline, flood.opened
            time.sleep(0.05)
        workers = [start_worker(run_dir, k, cfg.net.port) for k in range(2)]
        rcs = [w.wait(timeout=90) for w in workers]
        ps_rc = ps.wait(timeout=30)
    finally:
        flood.stop()
        for p in [ps, *workers]:
            if p.poll() is None:
                p.kill()
    assert ps_rc == 0 and rcs == [0, 0], (run_dir / "ps.log").read_text()[-2000:]
    steps = _events(run_dir, "ps_iter_done")
    assert len(steps) == ITERATIONS and all(e["workers"] == 2 for e in steps)
    everyone = _events(run_dir, "refused")
    # 127.0.0.1: the test's own probe for a listening PS, and nothing else.
    assert sum(e["count"] for e in everyone if e["source"] == "127.0.0.1") == 1, everyone
    refused = [e for e in everyone if e["source"] != "127.0.0.1"]
    assert {e["source"] for e in refused} == set(FLOOD_SOURCES), refused
    # Each flooding host was held to its PER_SOURCE slots: its first connections, within
    # its first second, could be refused for nothing else.
    held = {e["source"] for e in refused
            if e["reason"] == f"{PER_SOURCE} unauthenticated connections already"}
    assert held == set(FLOOD_SOURCES), refused
    # Every refused connection is counted, in a few events per source and second.
    total = sum(e["count"] for e in refused)
    assert total >= len(FLOOD_SOURCES) * (FLOOD_PER_SOURCE - PER_SOURCE), (total, flood.opened)
    wall_s = (steps[-1]["ts_ns"] - refused[0]["ts_ns"]) / 1e9 + 2
    assert len(refused) <= 4 * len(FLOOD_SOURCES) * wall_s, (len(refused), wall_s)


# -- a pipeline stage's and an expert host's listener under a flood -----------------------

# A shared pool of 15 (16 less the one expected peer's own slot) against four flooding
# addresses of 8 slots each: the flood fills the pool whatever the bound per source, so
# the real peer gets in only through the slot its address keeps (agents.net.admission).
# The flood's admitted connections hold their slots for the whole test (a 60 s deadline).
MESH_FLOOD_SOURCES = ["127.0.0.20", "127.0.0.21", "127.0.0.22", "127.0.0.23"]
MESH_POOL = 16
MESH_FLOOD_PER_SOURCE = 12


class _Events:
    """An agent's event sink, kept in memory (the expert host's is its EventLog)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def emit(self, event: str, iter: int = -1, **fields: Any) -> None:
        self.seen.append({"event": event, **fields})


def _flooded(port: int) -> hostile.Flood:
    """Four keyless hosts' slow connections at ``port``, each host's first ones made."""
    assert len(MESH_FLOOD_SOURCES) * PER_SOURCE >= MESH_POOL  # it could fill the pool
    flood = hostile.Flood(port, MESH_FLOOD_SOURCES, MESH_FLOOD_PER_SOURCE)
    flood.start()
    deadline = time.monotonic() + 20
    while flood.opened < len(MESH_FLOOD_SOURCES) * MESH_FLOOD_PER_SOURCE:
        assert time.monotonic() < deadline, flood.opened
        time.sleep(0.05)
    time.sleep(0.5)  # the listener's accept loop has taken them
    return flood


def _check_held(refused: list[dict[str, Any]]) -> None:
    """Only the flooders were refused, the pool was full, and a flooder met its bound."""
    assert {e["source"] for e in refused} <= set(MESH_FLOOD_SOURCES), refused
    reasons = {e["reason"] for e in refused}
    assert f"{MESH_POOL} unauthenticated connections at once" in reasons, refused
    assert f"{PER_SOURCE} unauthenticated connections already" in reasons, refused


@pytest.mark.loopback
def test_a_stage_joins_its_neighbour_while_four_hosts_flood_its_listener(tmp_path: Path
                                                                         ) -> None:
    from agents.pipeline.stage import Stage
    from controller.loopback.dp import free_port
    from controller.loopback.pipeline import make_run_dir as pipeline_run_dir

    run_dir, cfg = pipeline_run_dir(tmp_path, [
        "pipeline.stages=2", "pipeline.micro_batches=2", "pipeline.micro_batch_size=4",
        "run.iterations=1", f"guard.max_handshakes={MESH_POOL}",
        f"guard.max_handshakes_per_source={PER_SOURCE}", "guard.handshake_timeout_s=60"])
    peers = [("127.0.0.1", free_port()), ("127.0.0.1", free_port())]
    secret = (run_dir / "secret").read_bytes()
    s1 = Stage(cfg, run_dir, run_dir.name, secret, 1, peers)
    s0 = Stage(cfg, run_dir, run_dir.name, secret, 0, list(peers))
    out: dict[int, Any] = {}

    def connect(st: Stage) -> None:
        try:
            st.links.connect()
            out[st.s] = "ok"
        except BaseException as e:  # noqa: BLE001  (the test asserts on it)
            out[st.s] = e

    t1 = threading.Thread(target=connect, args=(s1,))  # stage 1 answers stage 0
    t1.start()
    flood = _flooded(peers[1][1])
    try:
        connect(s0)
        t1.join(60)
    finally:
        flood.stop()
        for st in (s0, s1):
            st.links.close()
            st.log.close()
    assert out == {0: "ok", 1: "ok"}, out
    _check_held([e for e in read_jsonl(run_dir / "events" / "s1.jsonl")
                 if e["event"] == "refused"])


@pytest.mark.loopback
def test_the_pipeline_ps_takes_every_stage_while_four_hosts_flood_it(tmp_path: Path) -> None:
    from agents.pipeline.stage import Stage
    from agents.pipeline.stage_ps import StagePS
    from controller.loopback.dp import free_port
    from controller.loopback.pipeline import make_run_dir as pipeline_run_dir

    run_dir, cfg = pipeline_run_dir(tmp_path, [
        "pipeline.stages=2", "pipeline.micro_batches=2", "pipeline.micro_batch_size=4",
        "run.iterations=1", f"guard.max_handshakes={MESH_POOL}",
        f"guard.max_handshakes_per_source={PER_SOURCE}", "guard.handshake_timeout_s=60"])
    secret = (run_dir / "secret").read_bytes()
    # Each stage on an address of its own, as on the fabric (controller/roles/stage.py
    # passes every stage host's address as --expect).
    peers = [("127.0.0.2", free_port()), ("127.0.0.3", free_port())]
    ps_addr = ("127.0.0.1", free_port())
    ps = StagePS(cfg, run_dir, run_dir.name, secret, host=ps_addr[0], port=ps_addr[1],
                 expected=("127.0.0.2", "127.0.0.3"))
    stages = [Stage(cfg, run_dir, run_dir.name, secret, s, list(peers), ps=ps_addr)
              for s in range(2)]
    out: dict[str, Any] = {}

    def accept() -> None:
        try:
            ps.accept()
            out["ps"] = sorted(ps.conns)
        except BaseException as e:  # noqa: BLE001  (the test asserts on it)
            out["ps"] = e

    t = threading.Thread(target=accept)
    t.start()
    flood = _flooded(ps_addr[1])
    try:
        for st in stages:
            st.links.connect_ps()
        t.join(60)
    finally:
        flood.stop()
        ps.abort("the test is over")
        ps.loop.close()
        ps.log.close()
        for st in stages:
            st.links.close()
            st.log.close()
    assert out == {"ps": [(0, 0), (0, 1)]}, out
    _check_held([e for e in read_jsonl(run_dir / "events" / "ps.jsonl")
                 if e["event"] == "refused"])


@pytest.mark.loopback
def test_expert_hosts_join_while_four_hosts_flood_a_listener() -> None:
    import torch

    from agents.moe.mesh import Mesh, file_keys
    from agents.net import codec
    from agents.net.codec import MsgType
    from tests.agents.moe.test_moe_transparency import free_ports

    base = free_ports(3)
    # Each host on an address of its own, as on the fabric: host 0 keeps a slot for each.
    addrs = [(f"127.0.0.{h + 1}", base + h) for h in range(3)]
    limits = AdmissionLimits(per_source=PER_SOURCE, total=MESH_POOL,
                             connects_per_source_per_s=64, report_interval_s=1.0)
    run, secret = "mesh-flood", b"mesh flood test secret"
    tag = codec.run_tag(run, codec.PUBLIC_SECRET)
    logs = {h: _Events() for h in range(3)}
    out: dict[int, Any] = {}

    def host(h: int) -> None:
        try:
            with Mesh(h, addrs, tag, run_id=run, keys=file_keys(secret, h, 3), timeout_s=40,
                      handshake_timeout_s=60, limits=limits, log=logs[h]) as mesh:
                sends = {j: torch.full((4,), float(10 * h + j)) for j in mesh.peers}
                out[h] = mesh.exchange(MsgType.TOKENS, 0, 0, sends,
                                       dict.fromkeys(mesh.peers, 4))
        except BaseException as e:  # noqa: BLE001  (the test asserts on it)
            out[h] = e

    threads = [threading.Thread(target=host, args=(h,)) for h in range(3)]
    threads[0].start()  # host 0 listens; hosts 1 and 2 dial it once it is flooded
    hostile.connect(base).close()
    flood = _flooded(base)
    try:
        for t in threads[1:]:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        flood.stop()
    for h in range(3):
        assert not isinstance(out.get(h), BaseException) and h in out, out
        for j, t in out[h].items():
            assert torch.equal(t, torch.full((4,), float(10 * j + h)))
    refused = [e for e in logs[0].seen if e["event"] == "refused"]
    # 127.0.0.1: the test's own probe for a listening host 0, and nothing else.
    _check_held([e for e in refused if e["source"] != "127.0.0.1"])
    assert sum(e["count"] for e in refused if e["source"] == "127.0.0.1") <= 1, refused


# -- what a flood costs an agent's logs, in bytes -----------------------------------------

# The promise (docs/robustness.md): a flood grows a run's logs by at most 1 MB a minute.
LOG_BOUND_BYTES_PER_MIN = 1_000_000
LOG_FLOOD_S = 6.0
# One keyless address per agent: four slow connections (cut off at a 1 s handshake
# deadline and reopened) and 500 a second that send a line of garbage and hang up, so
# each second some 60 handshakes are admitted and fail (the per-second bound is 64) and
# the rest are refused unread.
LOG_FLOOD = ["--slow", "4", "--churn-per-s", "500"]


def _flood_agent(source: str, port: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "controller.loopback.flood",
                             f"127.0.0.1:{port}", "--probe", "--source", source,
                             *LOG_FLOOD],
                            cwd=REPO, stdout=subprocess.PIPE, text=True)


def _log_bytes(files: list[Path]) -> int:
    return sum(f.stat().st_size for f in files if f.exists())


@pytest.mark.loopback
def test_a_flood_grows_an_agents_logs_by_less_than_a_megabyte_a_minute(tmp_path: Path
                                                                        ) -> None:
    """A data-parallel PS and a pipeline stage waiting for its neighbour, each flooded by
    a keyless address for LOG_FLOOD_S: what each writes meanwhile (its events and its
    output), in bytes a minute, stays under the bound, though one line per refusal
    would have written more than twice the bound."""
    from controller.loopback.pipeline import make_run_dir as pipeline_run_dir

    guard = ["guard.handshake_timeout_s=1"]
    ps_dir, ps_cfg = make_run_dir(tmp_path, [*guard, "run.timeout_s=120"], name="dp")
    st_dir, _ = pipeline_run_dir(tmp_path, ["pipeline.stages=2", *guard], name="pp")
    ports = [free_port(), free_port()]
    stage = warm.spawn([sys.executable, "-m", "agents.pipeline.stage", "--run-dir",
                        str(st_dir), "--stage", "1", "--peers",
                        ",".join(f"127.0.0.1:{p}" for p in ports)],
                       cwd=REPO, stdout=open(st_dir / "s1.log", "wb"),
                       stderr=subprocess.STDOUT)
    agents = {"ps": (start_ps(ps_dir), ps_cfg.net.port, "127.0.0.30",
                     [ps_dir / "events" / "ps.jsonl", ps_dir / "ps.log"]),
              "s1": (stage, ports[1], "127.0.0.31",
                     [st_dir / "events" / "s1.jsonl", st_dir / "s1.log"])}
    floods = []
    try:
        for _, port, _, _ in agents.values():
            hostile.connect(port).close()  # it listens
        floods = [_flood_agent(src, port) for _, port, src, _ in agents.values()]
        time.sleep(1.0)  # the flood at its pace
        before = {a: _log_bytes(files) for a, (_, _, _, files) in agents.items()}
        t0_ns, t0 = time.monotonic_ns(), time.monotonic()
        time.sleep(LOG_FLOOD_S)
        after = {a: _log_bytes(files) for a, (_, _, _, files) in agents.items()}
        t1_ns, took_s = time.monotonic_ns(), time.monotonic() - t0
    finally:
        for f in floods:
            f.terminate()
            f.communicate(timeout=30)
        for p, _, _, _ in agents.values():
            p.kill()
            p.wait()
    for a, (_, _, src, files) in agents.items():
        per_min = (after[a] - before[a]) / took_s * 60
        lines = files[0].read_text().splitlines()
        refused = [(len(line) + 1, e) for line in lines
                   if (e := json.loads(line))["event"] == "refused" and e["source"] == src]
        assert {"handshake failed", "more than 64 connections a second"} <= {
            e["reason"] for _, e in refused}, refused
        inside = sum(e["count"] for _, e in refused if t0_ns <= e["ts_ns"] <= t1_ns)
        # One refused line per refusal would have written at least this much.
        unaggregated = inside / took_s * 60 * min(n for n, _ in refused)
        assert unaggregated > 2 * LOG_BOUND_BYTES_PER_MIN, (a, inside, took_s)
        assert per_min <= LOG_BOUND_BYTES_PER_MIN, (a, per_min, inside, took_s)


# -- the bound with several flooding addresses, at the handshake driver itself -------------

SOURCES = [f"127.0.0.{40 + i}" for i in range(5)]
SEVERAL_LIMITS = AdmissionLimits(per_source=2, total=64, connects_per_source_per_s=30,
                                 report_interval_s=0.5)
SEVERAL_FLOOD_S = 3.0


@pytest.mark.loopback
def test_refusals_from_several_addresses_are_one_line_per_source_and_reason_an_interval(
        tmp_path: Path) -> None:
    """``accept_forever`` answering real handshakes on a real socket while five keyless
    addresses flood it (each a slow connection cut off at a 0.3 s deadline and reopened,
    and 200 connections a second of garbage that hang up): every flooding address is named in the log, and the log holds
    at most one ``refused`` line per (source, reason) per ``report_interval_s`` (the
    first at once, the last at close), each with its count, though the refusals were
    many times more."""
    from agents.core.events import EventLog
    from agents.net import codec, handshake, protocol

    log = EventLog(tmp_path / "events" / "ps.jsonl", "several", "ps")
    tag = codec.run_tag("several", codec.PUBLIC_SECRET)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(handshake.LISTEN_BACKLOG)
    port = srv.getsockname()[1]
    stopped = threading.Event()

    def on_connection(sock: socket.socket, peer: str) -> None:
        handshake.answer(sock, protocol.Answerer("several", "worker", lambda h: None,
                                                 accepts="none"),
                         run_tag=tag, name=peer, welcome=None, timeout_s=0.3)

    def report(r: Any) -> None:
        log.emit("refused", source=r.source, reason=r.reason, count=r.count,
                 example=r.example)

    accepting = threading.Thread(target=handshake.accept_forever, args=(srv, on_connection),
                                 kwargs=dict(stopped=stopped, report=report,
                                             limits=SEVERAL_LIMITS))
    t0 = time.monotonic()
    accepting.start()
    floods = [subprocess.Popen([sys.executable, "-m", "controller.loopback.flood",
                                f"127.0.0.1:{port}", "--source", src, "--slow", "1",
                                "--churn-per-s", "200", f"--seconds={SEVERAL_FLOOD_S}"],
                               cwd=REPO, stdout=subprocess.PIPE, text=True)
              for src in SOURCES]
    try:
        made = [json.loads(f.communicate(timeout=60)[0].strip().splitlines()[-1])
                for f in floods]
    finally:
        for f in floods:
            f.kill()
        stopped.set()
        srv.shutdown(socket.SHUT_RDWR)
        srv.close()
        accepting.join(30)
        took_s = time.monotonic() - t0
        log.close()
    refused = [e for e in read_jsonl(tmp_path / "events" / "ps.jsonl")
               if e["event"] == "refused"]
    assert {e["source"] for e in refused} == set(SOURCES), refused  # each one named
    pairs: dict[tuple[str, str], int] = {}
    for e in refused:
        pairs[e["source"], e["reason"]] = pairs.get((e["source"], e["reason"]), 0) + 1
    # Each address met the per-second bound, and its handshakes failed and timed out.
    for src in SOURCES:
        assert {"more than 30 connections a second", "handshake failed",
                "handshake timed out"} <= {r for s, r in pairs if s == src}, pairs
    most = int(took_s / SEVERAL_LIMITS.report_interval_s) + 2  # + the first and the close
    assert max(pairs.values()) <= most, (pairs, took_s)
    assert len(refused) <= len(pairs) * most
    counted = sum(e["count"] for e in refused)
    assert counted >= 5 * len(refused), (counted, len(refused))  # aggregated, not per refusal
    assert counted <= sum(m["opened"] for m in made), (counted, made)
