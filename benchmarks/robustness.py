"""Attacks and faults against live runs, each with its verdict.

Real agent processes over loopback TCP (``controller/loopback/dp.py``; no Mininet needed): a PS
and two workers train the digits MLP (dense SGD, 1,000 iterations). One run is clean; the
second is attacked while it trains, and *survives* only if every attack is refused and
the final weights equal the clean run's bit for bit (with two workers the streamed sum is
order-independent, so any difference is the attack's). Separate short runs take the
faults that cannot leave the weights alone: poisoned gradients from authenticated
workers (the run must drop them and complete with a finite model) and the controller's
death (the agents must end). The control socket is attacked in-process.

Attacks on the live run (each a new TCP connection unless said otherwise):

1. ``replayed_handshake``: worker 1 talks through a tap (``CapturingProxy``); its captured
   HELLO and PROOF are replayed against a fresh challenge.
2. ``replayed_grad``: a captured GRAD frame sent as a first frame.
3. ``second_hello``: a complete, correct handshake (the real key) for live worker 0.
4. ``run_dir_reader``: a host that reads every file in the run directory and tries each
   as the worker's key, and as the old protocol's secret.
5. ``wrong_key``: a handshake with a wrong key.
6. ``garbage``: 100 random bytes.
7. ``deep_hello``: a HELLO whose body is 1,000 ``[``.
8. ``huge_header``: a header with the run's tag announcing 2^32 payload bytes.
9. ``slow_connections``: 200 connections from a background address (127.0.0.2) that send
   10 bytes of a header and stall; all must be closed (the first
   ``guard.max_handshakes_per_source`` at the handshake deadline, 2 s here, the rest
   refused unread) and counted in a few aggregated ``refused`` events while the run goes on.

Worker 0 is held (SIGSTOP) while the attacks run, so the run cannot end before the slow
connections' timeouts fire, however fast the machine; held or not, the weights are the same.

Availability and liveness: ``flood_admission`` keeps 700 slow connections open from each
of two background addresses (more than the 1,024 handshake slots the PS once had) while a
second run's workers start, join and train; as root, in real Mininet (``gradbed run``), a
SIGSTOP'ed worker must be dropped after ``run.stall_timeout_s`` and the run complete (0),
and a SIGSTOP'ed or SIGKILL'ed pipeline stage, a SIGSTOP'ed data-parallel PS and a
SIGKILL'ed pipeline PS must each end the run with status 4, naming it;
``control_socket_flood``: one process (what a background host is to the control socket,
which tells its peers apart by process) keeps opening 20,000 slow keyless connections to a
real run's control socket; the run must complete and its median iteration time stay
within 1.2x of the clean runs' (the same run just before it and just after it on the same
machine, their medians averaged: a load that drifts between the runs moves the ratio
less than against one twin, which read 1.29x once under load where reruns read 0.86-0.98x); ``ps_flood``: the
same against the PS's TCP listener, from a background host of the emulated network (one
host, 20,000 slow connections from two processes), and the PS's event log may grow by at
most 1 MiB a minute; ``stage_flood`` and ``pipeline_ps_flood``: the same at a 2-stage
pipeline on the fabric, at stage 1's listener and at the pipeline's PS, from a keyless
address of the fabric (a second address on another pipeline host's interface: the fabric
has no host outside the pipeline), the median step time within 1.2x; ``dark_30s_down``: the downlink goes dark for 30 s (three times the
default ``run.stall_timeout_s``) and the run must complete with nobody lost and no step in
the dark.

Inputs and files, through ``gradbed``'s command line (``--dry-run``: nothing is built): a
trace spanning 10^12 ms, a trace that is one endless line (a FIFO whose writer never stops),
TOML nested 5,000 deep in ``--set``, a 250-character ``run.name``, ``run.timeout_s = inf``:
each must be refused with one line, exit status 2, within 30 s. As root: another user
opening the network lock to flock it must be refused, and ``gradbed cleanup DIR`` under
sudo must not delete the file ``DIR/control.path`` names.

Headline: attacks and faults survived; ``details.tried``: how many were tried (target:
equal). ``details.ps_peak_extra_mb``: growth of the attacked PS's peak RSS (VmHWM) from
before the first attack to the end of the last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from _common import emit, log

from agents.core.events import read_jsonl
from agents.net import auth, codec
from agents.net.control import ControlClient, control_path
from controller.control import ControlServer
from controller.loopback import hostile
from controller.loopback.dp import (
    connect,
    make_run_dir,
    public_tag,
    run_loopback,
    start_ps,
    start_worker,
)
from controller.loopback.flood import tcp_flood, unix_flood

CLEAN = ["net.workers=2", "workload.hidden=32", "run.iterations=1000", "run.eval_every=250",
         "compress.name=none", "run.seed=11", "guard.handshake_timeout_s=2",
         "run.timeout_s=120"]
SLOW = 200
SLOW_SOURCE = "127.0.0.2"  # a background host: the real workers dial from 127.0.0.1


def ps_events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(run_dir / "events" / "ps.jsonl") if e["event"] == kind]


def attacked_run(tmp: Path) -> tuple[dict[str, tuple[bool, str]], Path, float]:
    run_dir, cfg = make_run_dir(tmp, CLEAN, name="attacked")
    port = cfg.net.port
    ps = start_ps(run_dir)
    proxy = hostile.CapturingProxy(port)
    proxy.start()
    workers = [start_worker(run_dir, 0, port), start_worker(run_dir, 1, proxy.port)]
    v: dict[str, tuple[bool, str]] = {}
    try:
        deadline = time.monotonic() + 120
        while not any(h.msg_type.name == "GRAD" for h, _ in proxy.frames()):
            if time.monotonic() > deadline:
                raise RuntimeError("worker 1 never sent a gradient")
            time.sleep(0.01)
        before_kb = hostile.rss_peak_kb(ps.pid)
        workers[0].send_signal(signal.SIGSTOP)  # the run stays open through the attacks
        slow = hostile.slow_connections(port, SLOW, source=SLOW_SOURCE)
        captured = proxy.frames()
        t = hostile.replay_handshake(port, captured)
        v["replayed_handshake"] = ("failed the challenge" in t, t)
        grad = next(raw for h, raw in captured if h.msg_type.name == "GRAD")
        t = hostile.replay_frame(port, grad)
        v["replayed_grad"] = (any(w in t for w in ("too large", "run_tag", "expected HELLO")),
                              t)
        t = hostile.second_hello(port, run_dir, 0)
        v["second_hello"] = ("refused a second connection" in t, t)
        tries = hostile.file_reader(port, run_dir, 1)
        v["run_dir_reader"] = (bool(tries) and not any("admitted" in x for x in tries),
                               f"{len(tries)} tries, none admitted" if tries else "no files")
        s = connect(port)
        try:
            from controller.loopback.dp import handshake

            handshake(s, run_dir, 1, key=b"guessed".ljust(32, b"!"))
            v["wrong_key"] = (False, "admitted")
        except Exception as e:  # noqa: BLE001  (the verdict records what happened)
            v["wrong_key"] = ("failed the challenge" in str(e), str(e))
        finally:
            s.close()
        t = hostile.replay_frame(port, os.urandom(100))
        v["garbage"] = ("magic" in t or "header" in t, t)
        hdr, body = codec.frame_for_bytes(b"[" * 1000, msg_type=codec.MsgType.HELLO,
                                          run_tag=public_tag(run_dir), worker=0)
        t = hostile.replay_frame(port, hdr + bytes(body))
        v["deep_hello"] = ("nested deeper" in t, t)
        t = hostile.huge_header(port, run_dir)
        v["huge_header"] = ("too large" in t, t)
        closed = hostile.closed_count(slow, wait_s=15)
        after_kb = hostile.rss_peak_kb(ps.pid) if ps.poll() is None else before_kb
        alive = ps.poll() is None
        workers[0].send_signal(signal.SIGCONT)
        rc = ps.wait(timeout=300)
        wrcs = [w.wait(timeout=60) for w in workers]
    finally:
        for p in [ps, *workers]:
            if p.poll() is None:
                p.kill()
    # From a background address: admitted up to guard.max_handshakes_per_source and cut
    # off at the deadline, the rest refused unread; every one counted, in a few events.
    refused = [e for e in ps_events(run_dir, "refused") if e["source"] == SLOW_SOURCE]
    counted = sum(e["count"] for e in refused)
    timed_out = sum(e["count"] for e in refused if e["reason"] == "handshake timed out")
    v["slow_connections"] = (closed == SLOW and counted == SLOW and len(refused) <= 8
                             and alive,
                             f"{closed} of {SLOW} closed, {counted} counted in {len(refused)} "
                             f"refused events ({timed_out} timed out), PS alive after the "
                             f"attacks: {alive}")
    v["_run_end"] = (rc == 0 and wrcs == [0, 0] and not ps_events(run_dir, "worker_lost"),
                     f"PS rc {rc}, workers {wrcs}")
    return v, run_dir, (after_kb - before_kb) / 1024


def poison_run(tmp: Path) -> tuple[bool, str]:
    run_dir, cfg = make_run_dir(tmp, [
        "net.workers=6", "workload.hidden=32", "run.iterations=50", "compress.name=topk",
        "compress.ratio=0.1", "run.seed=3", "guard.max_abs_grad=1e30"], name="poison")
    rc, _, _ = hostile.poisoned_run(run_dir, cfg, ps_wait_s=300)
    errors = {e.get("worker"): e["error"] for e in ps_events(run_dir, "frame_error")}
    want = {2: "non-finite", 3: "non-finite", 4: "exceeds guard.max_abs_grad",
            5: "duplicate indices"}
    named = all(w in errors and text in errors[w] for w, text in want.items())
    steps = ps_events(run_dir, "ps_iter_done")
    final = torch.load(run_dir / "ps_final_weights.pt")
    ok = (rc == 0 and named and len(steps) == 50 and all(e["workers"] == 2 for e in steps[1:])
          and bool(torch.isfinite(final).all()))
    named_text = "; ".join(f"w{w}: {errors.get(w, 'none')[:70]}" for w in want)
    return ok, (f"rc {rc}; {named_text}; {len(steps)} iterations, final finite: "
                f"{bool(torch.isfinite(final).all())}")


def controller_death(tmp: Path) -> tuple[bool, str]:
    run_dir, cfg = make_run_dir(tmp, ["net.workers=2", "run.timeout_s=60"], name="orphan")
    ps = start_ps(run_dir)
    try:
        connect(cfg.net.port, timeout_s=120).close()
        assert ps.stdin is not None
        t0 = time.monotonic()
        ps.stdin.close()
        rc = ps.wait(timeout=15)
        dt = time.monotonic() - t0
    finally:
        if ps.poll() is None:
            ps.kill()
    return rc == 4, f"PS exited {rc} {dt:.2f} s after its controller's pipe closed"


def control_injection(tmp: Path) -> tuple[bool, str]:
    master = auth.new_master()
    got: list[dict[str, Any]] = []
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "control.sock"
    srv = ControlServer(path, got.append,
                        lambda n: auth.node_key(master, n) if n in ("ps", "w0") else None)
    try:
        raw = socket.socket(socket.AF_UNIX)
        raw.connect(str(path))
        raw.sendall(b'{"type": "hello", "node": "ps", "nonce": "00"}\n'
                    b'{"type": "membership", "node": "ps", "active": []}\n')
        time.sleep(0.5)
        raw.close()
        try:
            ControlClient(path, "w0", b"x" * 32)
            impostor = "connected"
        except ConnectionError as e:
            impostor = str(e)
        time.sleep(0.2)
    finally:
        srv.close()
    injected = any(m.get("type") == "membership" for m in got)
    return (not injected and "failed the challenge" in impostor,
            f"membership injected: {injected}; keyless client: {impostor}")


REPO = Path(__file__).resolve().parents[1]
FLOOD_SOURCES = ["127.0.0.2", "127.0.0.3"]
FLOOD_PER_SOURCE = 700  # more than the 1,024 handshake slots the PS once had, together


def flood_admission(tmp: Path) -> tuple[bool, str]:
    """Two keyless hosts keep 700 slow connections each open at the PS (each reopened as
    soon as it is closed) while the real workers start, join and train 10 iterations."""
    run_dir, cfg = make_run_dir(tmp, ["net.workers=2", "workload.hidden=32",
                                      "run.iterations=10", "run.eval_every=50",
                                      "compress.name=none", "run.timeout_s=120"], name="flood")
    ps = start_ps(run_dir, expect=("127.0.0.1",))
    flood = hostile.Flood(cfg.net.port, FLOOD_SOURCES, FLOOD_PER_SOURCE)
    workers = []
    try:
        connect(cfg.net.port).close()
        flood.start()
        deadline = time.monotonic() + 60
        while flood.opened < len(FLOOD_SOURCES) * FLOOD_PER_SOURCE:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the flood opened only {flood.opened} connections")
            time.sleep(0.05)
        workers = [start_worker(run_dir, k, cfg.net.port) for k in range(2)]
        wrcs = [w.wait(timeout=180) for w in workers]
        rc = ps.wait(timeout=60)
    finally:
        flood.stop()
        for p in [ps, *workers]:
            if p.poll() is None:
                p.kill()
    steps = ps_events(run_dir, "ps_iter_done")
    refused = [e for e in ps_events(run_dir, "refused") if e["source"] in FLOOD_SOURCES]
    log_kb = (run_dir / "events" / "ps.jsonl").stat().st_size / 1024
    ok = (rc == 0 and wrcs == [0, 0] and len(steps) == 10
          and all(e["workers"] == 2 for e in steps))
    return ok, (f"PS rc {rc}, workers {wrcs}, {len(steps)} iterations with 2 workers; "
                f"{flood.opened} flood connections, {sum(e['count'] for e in refused)} "
                f"refused in {len(refused)} events; ps.jsonl {log_kb:.0f} KiB")


@contextmanager
def _ended(proc: subprocess.Popen[str]) -> Iterator[None]:
    """A case's ``gradbed`` run: one the case left running (it raised, or timed out) is
    stopped as a terminal's Ctrl-C stops it."""
    try:
        yield
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=120)


def _gradbed_run(config: str, sets: list[str], out: Path) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "controller.cli", "run", str(REPO / config), "--out",
            str(out), "--no-progress", "--no-report"]
    for x in sets:
        argv += ["--set", x]
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _wait_events(out: Path, proc: subprocess.Popen[str], event: str, n: int) -> Path:
    deadline = time.monotonic() + 600  # the network lock may be another run's first
    needle = f'"event": "{event}"'
    while proc.poll() is None and time.monotonic() < deadline:
        for run_dir in out.glob("*/"):
            if sum(p.read_text(errors="replace").count(needle)
                   for p in (run_dir / "events").glob("*.jsonl")) >= n:
                return run_dir
        time.sleep(0.1)
    raise RuntimeError(f"no {n} {event} events (status {proc.poll()})")


def _cmdlines() -> Iterator[tuple[int, list[str]]]:
    """Every process's pid and command line, as far as it can be read."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                yield int(pid), [c.decode(errors="replace") for c in f.read().split(b"\0")]
        except OSError:
            continue


def _agent_pid(run_dir: Path, module: str, *args: str) -> int:
    """The process of agent ``module`` for ``run_dir`` whose command line holds ``args`` in
    order (none: the run's only process of that module)."""
    for pid, cmd in _cmdlines():
        if module in cmd and str(run_dir) in cmd and any(
                tuple(cmd[i:i + len(args)]) == args for i in range(len(cmd) - len(args) + 1)):
            return pid
    raise RuntimeError(f"no {module} {' '.join(args)} for {run_dir}")


def _agent_fault(tmp: Path, config: str, sets: list[str], event: str, module: str,
                 who: tuple[str, ...], sig: signal.Signals, status: int, lost: str
                 ) -> tuple[bool, str]:
    """Start a real run (Mininet), send ``sig`` to one agent once it is under way, and
    judge the exit status, the summary's stop reason and the time to the decision."""
    tmp.mkdir(parents=True, exist_ok=True)
    proc = _gradbed_run(config, sets, tmp)
    with _ended(proc):
        run_dir = _wait_events(tmp, proc, event, 3)
        os.kill(_agent_pid(run_dir, module, *who), sig)
        t0 = time.monotonic()
        proc.communicate(timeout=300)
        took_s = time.monotonic() - t0
    s = json.loads((run_dir / "summary.json").read_text())
    reason = str(s.get("stop_reason", ""))
    ok = proc.returncode == status and lost in reason
    return ok, f"exit {proc.returncode} {took_s:.1f} s after {sig.name}; stop_reason: {reason}"


Case = Callable[[Path], tuple[bool, str]]


def liveness_cases() -> dict[str, Case]:
    """A hung worker, a hung stage, a killed stage, a hung PS and a killed and a hung
    pipeline PS, floods of the control socket and the PS, a dark downlink: in real Mininet
    (root only; none otherwise)."""
    if os.geteuid() != 0:
        return {}
    stall = "run.stall_timeout_s=8"
    # 400 steps, not 100,000: a stage builds and checks its whole schedule before it starts.
    pipe = ["pipeline.stages=2", "topo.hosts=3", "pipeline.schedule='gpipe'",
            "run.iterations=400", "run.timeout_s=300", stall]
    return {
        # Dropped after run.stall_timeout_s; the run completes without it (status 0).
        "sigstopped_worker": lambda t: _agent_fault(
            t, "configs/test_tiny.toml", ["run.iterations=40", "run.timeout_s=240", stall],
            "ps_iter_done", "agents.dp.worker", ("--worker", "1"), signal.SIGSTOP, 0,
            "completed"),
        "sigstopped_stage": lambda t: _agent_fault(
            t, "configs/pipeline.toml", pipe, "pp_step_done", "agents.pipeline.stage",
            ("--stage", "0"), signal.SIGSTOP, 4, "no heartbeat"),
        "killed_stage": lambda t: _agent_fault(
            t, "configs/pipeline.toml", pipe, "pp_step_done", "agents.pipeline.stage",
            ("--stage", "1"), signal.SIGKILL, 4, "exited with status -9"),
        # The PS of either kind: the run stops with 4, naming it; hung, it is found by its
        # silence on the control channel (its sockets stay open).
        "sigstopped_ps": lambda t: _agent_fault(
            t, "configs/test_tiny.toml", ["run.iterations=100000", "run.timeout_s=240", stall],
            "ps_iter_done", "agents.dp.ps", (), signal.SIGSTOP, 4, "ps lost: no heartbeat"),
        "killed_pipeline_ps": lambda t: _agent_fault(
            t, "configs/pipeline.toml", pipe, "pp_step_done", "agents.pipeline.stage_ps",
            ("--auth", "stdin"), signal.SIGKILL, 4, "exited with status -9"),
        "sigstopped_pipeline_ps": lambda t: _agent_fault(
            t, "configs/pipeline.toml", pipe, "pp_step_done", "agents.pipeline.stage_ps",
            ("--auth", "stdin"), signal.SIGSTOP, 4, "lost: no heartbeat"),
        "control_socket_flood": control_socket_flood,
        "ps_flood": ps_flood,
        "stage_flood": lambda t: pipeline_flood(t, "stage"),
        "pipeline_ps_flood": lambda t: pipeline_flood(t, "ps"),
        "dark_30s_down": lambda t: dark_stretch(t, "down"),
    }


def separate_cases() -> dict[str, Case]:
    """Every case that runs on its own (not an attack on the shared attacked run), by
    name: what ``--only`` may name."""
    return {"poisoned_gradients": poison_run, "controller_death": controller_death,
            "control_socket_injection": control_injection,
            "flood_admission": flood_admission, **liveness_cases()}


FLOOD_CONNECTIONS = 20_000
FLOOD_SLOWDOWN = 1.2  # the flooded run's median iteration time, at most this x the clean's
FLOOD_LOG_BYTES_PER_MIN = 1 << 20  # what a flood may add to a run's logs
DARK_AT_S, DARK_S = 3.0, 30.0  # a cellular outage: three times run.stall_timeout_s's default


def _median_iter_s(run_dir: Path) -> float:
    from analysis.load import load_run
    from analysis.metrics import iteration_time_percentiles

    return iteration_time_percentiles(load_run(run_dir).events)["p50"]


def _clean_run(tmp: Path, sets: list[str], config: str = "configs/test_tiny.toml",
               label: str = "clean") -> Path:
    """A run a flooded twin is compared with: ``config`` with ``sets``, under
    ``tmp/label``; a failure fails the case (:func:`_verdict`)."""
    tmp.mkdir(parents=True, exist_ok=True)
    clean = _gradbed_run(config, sets, tmp / label)
    clean.communicate(timeout=600)
    if clean.returncode != 0:
        raise RuntimeError(f"the {label} run exited {clean.returncode}")
    (clean_dir,) = (tmp / label).glob("*/")
    return clean_dir


def _slowdown(tmp: Path, sets: list[str], flooded: Path, before: Path,
              median: Callable[[Path], float], config: str = "configs/test_tiny.toml"
              ) -> tuple[float, str]:
    """The flooded run's median over the mean of its clean twins' (``before``, and one run
    now, after it), and the three medians in words."""
    after = _clean_run(tmp, sets, config, "clean_after")
    clean_s = (median(before), median(after))
    flooded_s = median(flooded)
    return flooded_s / statistics.fmean(clean_s), (
        f"{flooded_s * 1e3:.0f} ms flooded against {clean_s[0] * 1e3:.0f} and "
        f"{clean_s[1] * 1e3:.0f} ms clean before and after")


def control_socket_flood(tmp: Path) -> tuple[bool, str]:
    """A clean run, then the same run while one process floods its control socket with
    FLOOD_CONNECTIONS slow connections (a byte a second, never a whole HELLO): in real
    Mininet (``gradbed run``), root only."""
    sets = ["run.iterations=60", "run.eval_every=1000", "run.timeout_s=300"]
    clean_dir = _clean_run(tmp, sets)
    proc = _gradbed_run("configs/test_tiny.toml", sets, tmp / "flooded")
    with _ended(proc):
        run_dir = _wait_events(tmp / "flooded", proc, "run_start", 1)
        with unix_flood(control_path(run_dir), processes=1,
                        per_process=FLOOD_CONNECTIONS) as flood:
            proc.communicate(timeout=600)
    refused = sum(int(e.get("count", 0)) for e in read_jsonl(run_dir / "events" /
                                                             "controller.jsonl")
                  if e.get("event") == "refused")
    ratio, medians = _slowdown(tmp, sets, run_dir, clean_dir, _median_iter_s)
    ok = proc.returncode == 0 and ratio <= FLOOD_SLOWDOWN
    return ok, (f"exit {proc.returncode}; median iteration {ratio:.2f}x the clean runs' "
                f"({medians}); {flood.opened} connections opened, {refused} refused")


def _host_pid(name: str) -> int:
    """The shell of the emulated host ``name`` (``bash ... mininet:NAME``): its network
    namespace is the host's."""
    for pid, cmd in _cmdlines():
        if f"mininet:{name}" in cmd:
            return pid
    raise RuntimeError(f"no shell of host {name}")


def ps_flood(tmp: Path) -> tuple[bool, str]:
    """A clean run with one background host, then the same run while that host (its own
    address, through the emulated network) keeps FLOOD_CONNECTIONS slow keyless
    connections at the PS: the run must complete, its median iteration
    time stay within FLOOD_SLOWDOWN of the clean runs' (:func:`_slowdown`), and the PS's event log grow by at
    most FLOOD_LOG_BYTES_PER_MIN. Real Mininet (``gradbed run``), root only."""
    sets = ["net.background_hosts=1", "run.iterations=60", "run.eval_every=1000",
            "run.timeout_s=300", "net.port=5600"]
    clean_dir = _clean_run(tmp, sets)
    proc = _gradbed_run("configs/test_tiny.toml", sets, tmp / "flooded")
    with _ended(proc):
        run_dir = _wait_events(tmp / "flooded", proc, "run_start", 1)
        ps_ip = json.loads((run_dir / "network.json").read_text())["hosts"]["ps"]["ip"]
        t0 = time.monotonic()
        # Two processes of the one host: a process may hold fewer than 20,000 descriptors
        # (RLIMIT_NOFILE) and the PS tells its peers apart by address.
        with tcp_flood(ps_ip, 5600, netns_pid=_host_pid("bg0"), processes=2,
                       per_process=FLOOD_CONNECTIONS // 2) as flood:
            proc.communicate(timeout=600)
        flooded_s = time.monotonic() - t0
    refused = sum(int(e.get("count", 0)) for e in ps_events(run_dir, "refused"))
    log_per_min = (run_dir / "events" / "ps.jsonl").stat().st_size / (flooded_s / 60)
    ratio, medians = _slowdown(tmp, sets, run_dir, clean_dir, _median_iter_s)
    ok = (proc.returncode == 0 and ratio <= FLOOD_SLOWDOWN and flood.opened >= FLOOD_CONNECTIONS
          and log_per_min <= FLOOD_LOG_BYTES_PER_MIN)
    return ok, (f"exit {proc.returncode}; median iteration {ratio:.2f}x the clean runs' "
                f"({medians}); "
                f"{flood.opened} connections opened, {refused} refused at the PS; "
                f"ps.jsonl {log_per_min / 1024:.0f} KiB a minute over {flooded_s:.0f} s")


#: A keyless host's address on the fabric, which has no host outside the pipeline: carried
#: by a pipeline host's interface as a second address (the fabric is one switch, so the
#: target's kernel reaches it by ARP like any host), it is a stranger to every listener.
FABRIC_STRANGER = "10.0.0.99"
PIPE_FLOOD = ["pipeline.stages=2", "topo.hosts=3", "pipeline.schedule='gpipe'",
              "run.iterations=600", "run.timeout_s=300"]


def _median_step_s(run_dir: Path) -> float:
    """The median ``step_s`` of every stage's ``pp_step_done``."""
    steps = [float(e["step_s"]) for p in (run_dir / "events").glob("*.jsonl")
             for e in read_jsonl(p) if e.get("event") == "pp_step_done"]
    if not steps:
        raise RuntimeError(f"no pp_step_done in {run_dir}")
    return statistics.median(steps)


def pipeline_flood(tmp: Path, target: str) -> tuple[bool, str]:
    """A clean 2-stage pipeline run on the fabric, then the same run while a keyless host
    (FABRIC_STRANGER, on the interface of a host that is not the target's) keeps
    FLOOD_CONNECTIONS slow connections at ``target``: ``"stage"``, stage 1's listener
    (its upstream neighbour dials it as its first act), or ``"ps"``, the pipeline's PS
    (every stage dials it). The run must complete and its median step time stay within
    FLOOD_SLOWDOWN of the clean runs' (:func:`_slowdown`). Real Mininet (``gradbed run``), root only."""
    clean_dir = _clean_run(tmp, PIPE_FLOOD, "configs/pipeline.toml")
    proc = _gradbed_run("configs/pipeline.toml", PIPE_FLOOD, tmp / "flooded")
    with _ended(proc):
        run_dir = _wait_events(tmp / "flooded", proc, "run_start", 1)
        hosts = json.loads((run_dir / "network.json").read_text())["hosts"]
        port = 5000 + (1 if target == "stage" else 0)  # configs/pipeline.toml's net.port
        victim, carrier = ("gbh1", "gbh2") if target == "stage" else ("gbh2", "gbh0")
        pid = _host_pid(carrier)
        subprocess.run(["nsenter", "-t", str(pid), "-n", "ip", "addr", "add",
                        f"{FABRIC_STRANGER}/32", "dev", f"{carrier}-eth0"], check=True)
        with tcp_flood(hosts[victim]["ip"], port, netns_pid=pid, source=FABRIC_STRANGER,
                       processes=2, per_process=FLOOD_CONNECTIONS // 2) as flood:
            proc.communicate(timeout=600)
    refused = [e for p in (run_dir / "events").glob("*.jsonl") for e in read_jsonl(p)
               if e.get("event") == "refused" and e.get("source") == FABRIC_STRANGER]
    ratio, medians = _slowdown(tmp, PIPE_FLOOD, run_dir, clean_dir, _median_step_s,
                               "configs/pipeline.toml")
    ok = (proc.returncode == 0 and ratio <= FLOOD_SLOWDOWN
          and flood.opened >= FLOOD_CONNECTIONS)
    return ok, (f"exit {proc.returncode}; median step {ratio:.2f}x the clean runs' "
                f"({medians}); "
                f"{flood.opened} connections opened at {victim}:{port}, "
                f"{sum(int(e['count']) for e in refused)} refused by its agent")


def dark_stretch(tmp: Path, direction: str) -> tuple[bool, str]:
    """A trace whose ``direction`` goes dark (0 Mbit/s) for DARK_S from DARK_AT_S, three
    times ``run.stall_timeout_s`` (the default): the run must complete with nobody lost, no
    step inside the dark once what was queued before it drained, and steps on both sides.
    Real Mininet (``gradbed run``), root only."""
    from analysis.load import load_run
    from traces.generate import steps, write_rate_log

    tmp.mkdir(parents=True, exist_ok=True)
    trace = tmp / "dark.log"
    write_rate_log(steps([(0.0, 50.0), (DARK_AT_S, 0.0), (DARK_AT_S + DARK_S, 50.0)],
                         period_s=600.0), trace)
    proc = _gradbed_run("configs/test_tiny.toml", [
        "run.iterations=40", "run.timeout_s=300", f'trace.{direction}="{trace}"'], tmp)
    proc.communicate(timeout=600)
    (run_dir,) = tmp.glob("*/")
    run = load_run(run_dir)
    s, ev = run.summary, run.events
    steps_at = ev[(ev["event"] == "trace_step") & (ev["direction"] == direction)]
    dark_ns, light_ns = (int(t) for t in steps_at.sort_values("ts_ns")["ts_ns"].iloc[1:3])
    done = ev.loc[ev["event"] == "ps_iter_done", "ts_ns"].astype("int64")
    # What was queued before the dark drains at 0.01 Mbit/s for a few seconds at most.
    in_dark = int(((done > dark_ns + 5e9) & (done < light_ns)).sum())
    ok = (proc.returncode == 0 and s["stop_reason"] == "completed"
          and s["agents_lost"] == [] and in_dark == 0
          and bool((done < dark_ns).any()) and bool((done > light_ns).any()))
    return ok, (f"exit {proc.returncode}; {s['stop_reason']}; {(light_ns - dark_ns) / 1e9:.1f} s "
                f"dark on {direction}; {in_dark} steps inside it; agents lost "
                f"{s['agents_lost']}; {int((done < dark_ns).sum())} steps before, "
                f"{int((done > light_ns).sum())} after")


def _verdict(case: Any, tmp: Path) -> tuple[bool, str]:
    try:
        return case(tmp)  # type: ignore[no-any-return]
    except Exception as e:  # noqa: BLE001  (the verdict records what happened)
        return False, f"{type(e).__name__}: {e}"


def _refused_at_once(sets: list[str]) -> tuple[bool, str]:
    argv = [sys.executable, "-m", "controller.cli", "run", str(REPO / "configs/test_tiny.toml"),
            "--dry-run"]
    for x in sets:
        argv += ["--set", x]
    t0 = time.monotonic()
    try:
        p = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return False, "still running after 30 s"
    lines = p.stderr.strip().splitlines()
    ok = p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr
    return ok, f"exit {p.returncode} in {time.monotonic() - t0:.1f} s: {lines[-1][-120:] if lines else ''}"


def bounded_inputs(tmp: Path) -> dict[str, tuple[bool, str]]:
    tmp.mkdir(parents=True, exist_ok=True)
    v: dict[str, tuple[bool, str]] = {}
    long = tmp / "long.trace"
    long.write_text("0\n5\n1000000000000\n")
    v["trace_spanning_1e12_ms"] = _refused_at_once([f"trace.up='{long}'"])
    with hostile.endless_fifo(tmp / "endless.trace") as fifo:
        v["endless_line"] = _refused_at_once([f"trace.up='{fifo}'"])
    v["toml_nested_5000_deep"] = _refused_at_once(["run.x=" + "[" * 5000 + "]" * 5000])
    v["run_name_250_chars"] = _refused_at_once(["run.name=" + "a" * 250])
    v["timeout_inf"] = _refused_at_once(["run.timeout_s=inf"])
    return v


def root_cases(tmp: Path) -> dict[str, tuple[bool, str]]:
    """Another user and the network lock; root and a file a user's run directory names."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return {}
    from topo.lock import DEFAULT_LOCK_PATH, NetLock

    v: dict[str, tuple[bool, str]] = {}
    with NetLock(timeout_s=600):
        pass  # made (or narrowed) as gradbed keeps it
    hold = ("import fcntl, sys\nf = open(sys.argv[1])\n"
            "fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n")
    p = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        sys.executable, "-c", hold, DEFAULT_LOCK_PATH], capture_output=True,
                       text=True, timeout=30)
    v["lock_by_another_user"] = (p.returncode != 0 and "PermissionError" in p.stderr,
                                 f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]}")
    victim = tmp / "root-only" / "precious"
    victim.parent.mkdir(parents=True)
    victim.write_text("root's")
    run = tmp / "user" / "tiny-20260101-000000-abcd"
    (run / "events").mkdir(parents=True)
    (run / "control.path").write_text(f"{victim}\n")
    for x in (run.parent, run, run / "events", run / "control.path"):
        os.chown(x, 65534, 65534)
    env = {**os.environ, "SUDO_UID": "65534", "SUDO_GID": "65534"}
    c = subprocess.run([sys.executable, "-m", "controller.cli", "cleanup", "--wait-s", "600",
                        str(run)], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=700)
    v["cleanup_follows_a_users_file"] = (c.returncode == 0 and victim.exists(),
                                         f"exit {c.returncode}; the named file "
                                         f"{'kept' if victim.exists() else 'DELETED'}")
    return v


def _run_only(names: list[str], tmp: Path) -> None:
    cases = separate_cases()
    unknown = [n for n in names if n not in cases]
    if unknown:
        raise SystemExit(f"--only: no case {', '.join(unknown)}; the cases that run on "
                         f"their own here: {', '.join(cases)}")
    results = {}
    for name in names:
        log(name)
        ok, why = _verdict(cases[name], tmp / name)
        results[name] = {"survived": ok, "what_happened": why}
        log(f"{name:28s} {'survived' if ok else 'FAILED':9s} {why[:110]}")
    emit("robustness", sum(r["survived"] for r in results.values()),
         "attacks and faults survived (--only: not the headline)",
         f"= tried ({len(results)})", {"tried": len(results), "results": results,
                                      "only": names})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", metavar="CASE",
                    help="run only these cases (those that run on their own: "
                         "poisoned_gradients, flood_admission, ps_flood, ...), not the "
                         "attacked run")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="robustness-"))
    if args.only:
        try:
            _run_only(args.only, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    log("clean run")
    clean_dir, rc = run_loopback(tmp / "clean", CLEAN, timeout_s=300)
    if rc != 0:
        raise SystemExit(f"clean run failed: {clean_dir}")
    clean = torch.load(clean_dir / "ps_final_weights.pt")
    log("attacked run")
    verdicts, run_dir, extra_mb = attacked_run(tmp / "attacked")
    final = torch.load(run_dir / "ps_final_weights.pt")
    identical = torch.equal(final, clean)
    run_end = verdicts.pop("_run_end")
    # An attack on the live run is survived only if the run also ended clean and exact.
    results: dict[str, dict[str, Any]] = {
        k: {"survived": ok and run_end[0] and identical, "what_happened": why}
               for k, (ok, why) in verdicts.items()}
    log("bounded inputs, the lock, root and a user's files")
    for k, (ok, why) in {**bounded_inputs(tmp / "inputs"), **root_cases(tmp / "root")}.items():
        results[k] = {"survived": ok, "what_happened": why}
    # A case that breaks is a case not survived, with what broke it; the others still run.
    for name, case in separate_cases().items():
        log(name)
        ok, why = _verdict(case, tmp / name)
        results[name] = {"survived": ok, "what_happened": why}
    for k, r in results.items():
        log(f"{k:28s} {'survived' if r['survived'] else 'FAILED':9s} {r['what_happened'][:110]}")
    survived = sum(r["survived"] for r in results.values())
    emit("robustness", survived, "attacks and faults survived",
         f"= tried ({len(results)})",
         {"tried": len(results), "results": results,
          "attacked_run": {"end": run_end[1], "final_weights_bit_identical_to_clean": identical,
                           "iterations": len(ps_events(run_dir, "ps_iter_done")),
                           "numel": clean.numel()},
          "ps_peak_extra_mb": round(extra_mb, 2),
          "slow_connections": SLOW, "handshake_timeout_s": 2.0,
          "config_overrides": CLEAN, "transport": "loopback TCP, real agent processes"})
    shutil.rmtree(tmp, ignore_errors=True)  # the runs' directories: nothing left behind


if __name__ == "__main__":
    main()
