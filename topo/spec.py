"""Topologies as pure, validated data: links and the star (workers and background hosts on
one switch, the switch->PS link the bottleneck).

This is the "describe first" half of Mininet's split (``mininet/topo.py``): nothing here
needs root or touches the OS. ``topo.build`` turns a spec into namespaces, veths, a Linux
bridge and gradbed's own HTB/bfifo qdiscs. The star is the setting of seeds/004 (one
switch, one parameter server, N workers, the switch->PS link is the bottleneck); see
DESIGN.md sections 1.1 and 3.

Every field is checked in ``__post_init__``; a bad value raises ``SpecError`` naming the
field, the value and the allowed range.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

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
    """

    rate_mbps: float | None
    queue_bytes: int | None = None
    delay_ms: float = 0.0
    loss_pct: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_mbps is not None:
            _check_range("LinkSpec.rate_mbps", self.rate_mbps, RATE_MIN_MBPS,
                         RATE_MAX_MBPS, "Mbit/s")
        if self.queue_bytes is not None:
            _check_int("LinkSpec.queue_bytes", self.queue_bytes, QUEUE_MIN_BYTES,
                       QUEUE_MAX_BYTES)
        _check_range("LinkSpec.delay_ms", self.delay_ms, 0.0, DELAY_MAX_MS, "ms")
        _check_range("LinkSpec.loss_pct", self.loss_pct, 0.0, 100.0, "%")

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


# A sender's GSO packet holds at most this long of its B/N share (StarSpec.sender_gso_segs).
SENDER_BURST_S = 0.001


@dataclass(frozen=True)
class StarSpec:
    """N workers and background hosts on one switch; the switch->PS link is the bottleneck.

    workers: worker hosts w0..w{N-1}, 1..64.
    worker_link: each worker's access link, both directions (egress of wI-eth0 and of the
        switch port facing wI). Its HTB class is what link/N shaping changes at run time.
    bottleneck_up: workers->PS direction (egress of the switch port facing ps).
    bottleneck_down: PS->workers direction (egress of ps-eth0).
    offload: GSO/TSO/GRO on every interface. Off (default) keeps queues packet-exact and
        qdisc counters in wire frames; on lowers CPU per byte.
    extra_hosts: background-traffic hosts bg0.. on the worker side, 0..64.
    ack_first: each host's own egress (wI-eth0, bgI-eth0) sends pure ACKs ahead of its
        queued data, within the same HTB rate (``topo.qdisc``). Under a link/N cap the
        host's upload queues there, and the ACKs of its download would wait behind it.
    """

    workers: int
    worker_link: LinkSpec = LinkSpec(rate_mbps=1000.0)
    bottleneck_up: LinkSpec = LinkSpec(rate_mbps=100.0)
    bottleneck_down: LinkSpec = LinkSpec(rate_mbps=100.0)
    offload: bool = False
    extra_hosts: int = 0
    ack_first: bool = False

    kind: ClassVar[str] = "star"
    switch_name: ClassVar[str] = "gbsw0"  # never relies on Mininet's "s" prefix magic

    def __post_init__(self) -> None:
        _check_int("topo.workers", self.workers, 1, WORKERS_MAX)
        _check_int("topo.extra_hosts", self.extra_hosts, 0, EXTRA_HOSTS_MAX)
        _link("topo.worker_link", self.worker_link)
        _link("topo.bottleneck_up", self.bottleneck_up)
        _link("topo.bottleneck_down", self.bottleneck_down)
        for name in ("offload", "ack_first"):
            if not isinstance(getattr(self, name), bool):
                raise SpecError(f"topo.{name}={getattr(self, name)!r} is not a bool; "
                                "allowed true/false")

    def worker_names(self) -> list[str]:
        return [f"w{i}" for i in range(self.workers)]

    def extra_host_names(self) -> list[str]:
        return [f"bg{j}" for j in range(self.extra_hosts)]

    def host_names(self) -> list[str]:
        return ["ps", *self.worker_names(), *self.extra_host_names()]

    def ip(self, host: str) -> str:
        """10.0.0.x address of a host: ps .1, workers .10.., background hosts .100..

        Fixed blocks keep a worker's address stable when extra hosts are added.
        """
        if host == "ps":
            return "10.0.0.1"
        if host in self.worker_names():
            return f"10.0.0.{10 + int(host[1:])}"
        if host in self.extra_host_names():
            return f"10.0.0.{100 + int(host[2:])}"
        raise SpecError(f"host={host!r} is not in this star; allowed {self.host_names()}")

    def sender_gso_segs(self, host: str) -> int:
        """Largest GSO packet (in segments) a local TCP sender in ``host`` may hand its own
        qdisc when offload is off.

        The stack segments GSO packets after the qdisc, so the egress HTB of the sending
        host (a worker's link/N cap; the down bottleneck in ps) is charged and released one
        GSO packet at a time. ps gets 1: its egress is the down bottleneck and must stay
        packet-exact. A worker or background host gets as many as keep one such packet
        from every sender of the star together within half the up bottleneck's queue
        (the rule of ``qdisc.cap_burst_bytes``), and no more than 1 ms of the sender's
        initial B/N share, at least 1 and at most a 64 KB packet. For 16 workers: 1 at
        100 Mbit/s, 5 at 1 Gbit/s with a 10 MB queue (2 with 100 KB); one sender at
        1 Gbit/s gets the full 43, where the lower per-packet CPU keeps the rate within
        reach of 2 cores. Measured: at 100 Mbit/s, 10 MB, bbr, 43 segments gave link/N a
        Jain index of 0.972 and one segment 0.9999; two workers capped at 10 Mbit/s with
        41-segment packets saw TCP_INFO rates too bursty to count as stable (the adaptive
        keep never settled after a 100 -> 20 Mbit/s step), with 4 or 1 they settle in one
        iteration.
        """
        self.ip(host)  # raises SpecError naming the unknown host
        if host == "ps":
            return 1
        senders = self.workers + self.extra_hosts
        queue = self.bottleneck_up.effective_queue_bytes()
        by_queue = queue // (2 * senders * WIRE_FRAME_BYTES)
        share_mbps = (self.bottleneck_up.rate_mbps or RATE_MAX_MBPS) / senders
        by_share = int(share_mbps * 1e6 / 8 * SENDER_BURST_S) // WIRE_FRAME_BYTES
        return max(1, min(GSO_SEGS_MAX, by_queue, by_share))

    def switch_port(self, host: str) -> int:
        """Switch port number facing a host (ps is port 1), hence the name gbsw0-eth{port}."""
        self.ip(host)  # raises SpecError naming the unknown host
        return self.host_names().index(host) + 1

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "switch": self.switch_name,
            "workers": self.workers,
            "extra_hosts": self.extra_hosts,
            "offload": self.offload,
            "ack_first": self.ack_first,
            "hosts": {h: self.ip(h) for h in self.host_names()},
            "worker_link": self.worker_link.describe(),
            "bottleneck_up": self.bottleneck_up.describe(),
            "bottleneck_down": self.bottleneck_down.describe(),
        }
