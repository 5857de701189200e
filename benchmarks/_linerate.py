"""What the line-rate benchmarks share (docs/linerate.md): where the CPU goes while a run
moves data, and the peers that run on the same shaped links in the same benchmark.

- :class:`ProcSampler`: CPU per process from ``/proc/PID/stat`` (utime + stime) for every
  process whose command line matches, and the machine's own split from ``/proc/stat``
  (user, system, softirq: the kernel's share of moving packets through veths, a bridge and
  HTB), with the load average at the start and the end.
- :func:`iperf3_peer`: the run's own network (the config's spec, built by
  :class:`topo.build.Network`), one iperf3 flow per worker to the PS, the up bottleneck
  sampled every 100 ms, and the same formula as gradbed's figure over those samples
  (:func:`analysis.metrics.upload_window_utilization`), first second left out as
  iperf3 ``-O 1`` does.
- :func:`gloo_peer`: gloo's ring all-reduce among the same hosts, on access links shaped
  at the same rate, launched by ``gradbed torchrun`` (benchmarks/torchrun_allreduce.py).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pandas as pd
from _common import log, run_child

CLK_TCK = os.sysconf("SC_CLK_TCK")
#: Processes whose CPU is counted: gradbed's agents, iperf3, gloo's ranks, the controller.
#: iperf3 servers listen on IPERF_PORT + i; the CPU sampler finds ours by it.
IPERF_PORT = 5710
PERF_EVENTS = "raw_syscalls:sys_enter,page-faults,context-switches"
WATCH = re.compile(r"agents\.(dp|moe|pipeline)\.\w+|iperf3|torchrun_ddp|controller\.cli")


def _ticks(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _label(cmd: str) -> str:
    m = WATCH.search(cmd)
    who = m.group(0) if m else cmd[:40]
    for flag in ("--worker", "--host", "--stage"):
        mm = re.search(rf"{flag} (\d+)", cmd)
        if mm:
            who += f" {flag[2:]} {mm.group(1)}"
    if "iperf3" in who:
        who += " -s" if " -s" in cmd else " -c"
    return who


def _cpu_line() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


class ProcSampler(threading.Thread):
    """Samples, every ``period_s``, the CPU ticks of every watched process and of the
    machine; :meth:`result` gives core-seconds per process and the kernel's share."""

    def __init__(self, marker: str = "", period_s: float = 0.25, perf: bool = True) -> None:
        super().__init__(name="proc-sampler", daemon=True)
        # Only processes whose command line holds ``marker`` (the benchmark's output
        # folder): other users' runs on a shared machine are not ours to count.
        self.marker = marker
        self.seen_s: dict[str, tuple[float, float]] = {}  # pid -> first, last sample time
        # perf stat on every agent process: system calls, page faults and context switches
        # per process, counted by the kernel (no ptrace: the agents run at full speed).
        self.perf = perf and shutil.which("perf") is not None
        self.perf_procs: dict[str, tuple[str, subprocess.Popen[str]]] = {}
        self.period_s = period_s
        self.stop_evt = threading.Event()
        self.first: dict[str, tuple[str, int]] = {}  # pid -> (label, ticks at first sight)
        self.last: dict[str, int] = {}
        self.load_start = open("/proc/loadavg").read().split()[:3]
        self.cpu_start = _cpu_line()
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.stop_evt.is_set():
            for pid in filter(str.isdigit, os.listdir("/proc")):
                t = _ticks(pid)
                if t is None:
                    continue
                now = time.monotonic()
                if pid not in self.first:
                    cmd = _cmdline(pid)
                    if not WATCH.search(cmd) or self.marker not in cmd:
                        continue
                    self.seen_s[pid] = (now, now)
                    self.first[pid] = (_label(cmd), t)
                    if self.perf and "agents." in cmd:
                        self.perf_procs[pid] = (_label(cmd), subprocess.Popen(
                            ["perf", "stat", "-x,", "-e", PERF_EVENTS, "-p", pid],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
                self.last[pid] = t
                self.seen_s[pid] = (self.seen_s[pid][0], now)
            self.stop_evt.wait(self.period_s)

    def result(self) -> dict[str, Any]:
        self.stop_evt.set()
        self.join(timeout=5)
        wall_s = time.monotonic() - self.t0
        cpu_end = _cpu_line()
        d = [b - a for a, b in zip(self.cpu_start, cpu_end, strict=False)]
        total = sum(d) or 1
        ncpu = os.cpu_count() or 1
        names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
        machine = {n: round(v / total * ncpu, 3) for n, v in zip(names, d, strict=False)}
        per: dict[str, float] = {}
        lived: dict[str, float] = {}
        for pid, (label, t0) in self.first.items():
            s = (self.last.get(pid, t0) - t0) / CLK_TCK
            per[label] = round(per.get(label, 0.0) + s, 2)
            a, b = self.seen_s[pid]
            lived[label] = max(lived.get(label, 0.0), b - a)
        counts: dict[str, dict[str, int]] = {}
        for label, proc in self.perf_procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            try:
                _, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                continue
            mine = counts.setdefault(label, {})
            for line in err.splitlines():
                f = line.split(",")
                if len(f) > 2 and f[0].strip().isdigit():
                    mine[f[2]] = mine.get(f[2], 0) + int(f[0])
        return {"wall_s": round(wall_s, 2), "cores": ncpu, "perf_counts": counts,
                "machine_cores_busy": machine,
                "process_cpu_s": dict(sorted(per.items(), key=lambda kv: -kv[1])),
                # Cores each used over its own lifetime (a run waiting for the machine's
                # network lock is not counted against its agents).
                "process_cores": {k: round(v / max(lived[k], self.period_s), 3)
                                  for k, v in sorted(per.items(), key=lambda kv: -kv[1])},
                "loadavg_start": self.load_start,
                "loadavg_end": open("/proc/loadavg").read().split()[:3]}


def _sample_points(net: Any, points: list[str], rows: list[dict[str, Any]],
                   stop: threading.Event) -> None:
    """Every 100 ms, each point's counters as a links.parquet row (``direction`` = the
    point), so analysis.metrics reads them as it reads a run's."""
    from agents.core.events import now_ns

    devs = {p: net.point_dev(p) for p in points}
    while not stop.is_set():
        for p in points:
            st = net.point_stats(p)
            rows.append({"ts_ns": now_ns(), "direction": p, "dev": devs[p],
                         "sent_bytes": st.sent_bytes, "sent_pkts": st.sent_pkts,
                         "drops": st.drops, "overlimits": st.overlimits,
                         "backlog_bytes": st.backlog_bytes, "backlog_pkts": st.backlog_pkts,
                         "rate_mbps": net.rate_mbps(devs[p])})
        stop.wait(0.1)


def iperf3_peer(config: Path, overrides: list[str], seconds: int = 5) -> dict[str, Any]:
    """One iperf3 flow per sender through the config's own network, each shaped point a
    sender's traffic crosses sampled every 100 ms, and gradbed's formula over those
    samples (:func:`analysis.metrics.upload_window_utilization`) from 1 s after the start
    to the end (TCP's slow start left out, as ``iperf3 -O 1``); and the CPU it cost.

    A star: every worker to the PS, through the ``up`` bottleneck (``busy``). A fabric:
    host i to host i+1, every host's ``up`` point carrying one flow (``busy`` = the mean
    over them, ``busy_per_point`` each)."""
    from agents.core import config as cfgmod
    from agents.core.events import now_ns
    from analysis.metrics import upload_window_utilization
    from topo.build import Network
    from topo.shapes import shape_spec

    cfg = cfgmod.load(config, overrides)
    spec = shape_spec(cfg)
    if cfg.topo.shape == "fabric":
        hosts = [h.name for h in spec.hosts]
        pairs = [(h, hosts[(i + 1) % len(hosts)]) for i, h in enumerate(hosts)]
        points = [f"{h}.up" for h in hosts]
    else:
        ps = next(h.name for h in spec.hosts if h.role == "ps")
        pairs = [(h.name, ps) for h in spec.hosts if h.role == "worker"]
        points = ["up"]
    rows: list[dict[str, Any]] = []
    with Network(spec) as net:
        for i, (_, server) in enumerate(pairs):
            net.popen(server, ["iperf3", "-s", "-1", "-B", net.ip(server), "-p",
                               str(IPERF_PORT + i)],
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for i, (_, server) in enumerate(pairs):
            assert net.wait_listening(server, IPERF_PORT + i), f"iperf3 server {i} not up"
        stop = threading.Event()
        sampler = threading.Thread(target=_sample_points, args=(net, points, rows, stop),
                                   daemon=True)
        sampler.start()
        procs = ProcSampler(f"-p {IPERF_PORT // 10}")
        procs.start()
        t_start = now_ns()
        clients = [net.popen(c, ["iperf3", "-c", net.ip(server), "-p", str(IPERF_PORT + i),
                                 "-B", net.ip(c), "-t", str(seconds)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                   for i, (c, server) in enumerate(pairs)]
        for c in clients:
            c.wait(timeout=seconds + 30)
        t_end = now_ns()
        cpu = procs.result()
        time.sleep(0.15)
        stop.set()
        sampler.join(timeout=5)
    links = pd.DataFrame(rows)
    window = [(0, t_start + 1_000_000_000, t_end - 200_000_000)]
    per = {p: upload_window_utilization(links, window, p) for p in points}
    busy = sum(per.values()) / len(per)
    log(f"iperf3, {len(pairs)} flows: busy {busy:.4f} ({per})")
    return {"busy": busy, "busy_per_point": per, "flows": len(pairs), "seconds": seconds,
            "rate_mbps": float(links["rate_mbps"].iloc[0]) if len(links) else None,
            "backlog_bytes_median": float(links["backlog_bytes"].median()) if len(links)
            else None, "cpu": cpu}


def gloo_peer(rate_mbps: float, out: Path) -> dict[str, Any]:
    """gloo's ring all-reduce of ResNet-50's gradient among 4 hosts, each access link
    shaped at ``rate_mbps`` (``gradbed torchrun``): the ring's efficiency (its ideal time
    over the measured one) and each access link's busy-span fraction."""
    import json

    import torchrun_allreduce as tra

    procs = ProcSampler(str(out))
    procs.start()
    r = tra.one(rate_mbps, out)
    cpu = procs.result()
    summary = json.loads((Path(str(r["run_dir"])) / "summary.json").read_text())
    points = summary.get("torchrun", {}).get("points_busy_utilization", {})
    ups = [v for k, v in points.items() if v is not None and "up" in k] \
        or [v for v in points.values() if v is not None]
    eff = float(str(r["ideal_s"])) / float(str(r["seconds"]))
    log(f"gloo ring all-reduce at {rate_mbps:g} Mbit/s: {r['seconds']:.2f} s, "
        f"efficiency {eff:.4f}")
    return {"efficiency": eff, "points_busy": points,
            "up_points_busy_mean": sum(ups) / len(ups) if ups else None, "run": r,
            "cpu": cpu}


def gloo_all_to_all_peer(config: Path, overrides: list[str], out: Path,
                         floats: int = 10_000_000) -> dict[str, Any]:
    """gloo's ``all_to_all_single`` of ``floats`` per host among the config's hosts
    (``gradbed torchrun``, examples/torchrun_ddp/all_to_all.py), every access link's HTB
    class sampled every 2 ms: its efficiency by the MoE dispatch's own formula over the
    same samples (:func:`analysis.moe.dispatch_link_table`: the busiest point's bytes over
    the exchange / (time x rate)), and by the payload (each host's bytes to the others
    over the TCP goodput ceiling)."""
    import json
    import sys

    from _common import REPO

    from agents.core import config as cfgmod
    from agents.core.ethernet import TCP_GOODPUT_FRACTION
    from analysis import moe as amoe

    cfg = cfgmod.load(config, overrides)
    argv = [sys.executable, "-m", "controller.cli", "torchrun", str(config), "--no-progress",
            "--out", str(out), "--set", 'run.name="tr-all-to-all"',
            "--set", "topo.class_sample_ms=2", "--set", "run.timeout_s=600",
            # The same hosts and links, with gloo's ranks in place of the expert hosts.
            "--set", 'topo.role=""']
    for o in overrides:
        argv += ["--set", o]
    argv += ["--", str(REPO / "examples/torchrun_ddp/all_to_all.py"), "--floats", str(floats)]
    procs = ProcSampler(str(out))
    procs.start()
    res = run_child(argv, cwd=REPO, timeout_s=1200)
    cpu = procs.result()
    run_dir = Path(res.stdout.strip().splitlines()[-1]) if res.stdout.strip() else None
    if res.returncode != 0 or run_dir is None:
        raise RuntimeError(f"gradbed torchrun all_to_all failed:\n{res.stderr[-3000:]}")
    # Rank 0's line, in the log of whichever host ran it (w0 on a star, gbh0 on a fabric).
    line = next(ln for log_file in sorted((run_dir / "logs").glob("*.log"))
                for ln in reversed(log_file.read_text().splitlines()) if '"seconds"' in ln)
    r = json.loads(line[line.index("{"):])
    rate = cfg.net.worker_link_mbps
    world = int(r["world"])
    payload = r["size_bytes"] * (world - 1) / world  # what each host sends to the others
    eff = payload / (r["seconds"] * rate * 1e6 / 8 * TCP_GOODPUT_FRACTION)
    window = [{"iter": 0, "layer": 0, "start_ns": r["start_ns"], "end_ns": r["end_ns"],
               "phase_s": r["seconds"], "payload_bytes": payload, "efficiency": eff}]
    samples = amoe.load_class_samples(run_dir)
    link = amoe.dispatch_link_table(window, samples, rate)[0] if samples is not None else {}
    log(f"gloo all_to_all at {rate:g} Mbit/s: {r['seconds']:.3f} s, payload efficiency "
        f"{eff:.4f}, link {link.get('link_efficiency', float('nan')):.4f}")
    return {"efficiency": eff, "link_efficiency": link.get("link_efficiency"),
            "seconds": r["seconds"], "size_bytes": r["size_bytes"], "world": world,
            "run_dir": str(run_dir), "cpu": cpu}
