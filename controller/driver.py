"""Drives the emulated network during a run: trace replay and link/N rate shaping.

The policies (``agents.core.policies``) and the replayer (``traces.replay``) are
pure; this is where their decisions become side effects:

- **Trace replay.** Every shaping point of the network spec that names a trace gets
  its own ``TraceReplayer``, which says which HTB rate is due on that point; the driver
  applies it with ``tc class change`` (``Network.set_point_rate``, sent over rtnetlink)
  and logs a ``trace_step`` event (``direction`` = the point's name: ``up``/``down`` for
  the bottleneck) with its ``lag_ms``. Changes are issued early by the lag recent ones
  showed (``LeadTimer``), so they land on time. A trace on the ``up``/``down``
  bottleneck is also B(t) for link/N shaping and the workers' bandwidth hints.
- **Link/N shaping** (seeds/004). Whenever B(t) changes or the PS reports a new
  active set, the rate policy ``shaping.policy`` names (``linkn``: ``LinkNShaper``)
  returns the caps that changed and the driver
  enforces each one, either with ``tc`` (the worker's egress HTB class) or with
  ``SO_MAX_PACING_RATE`` on the worker's socket (a ``pace`` command over the
  control socket), and logs a ``shape`` event. With ``tc`` and ``shaping.pace_guard``,
  the socket is also paced at pace_guard x the cap, so a sender that overestimates its
  rate (bbr) cannot overflow the queue in front of its own cap.
  The same rule runs on the downlink: each worker receives at most B_down/N, enforced
  by pacing the PS's socket to it (whatever ``shaping.method`` says: a ``tc`` cap on
  the switch port facing the worker would be a remote queue, and its drops turned the
  first weight download into RTO backoff). Without it, the PS's
  N parallel weight transfers finish unevenly, the workers start their next upload up
  to a second apart, and a hard B/N uplink cap then leaves the early starters' spare
  share idle (measured: utilisation 0.74, p99 1.33x unshaped, N=16 at 100 Mbit/s).
  The PS then re-splits the sum of these caps among its connections by backlog every
  20 ms (``shaping.downlink = "backlog"``, ``agents/core/policies/backlog.py``), so a
  connection that fell behind catches up.
- **Bandwidth hints.** Every worker is told B(t) and N(t) (``bandwidth``
  command); the oracle ratio policy uses them, the others ignore them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from agents.core import config as cfgmod
from agents.core.bandwidth import BandwidthTrace, load_scaled_trace
from agents.core.events import EventLog, now_ns
from agents.core.nodes import worker_index, worker_node
from agents.core.policies import RatePolicy, make_rate_policy
from agents.core.policies.base import CapChange
from controller.control import ControlServer
from topo.build import Network
from topo.spec import RATE_MAX_MBPS, RATE_MIN_MBPS, NetSpec, SpecError
from traces.replay import LeadTimer, TraceReplayer, calibrate_lead


def load_config_trace(path: str, cfg: cfgmod.TraceConfig) -> BandwidthTrace:
    """Load a trace named in the config, scaled by ``trace.scale``."""
    return load_scaled_trace(path, cfg.granularity_ms, cfg.scale, max_rate_mbps=RATE_MAX_MBPS)


def applied_rate_mbps(trace_rate_mbps: float) -> float:
    """The HTB rate a trace's rate is replayed as: itself, but never below
    ``RATE_MIN_MBPS`` (0.01 Mbit/s, a 1,514-byte frame every 1.2 s). HTB refuses a zero
    rate, and cellular traces go dark (Mahimahi's binned at 100 ms have up to 43 zero
    steps); before, the first zero stopped the replay with a failed ``tc`` change and the
    link kept its last rate for the rest of the run."""
    return max(trace_rate_mbps, RATE_MIN_MBPS)


def check_driver(cfg: cfgmod.ExperimentConfig, spec: NetSpec) -> None:
    """Refuse, before anything is built, what the driver could not do on ``spec``:
    link/N shaping without an ``up``/``down`` bottleneck, and a trace on a worker's uplink
    that a ``tc`` cap would also set (both change the same HTB class)."""
    points = set(spec.point_names())
    if cfg.shaping.method != "none" and not {"up", "down"} <= points:
        raise SpecError(f"shaping.method = {cfg.shaping.method!r} needs the shaping points "
                        f"'up' and 'down' (a bottleneck); the {spec.shape} has none")
    if cfg.shaping.method == "tc":
        for w in spec.worker_names():
            if spec.point(f"{w}.up").trace:
                raise SpecError(f"topo.traces[{w + '.up'!r}] and shaping.method = 'tc' both "
                                f"set {w}'s uplink rate; use shaping.method = 'pacing' or "
                                "'none' with a trace on a worker's link")


class NetworkDriver:
    def __init__(self, cfg: cfgmod.ExperimentConfig, net: Network, ctl: ControlServer,
                 events: EventLog, say: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.net = net
        self.ctl = ctl
        self.events = events
        self.say = say
        self.lock = threading.Lock()
        check_driver(cfg, net.spec)
        # Every shaping point with a trace replays it: the bottleneck's up/down and any
        # other (one worker's uplink, a trunk...).
        self.traces = {p.point.name: load_config_trace(p.point.trace, cfg.trace)
                       for p in net.spec.places() if p.point.trace}
        self.active = frozenset(range(cfg.net.workers))
        # The rate policy shaping.policy names (agents/core/policies/), one per direction
        # of the bottleneck (a shape without up/down points has none). The downlink's caps
        # are the PS pacing its own sockets: a run without the PS (gradbed torchrun, whose
        # ranks all-reduce among themselves) has no downlink shaper.
        points = set(net.spec.point_names())
        has_ps = any(h.role == "ps" for h in net.spec.hosts)
        self.shapers: dict[str, RatePolicy] = {
            d: make_rate_policy(cfg.shaping.policy, bottleneck_mbps=b, workers=cfg.net.workers,
                                worker_link_mbps=cfg.net.worker_link_mbps,
                                headroom=cfg.shaping.headroom)
            for d, b in (("up", cfg.net.bottleneck_mbps), ("down", cfg.net.down_mbps))
            if d in points and (d == "up" or has_ps)}
        self.bottleneck_mbps = {"up": cfg.net.bottleneck_mbps, "down": cfg.net.down_mbps}
        self.start_ns = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lead = LeadTimer()  # rate changes go out early by their recent lag

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Install the initial rates, then replay traces on a thread."""
        if self.traces:
            # Prime the lead with no-op changes (0.4 s), so the first steps land on time.
            d, first = next(iter(self.traces.items()))
            calibrate_lead(self.lead,
                           lambda: self.net.set_point_rate(d, first.rates_mbps[0]),
                           clock_ns=now_ns, sleep_s=time.sleep)
        start_ns = now_ns()
        self.start_ns = start_ns
        self.replayers = {d: TraceReplayer(t, granularity_s=self.cfg.trace.granularity_ms / 1000,
                                           start_ns=start_ns)
                          for d, t in self.traces.items()}
        self._tick(start_ns)
        with self.lock:
            for d, shaper in self.shapers.items():
                self._enforce(shaper.initial(), d)
            self._hint()
        if self.replayers:
            self._thread = threading.Thread(target=self._loop, name="trace-replay", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _loop(self) -> None:
        while not self._stop.is_set():
            deadlines = [d - self.lead.lead_ns for r in self.replayers.values()
                         if (d := r.next_deadline_ns()) is not None]
            if not deadlines:
                return
            wait_s = (min(deadlines) - now_ns()) / 1e9
            if wait_s > 0 and self._stop.wait(wait_s):
                return
            try:
                self._tick(now_ns())
            except Exception as e:  # a failed tc command ends replay loudly, not silently
                self.say(f"trace replay stopped: {e}")
                self.events.emit("replay_error", error=str(e))
                return

    def _tick(self, now: int) -> None:
        for direction, rep in self.replayers.items():  # direction: the point's name
            ahead = self.lead.lead_ns
            for change in rep.due(now + ahead):
                htb_mbps = applied_rate_mbps(change.rate_mbps)
                self.net.set_point_rate(direction, htb_mbps)
                applied = now_ns()
                if change.index or change.loop:  # the first rate is set as the clock starts
                    self.lead.observe(change.t_ns, applied, ahead)
                lag_ms = (applied - change.t_ns) / 1e6
                self.events.emit("trace_step", direction=direction, rate_mbps=change.rate_mbps,
                                 applied_mbps=htb_mbps, index=change.index, loop=change.loop,
                                 lag_ms=lag_ms)
                if direction not in self.shapers:
                    continue  # not the bottleneck: B(t) and the caps stay as they are
                with self.lock:
                    self.bottleneck_mbps[direction] = change.rate_mbps
                    self._enforce(self.shapers[direction].on_bandwidth(change.rate_mbps),
                                  direction)
                    if direction == "up":
                        self._hint()

    # -- membership (from the PS over the control socket) ---------------------------

    def on_report(self, msg: dict[str, Any]) -> None:
        node = str(msg.get("node", ""))
        worker = worker_index(node)
        if msg.get("type") == "hello" and worker is not None:
            self._on_worker_hello(worker)
            return
        if node != "ps" or msg.get("type") != "membership":
            return
        new = frozenset(int(w) for w in msg.get("active", []))
        with self.lock:
            # The membership change first, then the caps it causes.
            self.events.emit("membership", iter=int(msg.get("iter", -1)), active=sorted(new))
            for d, shaper in self.shapers.items():
                changes: list[CapChange] = []
                for w in sorted(self.active - new):
                    changes += shaper.on_leave(w)
                for w in sorted(new - self.active):
                    changes += shaper.on_join(w)
                self._enforce(changes, d)
            self.active = new
            self._hint()

    def _on_worker_hello(self, worker: int) -> None:
        """A worker's control connection came up. Commands sent before it did were dropped
        (the driver starts while the agents are still importing torch), so give it its
        pacing cap and the bandwidth hint now."""
        if "up" not in self.shapers:
            return
        with self.lock:
            cap = self.shapers["up"].caps().get(worker)
            pace = self._socket_pacing_mbps(cap)
            if pace is not None:
                ok = self.ctl.send(worker_node(worker), "pace", rate_bps=pace * 1e6)
                self.events.emit("shape", worker=worker, rate_mbps=pace, method="pacing",
                                 delivered=ok, reason="hello")
            if worker in self.active:
                self._hint_worker(worker)

    # -- enforcement ----------------------------------------------------------------

    def _enforce(self, changes: list[CapChange], direction: str = "up") -> None:
        method = self.cfg.shaping.method
        if method == "none":
            return
        for ch in changes:
            node = worker_node(ch.worker)
            # CapChange.rate_mbps None removes the cap: the worker's own link rate for tc
            # (its HTB class must keep some rate), no pacing limit for sockets.
            cap_mbps = ch.rate_mbps
            delivered = True
            tc_rate = cap_mbps if cap_mbps is not None else self.cfg.net.worker_link_mbps
            if method == "tc" and direction == "up":
                self.net.set_worker_cap(node, tc_rate)
                if self.cfg.shaping.pace_guard:
                    pace = self._socket_pacing_mbps(cap_mbps) or 0.0
                    ok = self.ctl.send(node, "pace", rate_bps=pace * 1e6)
                    self.events.emit("shape", worker=ch.worker, rate_mbps=pace or None,
                                     method="pacing", direction=direction, delivered=ok,
                                     reason="pace_guard")
            elif direction == "up":
                # False when the worker has no control connection yet: it gets the cap
                # again on its hello (_on_worker_hello).
                delivered = self.ctl.send(node, "pace", rate_bps=(cap_mbps or 0.0) * 1e6)
            else:
                # The PS paces its socket to this worker (it keeps the cap for a
                # worker that has not connected yet).
                delivered = self.ctl.send("ps", "pace", worker=ch.worker,
                                          rate_bps=(cap_mbps or 0.0) * 1e6)
            self.events.emit("shape", worker=ch.worker, rate_mbps=cap_mbps, method=method,
                             direction=direction, delivered=delivered, reason="cap")

    def _socket_pacing_mbps(self, cap_mbps: float | None) -> float | None:
        """The SO_MAX_PACING_RATE a worker's socket gets for uplink cap ``cap_mbps``."""
        if cap_mbps is None:
            return None
        if self.cfg.shaping.method == "pacing":
            return cap_mbps
        if self.cfg.shaping.method == "tc" and self.cfg.shaping.pace_guard:
            return cap_mbps * self.cfg.shaping.pace_guard
        return None

    @property
    def bandwidth_mbps(self) -> float:
        """B(t) of the up bottleneck: the configured rate or the trace's last step."""
        return self.bottleneck_mbps["up"]

    def _hint(self) -> None:
        if "up" not in self.shapers:
            return  # no bottleneck, no B(t) to tell
        for w in sorted(self.active):
            self._hint_worker(w)

    def _hint_worker(self, w: int) -> None:
        self.ctl.send(worker_node(w), "bandwidth", bottleneck_bps=self.bandwidth_mbps * 1e6,
                      workers=len(self.active), trace_start_ns=self.start_ns)

