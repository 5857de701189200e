"""Delay and loss on a receiving host's ingress with netfilter, for kernels without netem.

DESIGN.md section 3. A shaping point's one-way ``delay_ms`` and ``loss_pct`` are
applied where the packets *arrive*, in the receiving host's namespace, so the sender's
stack is untouched and it sees a real RTT and a real loss on the wire (not a local
error, not a socket stalled by TCP small queues):

- loss: ``iptables -t raw -A PREROUTING -i DEV [-s SRC] ! -d 224.0.0.0/4 -m statistic
  --mode random --probability p -j DROP`` (multicast, IGMP included, is left alone). The kernel draws from ``get_random_u32()``, which cannot be
  seeded: the loss pattern differs between runs (the rate does not), and the record says
  ``loss_seeded: false``.
- seeded loss (``net.loss_model = "seeded"``, ``Impairment.loss_seed``): no statistic rule;
  the packets go to the host's NFQUEUE (with or without a delay) and the delay line drops
  each one ``topo.loss`` draws from the seed, the link's name (``Impairment.loss_key``) and
  the kernel's packet id. The same seed loses the same packets; ``loss_seeded: true``.
- delay: ``iptables -t raw -A PREROUTING -i DEV [-s SRC] ! -d 224.0.0.0/4 -j NFQUEUE
  --queue-num Q``
  and one ``topo.delayline`` process in the host holding every queue of that host for
  its delay. Lost packets are dropped before they reach the queue.

No ``--queue-bypass``: with no delay line bound, the kernel drops the queue's packets, so a
dead delay line shows as a dead link, never as an undelayed one. ``HostImpairment.check``
raises when the process has died, and its ``record`` (for the run's meta.json) carries the
kernel's per-queue drop counters.

``Impairment`` and ``rule_commands`` are pure (printable in a dry run); ``HostImpairment``
is the context manager that owns the rules and the process, torn down in ``finally``.
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
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any

from topo.remote_delayline import DelayLineNotStarted, ServerDelayLine
from topo.tc import Tc, TcError

# Marks every rule gradbed adds, so a listing shows whose they are.
RULE_COMMENT = "gradbed-impair"
# First NFQUEUE number gradbed uses in a host (one per distinct delay); queues are per
# network namespace, so every host can start at the same number.
FIRST_QUEUE = 100
# Multicast is no emulated flow, and it is left alone: the IGMP reports a host sends
# when its interface comes up (0.0.0.0 > 224.0.0.22, seen seconds into a run) would
# otherwise take a seeded loss's packet ids at a random moment and shift every draw after.
MULTICAST = "224.0.0.0/4"
READY_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 3.0
DELAYLINE_MODULE = "topo.delayline"


class ImpairmentError(RuntimeError):
    """The delay line could not start or has died; the message names the host."""


@dataclass(frozen=True)
class Impairment:
    """Delay and loss for packets arriving on ``dev`` of one host.

    dev: the receiving interface (its ingress).
    delay_ms: one-way delay added to each packet; 0 for none.
    loss_pct: percentage of packets dropped at random; 0 for none.
    sources: IPv4 source addresses the rule matches; empty matches every packet (the
        delay of a link that ends in this host; a link that ends in a switch is the
        sum of the paths through it, see ``topo.build``).
    loss_seed: None for the kernel's unseeded statistic match; an integer (the run's
        seed) for the delay line's seeded draw (``topo.loss``).
    """

    dev: str
    delay_ms: float = 0.0
    loss_pct: float = 0.0
    sources: tuple[str, ...] = ()
    loss_seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.delay_ms <= 10_000.0:
            raise ValueError(f"Impairment.delay_ms={self.delay_ms!r}; allowed 0..10000 ms")
        if not 0.0 <= self.loss_pct <= 100.0:
            raise ValueError(f"Impairment.loss_pct={self.loss_pct!r}; allowed 0..100 %")

    @property
    def active(self) -> bool:
        return self.delay_ms > 0 or self.loss_pct > 0

    @property
    def seeded_loss(self) -> bool:
        return self.loss_pct > 0 and self.loss_seed is not None

    @property
    def queued(self) -> bool:
        """Whether the packets go to the delay line (a delay, or a seeded loss)."""
        return self.delay_ms > 0 or self.seeded_loss

    @property
    def loss_key(self) -> str:
        """The link's name in the seeded draw: the receiving interface and the sources the
        rule matches (``ps-eth0/10.0.0.1,10.0.0.2``; ``/any`` for every source)."""
        return f"{self.dev}/{','.join(self.sources) or 'any'}"


def mechanisms(caps: Mapping[str, Any], seeded_loss: bool = False) -> dict[str, str | None]:
    """Which mechanism gives delay and loss on this kernel (``topo.probe``'s caps):
    netem where present, else NFQUEUE (delay) and the statistic match (loss), else None.
    ``seeded_loss``: loss by the delay line's seeded draw ("seeded", NFQUEUE), netem or not."""
    if seeded_loss:
        loss = "seeded" if caps.get("nfqueue") else None
    else:
        loss = "netem" if caps.get("netem") else (
            "statistic" if caps.get("xt_statistic") else None)
    return {
        "delay": "netem" if caps.get("netem") else ("nfqueue" if caps.get("nfqueue") else None),
        "loss": loss,
    }


def _probability(loss_pct: float) -> str:
    # iptables takes a fraction and keeps 31 bits of it.
    return f"{loss_pct / 100:.10f}".rstrip("0").rstrip(".")


def rule_commands(imps: Sequence[Impairment], op: str = "-A",
                  first_queue: int = FIRST_QUEUE) -> list[list[str]]:
    """iptables argv lists for ``imps`` (``op``: ``-A`` installs, ``-D`` removes); the
    i-th impairment with a delay or a seeded loss gets queue ``first_queue + i``. Loss rules
    (the unseeded statistic match) come before the queue rules, so a packet lost there
    never costs the delay line anything."""
    if op not in ("-A", "-D"):
        raise ValueError(f"op={op!r}; allowed '-A', '-D'")
    loss: list[list[str]] = []
    delay: list[list[str]] = []
    for i, imp in enumerate(imps):
        for src in imp.sources or (None,):
            head = ["iptables", "-w", "-t", "raw", op, "PREROUTING", "-i", imp.dev]
            if src is not None:
                head += ["-s", src]
            head += ["!", "-d", MULTICAST]
            tag = ["-m", "comment", "--comment", RULE_COMMENT]
            if imp.loss_pct > 0 and not imp.seeded_loss:
                loss.append([*head, "-m", "statistic", "--mode", "random", "--probability",
                             _probability(imp.loss_pct), *tag, "-j", "DROP"])
            if imp.queued:
                delay.append([*head, *tag, "-j", "NFQUEUE", "--queue-num",
                              str(first_queue + i)])
    return loss + delay


def delay_queues(imps: Sequence[Impairment], first_queue: int = FIRST_QUEUE,
                 ) -> list[tuple[int, float]]:
    """(queue, delay_ms) of every impairment whose packets go to the delay line (a delay or
    a seeded loss), as ``rule_commands`` numbers them."""
    return [(first_queue + i, imp.delay_ms) for i, imp in enumerate(imps) if imp.queued]


def loss_args(imps: Sequence[Impairment], first_queue: int = FIRST_QUEUE) -> list[str]:
    """The delay line's ``--loss Q:LOSS_PCT:SEED:LINK`` arguments for the seeded losses."""
    return [a for i, imp in enumerate(imps) if imp.seeded_loss
            for a in ("--loss", f"{first_queue + i}:{imp.loss_pct!r}:{imp.loss_seed}:"
                                f"{imp.loss_key}")]


def parse_queue_counters(text: str) -> dict[int, dict[str, int]]:
    """``/proc/net/netfilter/nfnetlink_queue``: per queue, the packets held now, those the
    kernel dropped because the queue was full (``queue_dropped``), those it could not
    notify (``user_dropped``), and the last packet id."""
    out: dict[int, dict[str, int]] = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) < 8:
            continue
        out[int(f[0])] = {"portid": int(f[1]), "held": int(f[2]), "queue_dropped": int(f[5]),
                          "user_dropped": int(f[6]), "id_sequence": int(f[7])}
    return out


class HostImpairment:
    """Installs ``imps`` in the host of ``pid`` (named ``host``) and runs its delay line.

    ``with HostImpairment("ps", pid, [Impairment("ps-eth0", delay_ms=20)], tc=tc) as h:``
    The delay line binds its queues before the rules that feed them exist, and the rules
    go before the delay line stops (which releases what it holds), so no packet meets a
    queue nobody serves while the link is up.
    """

    def __init__(self, host: str, pid: int, imps: Sequence[Impairment], *, tc: Tc | None = None,
                 python: str = sys.executable, realtime: bool = True) -> None:
        self.host = host
        self.pid = pid
        self.imps = [i for i in imps if i.active]
        self.tc = (tc or Tc()).in_netns(pid, host)
        self.python = python
        self.realtime = realtime
        self.proc: subprocess.Popen[bytes] | ServerDelayLine | None = None
        self._dir: str | None = None
        self._installed: list[list[str]] = []
        self.stats: dict[str, Any] | None = None
        self.counters: dict[int, dict[str, int]] = {}
        self.cpu_s: float | None = None
        self.died: str | None = None
        # Rules that could not be deleted because their namespace was already gone.
        self.teardown_errors: list[str] = []
        self._stopped = False

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> HostImpairment:
        try:
            self._start()
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop()

    def _start(self) -> None:
        queues = delay_queues(self.imps)
        # On another server the delay line runs there, over the run's ssh (tc.via).
        remote = (ServerDelayLine(self.tc.via, self.tc.server, self.pid)
                  if self.tc.via and queues and not self.tc.dry_run else None)
        if queues:
            self._dir = remote.mkdtemp() if remote else tempfile.mkdtemp(prefix="gbdelay-")
            ready = os.path.join(self._dir, "ready")
            argv = [self.python, "-m", DELAYLINE_MODULE, "--ready", ready,
                    "--stats", os.path.join(self._dir, "stats.json"),
                    *[a for q, d in queues for a in ("--queue", f"{q}:{d!r}")],
                    *loss_args(self.imps)]
            if not self.realtime:
                argv.append("--no-realtime")
            spin = os.environ.get("GB_DELAYLINE_SPIN_US")  # for benchmarks/delay_fidelity.py
            if spin:
                argv += ["--spin-us", spin]
            self.tc.echo(argv, "delay line")
            if remote is not None:
                self.proc = remote
                try:
                    remote.start(argv, ready, READY_TIMEOUT_S)
                except DelayLineNotStarted as e:
                    raise ImpairmentError(f"host {self.host}: {e}") from e
            elif not self.tc.dry_run:
                env = {**os.environ, "PYTHONPATH": _project_root() + os.pathsep
                       + os.environ.get("PYTHONPATH", "")}
                self.proc = subprocess.Popen(
                    ["nsenter", "-t", str(self.pid), "-n", "--", *argv], env=env,
                    stdout=subprocess.DEVNULL, stderr=open(os.path.join(self._dir, "stderr"),
                                                           "wb"))
                deadline = time.monotonic() + READY_TIMEOUT_S
                while not os.path.exists(ready):
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise ImpairmentError(f"host {self.host}: delay line did not start "
                                              f"(exit {self.proc.poll()}): {self._stderr()}")
                    time.sleep(0.01)
        for argv in rule_commands(self.imps, "-A"):
            self.tc.run(argv)
            self._installed.append(argv)

    def _stderr(self) -> str:
        if self._dir is None:
            return ""
        if isinstance(self.proc, ServerDelayLine):
            return (self.proc.read("stderr") or "").strip()[-2000:] or "(no stderr)"
        try:
            with open(os.path.join(self._dir, "stderr"), errors="replace") as f:
                return f.read().strip()[-2000:] or "(no stderr)"
        except OSError:
            return "(no stderr)"

    def check(self) -> None:
        """Raise ImpairmentError if the delay line has died (its queues now drop every
        packet: the link is down, not undelayed)."""
        if self.proc is not None and self.proc.poll() is not None:
            self.died = f"exit {self.proc.returncode}: {self._stderr()}"
            raise ImpairmentError(f"host {self.host}: delay line{self.where} died "
                                  f"({self.died}); its link drops every packet")

    @property
    def where(self) -> str:
        """`` on SERVER`` for a delay line of another server; "" for one here."""
        return f" on {self.proc.server}" if isinstance(self.proc, ServerDelayLine) else ""

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def read_counters(self) -> dict[int, dict[str, int]]:
        try:
            text = self.tc.run(["cat", "/proc/net/netfilter/nfnetlink_queue"], echo=False)
        except TcError:
            return {}
        return parse_queue_counters(text)

    def _stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        errors: list[str] = []
        for argv in reversed(self._installed):
            delete = [a if a != "-A" else "-D" for a in argv]
            try:
                self.tc.run(delete)
            except TcError as e:  # the namespace may already be gone: nothing left then
                errors.append(str(e))
        self._installed.clear()
        if self.proc is not None:
            self.counters = self.read_counters()
            if self.proc.poll() is not None and self.died is None:
                self.died = f"exit {self.proc.returncode}: {self._stderr()}"
            self.cpu_s = (self.proc.cpu_s() if isinstance(self.proc, ServerDelayLine)
                          else process_cpu_s(self.proc.pid))
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.stats = self._read_stats()
        if isinstance(self.proc, ServerDelayLine):
            self.proc.remove()
        elif self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._dir = None
        self.teardown_errors = errors

    def _read_stats(self) -> dict[str, Any] | None:
        """The delay line's stats file (where it ran), or None."""
        try:
            if isinstance(self.proc, ServerDelayLine):
                text = self.proc.read("stats.json")
                return json.loads(text) if text else None
            with open(os.path.join(self._dir or "", "stats.json")) as f:
                return dict(json.load(f))
        except (OSError, ValueError):
            return None

    def record(self) -> dict[str, Any]:
        """What was applied and how it went, for the run's meta.json."""
        return {
            "host": self.host,
            "impairments": [asdict(i) for i in self.imps],
            "delay": "nfqueue" if any(i.delay_ms > 0 for i in self.imps) else None,
            "loss": ("seeded" if any(i.seeded_loss for i in self.imps) else "statistic")
            if any(i.loss_pct > 0 for i in self.imps) else None,
            "loss_seeded": any(i.seeded_loss for i in self.imps),
            "delay_line_pid": None if self.proc is None else self.proc.pid,
            "delay_line_died": self.died,
            "delay_line_cpu_s": self.cpu_s,
            "delay_line_stats": self.stats,
            "kernel_queue_counters": {str(k): v for k, v in self.counters.items()},
        }


def process_cpu_s(pid: int) -> float | None:
    """User plus system CPU seconds of a live process (``/proc/PID/stat``), or None.
    ``pid`` is the nsenter, which execs the delay line in place, so it is the delay line."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def _project_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
