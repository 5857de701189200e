"""Background (cross) traffic: iperf3 TCP flows between the background hosts and the PS
that share the bottleneck with the training (DESIGN.md section 3: iperf3 serves as the
background-traffic source).

``[background]`` in a config asks for ``flows`` TCP flows from each of the star's
``net.background_hosts`` hosts (``bg0``, ``bg1``, ...): ``direction = "up"`` sends from the
host to the PS through the up bottleneck, with the workers' gradients; ``"down"`` sends from
the PS to the host (iperf3 ``-R``), with the weights. Each host has its own iperf3 server in
the PS host, on ``BASE_PORT + j``.

:func:`commands` is pure (it is also what ``gradbed run --dry-run`` prints);
:class:`BackgroundTraffic` starts the processes, stops them when the run ends, and reads
each client's JSON report (``background/bgJ.json`` in the run directory, kept) into one
``background`` event per host: bytes, mean rate, retransmits and the seconds it ran.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from controller import config as cfgmod
from topo.spec import StarSpec

__all__ = ["BASE_PORT", "BackgroundTraffic", "FlowCommand", "commands", "read_report"]

BASE_PORT = 15201
# With duration_s = 0 the flows run until the run ends; iperf3 needs a length, so it gets
# the run's own timeout plus this, and is interrupted when the run is over.
_OPEN_ENDED_EXTRA_S = 60


@dataclass(frozen=True)
class FlowCommand:
    host: str
    argv: tuple[str, ...]
    report: str = ""  # the client's JSON report file ("" for a server)


def commands(cfg: cfgmod.ExperimentConfig, spec: StarSpec, out_dir: Path) -> list[FlowCommand]:
    """The iperf3 servers (in the PS host) and clients (one per background host), servers
    first. Empty when ``background.flows`` is 0."""
    bg = cfg.background
    if bg.flows == 0:
        return []
    seconds = bg.duration_s if bg.duration_s > 0 else cfg.run.timeout_s + _OPEN_ENDED_EXTRA_S
    cc = bg.congestion or cfg.net.congestion
    ps_ip = spec.ip("ps")
    servers, clients = [], []
    for j, host in enumerate(spec.extra_host_names()):
        port = str(BASE_PORT + j)
        servers.append(FlowCommand("ps", ("iperf3", "-s", "-1", "-B", ps_ip, "-p", port)))
        report = str(out_dir / f"{host}.json")
        argv = ["iperf3", "-c", ps_ip, "-p", port, "-B", spec.ip(host), "-P", str(bg.flows),
                "-t", f"{seconds:g}", "-C", cc, "-J", "--logfile", report]
        if bg.rate_mbps > 0:
            argv += ["-b", f"{bg.rate_mbps:g}M"]
        if bg.direction == "down":
            argv.append("-R")
        clients.append(FlowCommand(host, tuple(argv), report))
    return servers + clients


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


class BackgroundTraffic:
    """Starts the flows ``start_s`` after :meth:`start`; :meth:`stop` ends them and returns
    the per-host reports. Owns its processes: :meth:`stop` always reaps them."""

    def __init__(self, cfg: cfgmod.ExperimentConfig, spec: StarSpec, run_dir: Path,
                 say: Any) -> None:
        self.cfg = cfg
        self.out_dir = run_dir / "background"
        self.cmds = commands(cfg, spec, self.out_dir)
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
        with self._lock:
            if self._stopped:
                return
            for c in self.cmds:
                if not c.report:
                    self._popen(net, c)
            # An iperf3 server listens within milliseconds; the client retries nothing.
            threading.Event().wait(0.3)
            for c in self.cmds:
                if c.report:
                    self._popen(net, c)

    def _popen(self, net: _Net, c: FlowCommand) -> None:
        self.say(f"start background in {c.host}: {' '.join(c.argv)}")
        log = open(self.out_dir / f"{c.host}-{len(self.procs)}.log", "ab")
        try:
            p = net.popen(c.host, list(c.argv), stdout=log, stderr=subprocess.STDOUT,
                          start_new_session=True)
        finally:
            log.close()  # the child holds its own copy
        self.procs.append((c, p))

    def stop(self) -> list[dict[str, Any]]:
        """Interrupt every client (iperf3 then writes its report), stop the servers, and
        return one report per client host."""
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self._stopped = True
            clients = [(c, p) for c, p in self.procs if c.report]
            for _, p in clients:
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)
            for _, p in clients:
                _reap(p, 5.0)
            for c, p in self.procs:
                if not c.report:
                    if p.poll() is None:
                        p.terminate()
                    _reap(p, 2.0)
            return [{"host": c.host, **read_report(Path(c.report))} for c, _ in clients]


def _reap(p: subprocess.Popen[Any], timeout_s: float) -> None:
    try:
        p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
