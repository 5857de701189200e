"""Background (cross) traffic between the background hosts and the PS, sharing the
bottleneck with the training (DESIGN.md sections 2-3: iperf3 as a background-traffic
source, flow-size CDFs and background-flow generators).

``[background]`` in a config, for each host of the ``flowgen`` role (``controller/roles/
flowgen.py``: the ``net.background_hosts`` hosts ``bg0``, ``bg1``, ...), with a server for
each in its peer on ``BASE_PORT + j``: the sink host ``sinkJ`` where the shape has one (the
dumbbell's far side), else the PS host. "To the PS" below means to that peer:
- ``kind = "bulk"``: ``flows`` long iperf3 TCP flows. ``direction = "up"`` sends from the
  host to the PS through the up bottleneck, with the workers' gradients; ``"down"`` from
  the PS to the host (iperf3 ``-R``), with the weights. Each client's JSON report
  (``background/bgJ.json``, kept) becomes one ``background`` event: bytes, mean rate,
  retransmits and the seconds it ran.
- ``kind = "flows"``: flows drawn from the flow-size CDF ``flow_cdf`` at an offered load
  of ``load_mbps``, each a new connection to a sink (``agents/traffic/flowgen.py``), logged as
  ``flow_done`` events with their completion times, and a ``background`` event at the end.
- ``kind = "pcap"``: the capture ``pcap``, readdressed from the host to the PS
  (``traces/pcap.py``) and looped by ``tcpreplay`` at its own timing or at ``pcap_mbps``;
  tcpreplay's totals become the ``background`` event (bytes, packets, seconds, Mbit/s).

:func:`commands` is pure (it is also what ``gradbed run --dry-run`` prints);
:class:`BackgroundTraffic` starts the processes and stops them when the run ends.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from agents.core import config as cfgmod
from controller import rundir
from controller.agent_env import python_path
from topo.cleanup import BACKGROUND_PORTS
from topo.spec import HostSpec, NetSpec, SpecError
from traces.pcap import rewrite_pcap_file

__all__ = ["BASE_PORT", "BackgroundTraffic", "FlowCommand", "commands", "flow_hosts", "peer",
           "read_report", "read_tcpreplay"]

BASE_PORT = BACKGROUND_PORTS[0]  # topo.cleanup recognises leftovers by these ports
# With duration_s = 0 the flows run until the run ends; iperf3 needs a length, so it gets
# the run's own timeout plus this, and is interrupted when the run is over.
_OPEN_ENDED_EXTRA_S = 60


@dataclass(frozen=True)
class FlowCommand:
    host: str
    argv: tuple[str, ...]
    role: str  # "server" (stopped with SIGTERM) or "client" (SIGINT: it reports, then exits)
    log: str  # its stdout and stderr, in the run's background/ folder
    report: str = ""  # where a client's totals are read from (iperf3 JSON, tcpreplay's log)
    port: int = 0  # a server's listening port
    # An agent of ours (a flowgen source): started as the controller starts every agent
    # (its key bundle on stdin, ``--auth stdin``), it sends heartbeats and is watched.
    agent: bool = False


def flow_hosts(spec: NetSpec) -> list[HostSpec]:
    """The hosts background flows start from: those of the ``flowgen`` role, rank order."""
    return sorted((h for h in spec.hosts if h.role == "flowgen"), key=lambda h: h.rank)


def peer(spec: NetSpec, host: HostSpec) -> HostSpec:
    """Where ``host``'s flows go: the sink of its rank if the shape has one, else the PS."""
    for h in spec.hosts:
        if h.kind == "sink" and h.rank == host.rank:
            return h
    ps = spec.hosts_of_kind("ps")
    if len(ps) != 1:
        raise SpecError(f"background host {host.name}: no sink{host.rank} and not exactly "
                        f"one ps host in this {spec.shape} to send to")
    return ps[0]


def commands(cfg: cfgmod.ExperimentConfig, spec: NetSpec, run_dir: Path,
             python: str = sys.executable) -> list[FlowCommand]:
    """The servers (in each background host's peer: an iperf3 server, or a flowgen sink)
    and the clients (one per background host), servers first. Empty when the config asks
    for no background traffic."""
    bg = cfg.background
    if not bg.active:
        return []
    seconds = bg.duration_s if bg.duration_s > 0 else cfg.run.timeout_s + _OPEN_ENDED_EXTRA_S
    cc = bg.congestion or cfg.net.congestion
    py = python
    servers, clients = [], []
    out = run_dir / "background"
    for h in flow_hosts(spec):
        j, host = h.rank, h.name
        server = peer(spec, h)
        ps_ip = server.ip
        port = str(BASE_PORT + j)
        log = str(out / f"{host}.log")
        if bg.kind == "pcap":
            # The capture, readdressed from this host to the PS when the flows start.
            argv = ["tcpreplay", "-i", f"{host}-eth0", "--loop=0", str(out / f"{host}.pcap")]
            if bg.duration_s > 0:
                argv.insert(-1, f"--duration={bg.duration_s:g}")
            if bg.pcap_mbps > 0:
                argv.insert(-1, f"--mbps={bg.pcap_mbps:g}")
            clients.append(FlowCommand(host, tuple(argv), "client", log, report=log))
            continue
        if bg.kind == "flows":
            servers.append(FlowCommand(server.name, (py, "-m", "agents.traffic.flowgen", "sink",
                                                     "--bind", ps_ip, "--port", port),
                                       "server", str(out / f"{server.name}-{port}.log"),
                                       port=int(port)))
            clients.append(FlowCommand(host, (
                py, "-m", "agents.traffic.flowgen", "source", "--run-dir", str(run_dir),
                "--node", host, "--connect", f"{ps_ip}:{port}", "--bind", spec.ip(host),
                "--cdf", str(Path(bg.flow_cdf).resolve()), *cdf_options(bg),
                "--load-mbps", f"{bg.load_mbps:g}",
                "--duration-s", f"{seconds:g}", "--seed", str(cfg.run.seed * 1000 + j),
                "--congestion", cc), "client", log, agent=True))
            continue
        servers.append(FlowCommand(server.name, ("iperf3", "-s", "-1", "-B", ps_ip, "-p", port),
                                   "server", str(out / f"{server.name}-{port}.log"),
                                   port=int(port)))
        report = str(out / f"{host}.json")
        argv = ["iperf3", "-c", ps_ip, "-p", port, "-B", spec.ip(host), "-P", str(bg.flows),
                "-t", f"{seconds:g}", "-C", cc, "-J", "--logfile", report]
        if bg.rate_mbps > 0:
            argv += ["-b", f"{bg.rate_mbps:g}M"]
        if bg.direction == "down":
            argv.append("-R")
        clients.append(FlowCommand(host, tuple(argv), "client", log, report))
    return servers + clients


_TCPREPLAY_ACTUAL = re.compile(
    r"Actual: (\d+) packets \((\d+) bytes\) sent in ([0-9.]+) seconds")


def read_tcpreplay(path: Path) -> dict[str, Any]:
    """tcpreplay's totals (it prints them on exit, also when interrupted) as the fields of
    a ``background`` event; ``error`` when the log has none."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        return {"error": f"{path}: {e}"}
    found = _TCPREPLAY_ACTUAL.findall(text)
    if not found:
        return {"error": f"{path}: no 'Actual: ... packets' line from tcpreplay"}
    packets, n_bytes, seconds = found[-1]
    secs = float(seconds)
    return {"bytes": int(n_bytes), "packets": int(packets), "seconds": secs,
            "mbps": int(n_bytes) * 8 / secs / 1e6 if secs > 0 else 0.0}


def read_report(path: Path) -> dict[str, Any]:
    """One client's iperf3 JSON report as the fields of its ``background`` event. A run
    interrupted early still has one (iperf3 writes it on SIGINT); a missing or unreadable
    report gives ``error``, never an exception."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return {"error": f"{path}: {e}"}
    end = doc.get("end", {})
    sent, received = end.get("sum_sent", {}), end.get("sum_received", {})
    # On interruption only the client's own side is summed: the sender's in "up", the
    # receiver's in "down" (-R); take whichever moved the bytes.
    side = sent if sent.get("bytes", 0) >= received.get("bytes", 0) else received
    out: dict[str, Any] = {"bytes": int(side.get("bytes", 0)),
                           "mbps": float(side.get("bits_per_second", 0.0)) / 1e6,
                           "seconds": float(side.get("seconds", 0.0)),
                           "retransmits": int(sent.get("retransmits", 0))}
    if doc.get("error"):
        out["note"] = str(doc["error"])  # "interrupt - the client has terminated" when stopped
    return out


class _Net(Protocol):
    def popen(self, name: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]: ...

    def wait_listening(self, name: str, port: int, timeout_s: float = 10.0) -> bool: ...

    def run(self, name: str, argv: Sequence[str], timeout_s: float = 60.0
            ) -> subprocess.CompletedProcess[str]: ...


class BackgroundTraffic:
    """Starts the flows ``start_s`` after :meth:`start`; :meth:`stop` ends them and returns
    the per-host reports. Owns its processes: :meth:`stop` always reaps them."""

    def __init__(self, cfg: cfgmod.ExperimentConfig, spec: NetSpec, run_dir: Path,
                 say: Any, python: str = sys.executable,
                 start_agent: Callable[[FlowCommand], subprocess.Popen[Any]] | None = None
                 ) -> None:
        """``start_agent``: how a flowgen source is started (the run's agent start: its
        key bundle on stdin, its heartbeats watched); None: like the other processes, with
        no key and no heartbeat (a test, by hand)."""
        self.cfg = cfg
        self.start_agent = start_agent
        self.out_dir = run_dir / "background"
        self.spec = spec
        self.cmds = commands(cfg, spec, run_dir, python)
        self.say = say
        self.procs: list[tuple[FlowCommand, subprocess.Popen[Any]]] = []
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self._stopped = False

    def start(self, net: _Net) -> None:
        if not self.cmds:
            return
        self.out_dir.mkdir(exist_ok=True)
        self._timer = threading.Timer(self.cfg.background.start_s, self._launch, (net,))
        self._timer.daemon = True
        self._timer.start()

    def _launch(self, net: _Net) -> None:
        try:
            self._launch_locked(net)
        except Exception as e:  # a timer thread: say it, or nobody ever hears of it
            self.say(f"background traffic did not start: {e}")

    def _launch_locked(self, net: _Net) -> None:
        with self._lock:
            if self._stopped:
                return
            for c in self.cmds:
                if c.role == "server":
                    self._popen(net, c)
            # The clients retry nothing: wait until every server listens.
            for c in self.cmds:
                if c.role == "server" and not net.wait_listening(c.host, c.port):
                    self.say(f"background server in {c.host} on port {c.port} is not "
                             f"listening after 10 s; see {c.log}")
            if self.cfg.background.kind == "pcap":
                self._readdress(net)
            for c in self.cmds:
                if c.role == "client":
                    self._popen(net, c)

    def _readdress(self, net: _Net) -> None:
        """Write each host's copy of the capture, from its addresses to its peer's."""
        def mac(host: str) -> str:
            # Inside the host's network namespace (/sys still shows the root's interfaces).
            out = net.run(host, ["ip", "-o", "link", "show", "dev", f"{host}-eth0"]).stdout
            return out.split("link/ether", 1)[1].split()[0]

        for c in self.cmds:
            dst = peer(self.spec, self.spec.host(c.host))
            s = rewrite_pcap_file(self.cfg.background.pcap, c.argv[-1], src_mac=mac(c.host),
                                  dst_mac=mac(dst.name), src_ip=self.spec.ip(c.host),
                                  dst_ip=dst.ip)
            self.say(f"background {c.host}: {s.ipv4_packets} packets of "
                     f"{self.cfg.background.pcap}, {s.mean_mbps:.2f} Mbit/s at its own timing")

    def _popen(self, net: _Net, c: FlowCommand) -> None:
        if c.agent and self.start_agent is not None:
            self.procs.append((c, self.start_agent(replace(c, argv=(*c.argv, "--auth", "stdin")))))
            return
        self.say(f"start background in {c.host}: {' '.join(c.argv)}")
        log = open(c.log, "ab")
        try:
            env = {**os.environ, "PYTHONPATH": python_path(os.environ, str(rundir.REPO_ROOT)),
                   "PYTHONUNBUFFERED": "1"}
            p = net.popen(c.host, list(c.argv), stdout=log, stderr=subprocess.STDOUT,
                          cwd=str(rundir.REPO_ROOT), env=env, start_new_session=True)
        finally:
            log.close()  # the child holds its own copy
        self.procs.append((c, p))

    def stop(self) -> list[dict[str, Any]]:
        """Interrupt every client (iperf3 then writes its report; a flowgen source logs
        its own), stop the servers, and return one report per bulk client host."""
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self._stopped = True
            clients = [(c, p) for c, p in self.procs if c.role == "client"]
            for _, p in clients:
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)
            for _, p in clients:
                _reap(p, 5.0)
            for c, p in self.procs:
                if c.role == "server":
                    if p.poll() is None:
                        p.terminate()
                    _reap(p, 2.0)
            read = read_tcpreplay if self.cfg.background.kind == "pcap" else read_report
            return [{"host": c.host, **read(Path(c.report))} for c, _ in clients if c.report]


def _reap(p: subprocess.Popen[Any], timeout_s: float) -> None:
    try:
        p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def cdf_options(bg: cfgmod.BackgroundConfig) -> tuple[str, ...]:
    """How ``agents.traffic.flowgen`` reads the flow-size file (agents.core.flowsize.load_flow_cdf)."""
    return ("--cdf-format", bg.flow_cdf_format,
            "--cdf-interpolation", bg.flow_cdf_interpolation or "auto",
            "--cdf-packet-bytes", str(bg.flow_cdf_packet_bytes))

