"""Networks as pure, validated data: hosts (each with a role), switches, and links whose
every direction is a named *shaping point*.

This is the "describe first" half of Mininet's split (``mininet/topo.py``): nothing here
needs root or touches the OS. The shapes (``topo/shapes/``, one file each: star,
dumbbell, fabric) turn a config into a :class:`NetSpec`; ``topo.plan`` turns a spec into
the exact commands, and ``topo.build`` runs them (namespaces, veths, Linux bridges,
gradbed's own HTB/bfifo qdiscs). DESIGN.md section 2 ("Roles on shapes") and section 3.

Every field is checked in ``__post_init__``; a bad value raises ``SpecError`` naming the
field, the value and the allowed range.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

from agents.core.ethernet import (  # noqa: F401  (re-exported: topo's users read them here)
    GSO_SEGS_MAX,
    TCP_GOODPUT_FRACTION,
    TCP_MSS_BYTES,
    WIRE_FRAME_BYTES,
)

# HTB on these machines was measured up to 10 Gbit/s (DESIGN.md section 3); Mininet caps
# at 1000 Mbit/s (bwParamMax) and silently drops anything higher, which we refuse to copy.
RATE_MIN_MBPS = 0.01
RATE_MAX_MBPS = 10_000.0
# One full-size Ethernet frame: a smaller byte queue could not hold a single packet.
QUEUE_MIN_BYTES = 1514
QUEUE_MAX_BYTES = 1 << 30
DELAY_MAX_MS = 10_000.0
WORKERS_MAX = 64
EXTRA_HOSTS_MAX = 64


class SpecError(ValueError):
    """A topology field is out of range; the message names field, value and allowed range."""


def _check_range(name: str, value: float, lo: float, hi: float, unit: str) -> None:
    # NaN compares false with everything, so test it explicitly.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise SpecError(f"{name}={value!r} is not a number; allowed {lo:g}..{hi:g} {unit}")
    if not lo <= value <= hi:
        raise SpecError(f"{name}={value!r} is out of range; allowed {lo:g}..{hi:g} {unit}")


def _check_int(name: str, value: int, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{name}={value!r} is not an integer; allowed {lo}..{hi}")
    if not lo <= value <= hi:
        raise SpecError(f"{name}={value!r} is out of range; allowed {lo}..{hi}")


@dataclass(frozen=True)
class LinkSpec:
    """One direction of a link, enforced on the sending interface's egress.

    rate_mbps: HTB rate and ceiling; None leaves the link unshaped (veth speed, ~15 Gbit/s).
        Lower rate, longer transfers, more queueing.
    queue_bytes: bfifo drop-tail limit in bytes (bytes, not packets: with GSO a pfifo
        "1000 packets" held 5-7 MB). None picks ``default_queue_bytes(rate_mbps)``.
        Bigger queue, fewer drops, more queueing delay.
    delay_ms, loss_pct: one-way delay and random loss: netem on the same egress where the
        kernel has it, else netfilter on the receiving host (``topo.netfilter``); where
        neither exists, asking for them is an error, never silently ignored.
    burst_ms: the HTB bucket (burst and cburst) as time at the rate; None = gradbed's
        default (``qdisc.HTB_BURST_S``, 10 ms); ``qdisc.htb_burst_bytes`` turns it into
        bytes, at least two frames. Smaller: a link that idled overshoots its rate by
        less when it starts again (the bucket drains at line rate), but a dequeue late by
        more than the bucket loses rate.
    """

    rate_mbps: float | None
    queue_bytes: int | None = None
    delay_ms: float = 0.0
    loss_pct: float = 0.0
    burst_ms: float | None = None

    def __post_init__(self) -> None:
        if self.rate_mbps is not None:
            _check_range("LinkSpec.rate_mbps", self.rate_mbps, RATE_MIN_MBPS,
                         RATE_MAX_MBPS, "Mbit/s")
        if self.queue_bytes is not None:
            _check_int("LinkSpec.queue_bytes", self.queue_bytes, QUEUE_MIN_BYTES,
                       QUEUE_MAX_BYTES)
        _check_range("LinkSpec.delay_ms", self.delay_ms, 0.0, DELAY_MAX_MS, "ms")
        _check_range("LinkSpec.loss_pct", self.loss_pct, 0.0, 100.0, "%")
        if self.burst_ms is not None:
            _check_range("LinkSpec.burst_ms", self.burst_ms, 0.1, 1000.0, "ms")

    @property
    def needs_netem(self) -> bool:
        return self.delay_ms > 0 or self.loss_pct > 0

    @property
    def shaped(self) -> bool:
        """True when gradbed installs any qdisc on this link."""
        return self.rate_mbps is not None or self.queue_bytes is not None or self.needs_netem

    def effective_queue_bytes(self) -> int:
        return self.queue_bytes if self.queue_bytes is not None else default_queue_bytes(
            self.rate_mbps)

    def describe(self) -> dict[str, Any]:
        d = asdict(self)
        d["effective_queue_bytes"] = self.effective_queue_bytes()
        return d


def default_queue_bytes(rate_mbps: float | None) -> int:
    """Drop-tail size when none is given: 20 ms at the link rate, at least 32 full frames.

    With no configured delay the base RTT through veths is well under a millisecond, so
    20 ms is many BDPs: one TCP flow keeps the link busy after a halving (the fidelity
    target), while the queueing delay stays bounded. 32 frames keeps slow links (1 Mbit/s)
    from dropping the slow-start burst of a single flow.
    """
    floor = 32 * 1514
    if rate_mbps is None:
        return 1000 * 1514  # veth's default txqueuelen, expressed in bytes
    return max(floor, int(rate_mbps * 1e6 / 8 * 0.020))


def _link(name: str, link: LinkSpec) -> LinkSpec:
    if not isinstance(link, LinkSpec):
        raise SpecError(f"{name}={link!r} is not a LinkSpec")
    return link


# A sender's GSO packet holds at most this long of its B/N share (sender_gso_segs).
SENDER_BURST_S = 0.001


def sender_gso_segs(queue_bytes: int, rate_mbps: float | None, senders: int) -> int:
    """Largest GSO packet (in segments) a local TCP sender may hand its own qdisc when
    offload is off, when ``senders`` hosts share one queue of ``queue_bytes`` at
    ``rate_mbps``.

    The stack segments GSO packets after the qdisc, so the egress HTB of a sending host (a
    worker's link/N cap) is charged and released one GSO packet at a time. A sender gets
    as many segments as keep one such packet from every sender together within half the
    shared queue (the rule of ``qdisc.cap_burst_bytes``), and no more than 1 ms
    (``SENDER_BURST_S``) of its rate / senders share; at least 1, at most a 64 KB packet.
    For 16 workers: 1 at 100 Mbit/s, 5 at 1 Gbit/s with a 10 MB queue (2 with 100 KB);
    one sender at 1 Gbit/s gets the full 43, where the lower per-packet CPU keeps the rate
    within reach of 2 cores. Measured: at 100 Mbit/s, 10 MB, bbr, 43 segments gave link/N
    a Jain index of 0.972 and one segment 0.9999; two workers capped at 10 Mbit/s with
    41-segment packets saw TCP_INFO rates too bursty to count as stable (the adaptive keep
    never settled after a 100 -> 20 Mbit/s step), with 4 or 1 they settle in one iteration.
    """
    senders = max(1, senders)
    by_queue = queue_bytes // (2 * senders * WIRE_FRAME_BYTES)
    share_mbps = (rate_mbps or RATE_MAX_MBPS) / senders
    by_share = int(share_mbps * 1e6 / 8 * SENDER_BURST_S) // WIRE_FRAME_BYTES
    return max(1, min(GSO_SEGS_MAX, by_queue, by_share))


# ----------------------------------------------------------------------------- NetSpec
# Linux interface names hold at most 15 characters (IFNAMSIZ - 1).
IFNAME_MAX = 15
# Names topo.cleanup recognises as gradbed's (a host or switch with another name would
# survive a crash), kept in sync with ``topo.cleanup.HOST_NAME``/``SWITCH_NAME``.
HOST_NAME_RE = re.compile(r"^(?:ps|w\d+|bg\d+|sink\d+|gbh\d+)$")
SWITCH_NAME_RE = re.compile(r"^gbsw\d+$")
POINT_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
HOSTS_MAX = 256


@dataclass(frozen=True)
class ShapingPoint:
    """One direction of one link, where gradbed installs its qdiscs (the egress of the
    sending interface, the only direction a qdisc shapes).

    name: unique in the spec; a config names it to give it a trace (``topo.traces``):
        ``up``/``down`` for a star's or dumbbell's bottleneck, ``HOST.up`` (host ->
        switch) and ``HOST.down`` (switch -> host) for a host's access link.
    link: rate_mbps, queue_bytes, delay_ms, loss_pct (``LinkSpec``).
    trace: bandwidth trace replayed on this point during a run (Mahimahi packet
        deliveries or ``time_s Mbps`` lines, ``traces.bandwidth``); "" = fixed rate.
    ack_first: the host's own egress sends pure ACKs ahead of queued data (topo.qdisc).
    origin: the spec or config field that set ``link``, named in errors ("" = the point).
    """

    name: str
    link: LinkSpec
    trace: str = ""
    ack_first: bool = False
    origin: str = ""

    @property
    def label(self) -> str:
        """How errors name this point: its origin field and its name."""
        return f"{self.origin} (point {self.name})" if self.origin else f"point {self.name}"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not POINT_NAME_RE.match(self.name):
            raise SpecError(f"shaping point name={self.name!r}; allowed 1..64 of "
                            "letters, digits, '_', '.', '-'")
        _link(f"point {self.name}.link", self.link)
        if not isinstance(self.trace, str):
            raise SpecError(f"point {self.name}.trace={self.trace!r} is not a path string")
        if self.trace and self.link.rate_mbps is None:
            raise SpecError(f"point {self.name}: trace={self.trace!r} needs a rate_mbps "
                            "(the trace changes an HTB rate, an unshaped link has none)")

    def describe(self) -> dict[str, Any]:
        return {"link": self.link.describe(), "trace": self.trace,
                "ack_first": self.ack_first}


@dataclass(frozen=True)
class HostSpec:
    """One emulated host.

    name: also its Mininet name and interface prefix (``NAME-eth0``).
    kind: what the host is for (``ps``, ``worker``, ``background``, ``stage``...); a role
        declares the kinds it may run on.
    role: the registered role the runner starts on it (``controller.roles``); "" = none.
    ip: its IPv4 address (a /24 shared by every host).
    rank: its index among the hosts of its kind (worker k, stage i, background host j).
    gso_segs: GSO segments a local sender may put in one packet with offload off
        (:func:`sender_gso_segs`); 1 keeps its egress queue packet-exact.
    placement: the machine that runs it under Mininet Cluster Edition; "" = this one.
    """

    name: str
    kind: str
    role: str
    ip: str
    rank: int = 0
    gso_segs: int = 1
    placement: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not HOST_NAME_RE.match(self.name):
            raise SpecError(f"host name={self.name!r}; allowed ps, wN, bgN, sinkN, gbhN "
                            "(names topo.cleanup recognises)")
        for field in ("kind", "role", "placement"):
            if not isinstance(getattr(self, field), str):
                raise SpecError(f"host {self.name}.{field}={getattr(self, field)!r} is not "
                                "a string")
        parts = self.ip.split(".") if isinstance(self.ip, str) else []
        if len(parts) != 4 or not all(p.isdigit() and 0 <= int(p) <= 255 for p in parts):
            raise SpecError(f"host {self.name}.ip={self.ip!r} is not an IPv4 address")
        _check_int(f"host {self.name}.rank", self.rank, 0, HOSTS_MAX)
        _check_int(f"host {self.name}.gso_segs", self.gso_segs, 1, GSO_SEGS_MAX)


@dataclass(frozen=True)
class SwitchSpec:
    """A Linux bridge (``mininet.nodelib.LinuxBridge``, no controller, no STP)."""

    name: str
    placement: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not SWITCH_NAME_RE.match(self.name):
            raise SpecError(f"switch name={self.name!r}; allowed gbswN (never relies on "
                            "Mininet's 's' prefix)")


@dataclass(frozen=True)
class EdgeSpec:
    """A veth pair between nodes ``a`` and ``b`` (hosts or switches), ``a``'s interface
    ``a-eth{a_port}``; ``a_to_b`` is shaped on the egress of ``a``'s interface, ``b_to_a``
    on ``b``'s."""

    a: str
    a_port: int
    b: str
    b_port: int
    a_to_b: ShapingPoint
    b_to_a: ShapingPoint

    def __post_init__(self) -> None:
        for end, port in ((self.a, self.a_port), (self.b, self.b_port)):
            _check_int(f"edge {self.a}-{self.b} port of {end}", port, 0, 4095)
            if len(f"{end}-eth{port}") > IFNAME_MAX:
                raise SpecError(f"interface {end}-eth{port} is longer than {IFNAME_MAX} "
                                "characters (Linux IFNAMSIZ)")
        for p in (self.a_to_b, self.b_to_a):
            if not isinstance(p, ShapingPoint):
                raise SpecError(f"edge {self.a}-{self.b}: {p!r} is not a ShapingPoint")

    @property
    def a_intf(self) -> str:
        return f"{self.a}-eth{self.a_port}"

    @property
    def b_intf(self) -> str:
        return f"{self.b}-eth{self.b_port}"


@dataclass(frozen=True)
class PointPlace:
    """Where a shaping point lives: the egress of ``dev``, in host ``host``'s network
    namespace, or in the root namespace (a switch port) when ``host`` is None."""

    point: ShapingPoint
    host: str | None
    dev: str


@dataclass(frozen=True)
class NetSpec:
    """A whole network: what one builder (``topo.build.Network``) makes, and what the dry
    run prints (``topo.plan``).

    shape: the registered shape that produced it (``topo.shapes``).
    hosts, switches, edges: the graph; every edge direction is a named shaping point.
    offload: GSO/TSO/GRO on every interface. Off (default) keeps queues packet-exact and
        qdisc counters in wire frames; on lowers CPU per byte.
    watch: shaping points whose qdisc counters the run samples every 100 ms into
        ``links.parquet`` (a point with a trace is sampled as well).
    loss_seed: None: ``loss_pct`` uses netem or the kernel's statistic match, which
        cannot be seeded; an integer (``run.seed`` when ``net.loss_model = "seeded"``):
        the delay line loses packets drawn from it (``topo.loss``), the same packets in
        every run with the same seed.
    """

    shape: str
    hosts: tuple[HostSpec, ...]
    switches: tuple[SwitchSpec, ...]
    edges: tuple[EdgeSpec, ...]
    offload: bool = False
    watch: tuple[str, ...] = ()
    loss_seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.offload, bool):
            raise SpecError(f"offload={self.offload!r} is not a bool; allowed true/false")
        if self.loss_seed is not None and (
                isinstance(self.loss_seed, bool) or not isinstance(self.loss_seed, int)
                or not 0 <= self.loss_seed < 1 << 63):
            raise SpecError(f"loss_seed={self.loss_seed!r}; allowed None or an integer "
                            "0..2^63-1")
        if not 1 <= len(self.hosts) <= HOSTS_MAX:
            raise SpecError(f"{len(self.hosts)} hosts; allowed 1..{HOSTS_MAX}")
        names: set[str] = set()
        nodes: list[HostSpec | SwitchSpec] = [*self.hosts, *self.switches]
        for node in nodes:
            if node.name in names:
                raise SpecError(f"node name {node.name!r} is used twice")
            names.add(node.name)
        ips = [h.ip for h in self.hosts]
        for h in self.hosts:
            if ips.count(h.ip) > 1:
                raise SpecError(f"host {h.name}.ip={h.ip!r} is used by another host")
        intfs: set[str] = set()
        points: set[str] = set()
        for e in self.edges:
            for end in (e.a, e.b):
                if end not in names:
                    raise SpecError(f"edge {e.a}-{e.b}: node {end!r} is not in the spec; "
                                    f"allowed {sorted(names)}")
            for intf in (e.a_intf, e.b_intf):
                if intf in intfs:
                    raise SpecError(f"interface {intf} is used by two edges")
                intfs.add(intf)
            for p in (e.a_to_b, e.b_to_a):
                if p.name in points:
                    raise SpecError(f"shaping point name {p.name!r} is used twice")
                points.add(p.name)
        for w in self.watch:
            if w not in points:
                raise SpecError(f"watch={w!r} is not a shaping point; allowed {sorted(points)}")

    # -- lookups ----------------------------------------------------------------
    def host(self, name: str) -> HostSpec:
        for h in self.hosts:
            if h.name == name:
                return h
        raise SpecError(f"host={name!r} is not in this {self.shape}; allowed "
                        f"{self.host_names()}")

    def host_names(self) -> list[str]:
        return [h.name for h in self.hosts]

    def hosts_of_kind(self, kind: str) -> list[HostSpec]:
        return [h for h in self.hosts if h.kind == kind]

    def ip(self, host: str) -> str:
        return self.host(host).ip

    def worker_names(self) -> list[str]:
        """Data-parallel workers (kind ``worker``), in rank order."""
        return [h.name for h in sorted(self.hosts_of_kind("worker"), key=lambda h: h.rank)]

    def places(self) -> list[PointPlace]:
        """Every shaping point and where it is enforced, in edge order."""
        hosts = set(self.host_names())
        out = []
        for e in self.edges:
            out.append(PointPlace(e.a_to_b, e.a if e.a in hosts else None, e.a_intf))
            out.append(PointPlace(e.b_to_a, e.b if e.b in hosts else None, e.b_intf))
        return out

    def place(self, point: str) -> PointPlace:
        for p in self.places():
            if p.point.name == point:
                return p
        raise SpecError(f"shaping point={point!r} is not in this {self.shape}; allowed "
                        f"{self.point_names()}")

    def point(self, name: str) -> ShapingPoint:
        return self.place(name).point

    def point_names(self) -> list[str]:
        return [p.point.name for p in self.places()]

    def interfaces(self) -> list[tuple[str | None, str, int]]:
        """(namespace host or None for the root, interface, GSO segments) of every
        interface: a host's own interface gets its ``gso_segs``, a switch port 1."""
        hosts = {h.name: h for h in self.hosts}
        out: list[tuple[str | None, str, int]] = []
        for e in self.edges:
            for end, intf in ((e.a, e.a_intf), (e.b, e.b_intf)):
                h = hosts.get(end)
                out.append((end, intf, h.gso_segs) if h is not None else (None, intf, 1))
        return out

    def with_traces(self, traces: dict[str, str]) -> NetSpec:
        """This spec with ``traces`` (point name -> trace path) set on those points;
        an unknown point is an error naming the known ones.

        A host whose own egress (its uplink) replays a trace sends one-segment packets
        (``gso_segs`` 1): its rate moves with the trace, often to a few Mbit/s, where the
        bottleneck's share would allow 8 segments, 9 ms of a 10 Mbit/s link in one packet.
        One segment keeps the host's queue packet-exact, as a real cellular uplink is, and
        keeps the kernel's transmit stamps of its writes within one MSS of each packet's
        start (``agents.core.drain``)."""
        known = set(self.point_names())
        for name in traces:
            if name not in known:
                raise SpecError(f"topo.traces: shaping point {name!r} is not in this "
                                f"{self.shape}; allowed {self.point_names()}")

        def put(p: ShapingPoint) -> ShapingPoint:
            return replace(p, trace=traces[p.name]) if p.name in traces else p

        edges = tuple(replace(e, a_to_b=put(e.a_to_b), b_to_a=put(e.b_to_a))
                      for e in self.edges)
        traced = {p.host for p in self.places() if p.point.name in traces and p.host}
        hosts = tuple(replace(h, gso_segs=1) if h.name in traced else h for h in self.hosts)
        return replace(self, edges=edges, hosts=hosts)

    def describe(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "offload": self.offload,
            "hosts": {h.name: {"kind": h.kind, "role": h.role, "ip": h.ip, "rank": h.rank,
                               "placement": h.placement} for h in self.hosts},
            "switches": [s.name for s in self.switches],
            "points": {p.point.name: {"dev": p.dev, "in": p.host or "root",
                                      **p.point.describe()} for p in self.places()},
            "watch": list(self.watch),
            "loss_seed": self.loss_seed,
        }
