"""The star: N workers and background hosts on one switch, the switch->PS link the
bottleneck (seeds/004's setting: one switch, one parameter server, N workers; DESIGN.md
sections 1.1 and 3).

Shaping points, all on egress (the only direction a qdisc shapes):

- ``up`` (workers -> PS, the up bottleneck): the switch port facing ps, ``gbsw0-eth1``;
- ``down`` (PS -> workers): ``ps-eth0`` inside ps;
- ``wK.up``: ``wK-eth0`` inside wK (its HTB is what a link/N ``tc`` cap changes), and
  ``wK.down``: the switch port facing wK; the same for each background host ``bgJ``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from agents.core.config import ExperimentConfig
from agents.core.nodes import worker_node
from topo.shapes import register
from topo.spec import (
    EXTRA_HOSTS_MAX,
    WORKERS_MAX,
    EdgeSpec,
    HostSpec,
    LinkSpec,
    NetSpec,
    ShapingPoint,
    SpecError,
    SwitchSpec,
    _check_int,
    _link,
    sender_gso_segs,
)


@dataclass(frozen=True)
class StarSpec:
    """The star's own parameters; :meth:`net_spec` is the network they describe.

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
        return [worker_node(i) for i in range(self.workers)]

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
        """GSO segments per packet for a local sender in ``host`` (``spec.sender_gso_segs``):
        ps gets 1, its egress is the down bottleneck and must stay packet-exact; a worker
        or background host shares the up bottleneck's queue with every other sender, and
        its packet holds no more than 1 ms of its own access link either (a 10 Mbit/s
        worker link gets one segment, whatever the bottleneck's share would allow)."""
        self.ip(host)  # raises SpecError naming the unknown host
        if host == "ps":
            return 1
        shared = sender_gso_segs(self.bottleneck_up.effective_queue_bytes(),
                                 self.bottleneck_up.rate_mbps, self.workers + self.extra_hosts)
        own = sender_gso_segs(self.worker_link.effective_queue_bytes(),
                              self.worker_link.rate_mbps, 1)
        return min(shared, own)

    def switch_port(self, host: str) -> int:
        """Switch port number facing a host (ps is port 1), hence the name gbsw0-eth{port}."""
        self.ip(host)  # raises SpecError naming the unknown host
        return self.host_names().index(host) + 1

    def net_spec(self) -> NetSpec:
        sw = self.switch_name
        hosts = [HostSpec("ps", "ps", "ps", self.ip("ps"), 0, 1)]
        hosts += [HostSpec(w, "worker", "worker", self.ip(w), k, self.sender_gso_segs(w))
                  for k, w in enumerate(self.worker_names())]
        hosts += [HostSpec(b, "background", "flowgen", self.ip(b), j, self.sender_gso_segs(b))
                  for j, b in enumerate(self.extra_host_names())]
        edges = [EdgeSpec("ps", 0, sw, self.switch_port("ps"),
                          a_to_b=ShapingPoint("down", self.bottleneck_down,
                                              origin="topo.bottleneck_down"),
                          b_to_a=ShapingPoint("up", self.bottleneck_up,
                                              origin="topo.bottleneck_up"))]
        for h in [*self.worker_names(), *self.extra_host_names()]:
            edges.append(EdgeSpec(h, 0, sw, self.switch_port(h),
                                  a_to_b=ShapingPoint(f"{h}.up", self.worker_link,
                                                      ack_first=self.ack_first,
                                                      origin="topo.worker_link"),
                                  b_to_a=ShapingPoint(f"{h}.down", self.worker_link,
                                                      origin="topo.worker_link")))
        return NetSpec(shape=self.kind, hosts=tuple(hosts), switches=(SwitchSpec(sw),),
                       edges=tuple(edges), offload=self.offload, watch=("up", "down"))

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


def star_spec(cfg: ExperimentConfig) -> StarSpec:
    """The star a config asks for: ``net.*`` gives the bottleneck (rate, queue, delay,
    loss; ``bottleneck_down_mbps`` its PS->workers direction) and the workers' links."""
    n = cfg.net

    def bottleneck(rate_mbps: float) -> LinkSpec:
        return LinkSpec(rate_mbps=rate_mbps, queue_bytes=n.queue_bytes, delay_ms=n.delay_ms,
                        loss_pct=n.loss_pct)

    return StarSpec(workers=n.workers,
                    worker_link=LinkSpec(rate_mbps=n.worker_link_mbps),
                    bottleneck_up=bottleneck(n.bottleneck_mbps),
                    bottleneck_down=bottleneck(n.down_mbps),
                    offload=n.offload, extra_hosts=n.background_hosts,
                    ack_first=n.ack_first)


@register("star")
def star(cfg: ExperimentConfig) -> NetSpec:
    return star_spec(cfg).net_spec()
