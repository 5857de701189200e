"""The shaping points of a running network: their rates and queues changed in place, and
their counters read.

``topo.build.Network`` builds the points (the commands of ``topo.plan.build_plan``) and
tears them down; what happens to them while the run goes on is here: ``tc class change``
without ever dropping a queue (link/N shaping, bandwidth traces), and the qdisc and HTB
class counters the samplers read. Both go over rtnetlink from this process where the
interface is on this machine (``topo.netlink``: a fork+exec of tc lands 15-60 ms late),
over the run's ssh connection where it is on another server.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from topo import qdisc
from topo.netlink import ClassCounters, RtNetlink
from topo.plan import delay_loss
from topo.qdisc import QdiscStats
from topo.spec import LinkSpec, NetSpec, PointPlace, SpecError, default_queue_bytes
from topo.tc import Tc, TcError

if TYPE_CHECKING:
    from topo.cluster import Cluster


class ShapedPoints:
    """A built network's shaping points.

    spec: the network's spec. dev_tc(host, dev): where the commands for ``dev`` run (in
    ``host``'s namespace, or the root namespace of the server owning the interface for
    None). pid(host): the host's namespace pid. cluster: the network's servers (None:
    all here), which refuse a netlink socket for an interface elsewhere.
    """

    def __init__(self, spec: NetSpec, dev_tc: Callable[[str | None, str], Tc],
                 pid: Callable[[str], int], cluster: Cluster | None) -> None:
        self.spec = spec
        self._dev_tc = dev_tc
        self._pid = pid
        self._cluster = cluster
        self._caps: dict[str, Any] = {}
        self._rates: dict[str, float | None] = {}
        self._auto_queue: dict[str, bool] = {}
        self._ack_first: dict[str, bool] = {}  # dev -> built with the ACKs-first layout
        self._netlink: dict[str | None, RtNetlink] = {}
        # Point name -> place, once: the samplers look a point up thousands of times a
        # second, and NetSpec.place walks every edge.
        self._places = {p.point.name: p for p in spec.places()}

    def _place(self, point: str) -> PointPlace:
        """:meth:`NetSpec.place`, from the table built once (its error for a name not
        there)."""
        return self._places.get(point) or self.spec.place(point)

    def record(self, caps: dict[str, Any]) -> None:
        """Once the points are built: each shaped one's rate, whether gradbed sized its
        queue, and its qdisc layout, as its qdiscs have them."""
        self._caps = caps
        for place in self.spec.places():
            link = delay_loss(place, caps, self._seeded)
            if link.shaped:
                self._rates[place.dev] = link.rate_mbps
                self._auto_queue[place.dev] = link.queue_bytes is None
                self._ack_first[place.dev] = qdisc.acks_first(link, place.point.ack_first)

    def close(self) -> None:
        """The netlink sockets closed (at teardown, while the namespaces exist)."""
        for nl in self._netlink.values():
            nl.close()
        self._netlink.clear()

    @property
    def _seeded(self) -> bool:
        return self.spec.loss_seed is not None

    def rate_mbps(self, dev: str) -> float | None:
        """The HTB rate gradbed last set on ``dev`` (None when unshaped)."""
        return self._rates.get(dev)

    # ----------------------------------------------------------------- changes
    def set_point_rate(self, point: str, rate_mbps: float,
                       queue_bytes: int | None = None) -> None:
        """Change shaping point ``point``'s HTB rate in place (``tc class change``).

        queue_bytes: also resize the bfifo in place (``tc qdisc change``). None keeps the
            spec's fixed queue, or re-derives the default (20 ms) when the spec left it None.
        """
        place = self._place(point)
        link = place.point.link
        # The bucket stays the link's own (burst_ms at the new rate).
        burst = (None if link.burst_ms is None else
                 qdisc.htb_burst_bytes(rate_mbps, self.spec.offload, link.burst_ms))
        self._change_rate(place.host, place.dev, rate_mbps, f"point {point}", queue_bytes,
                          delay_loss(place, self._caps, self._seeded).needs_netem,
                          burst_bytes=burst)

    def set_worker_cap(self, worker: str, rate_mbps: float) -> None:
        """Cap a worker's sending rate (link/N shaping) on its egress HTB class (point
        ``wK.up``).

        The bfifo keeps the worker link's own size: this queue holds only the worker's
        own packets (TCP small queues bound it for loss-based senders), and shrinking it
        to 20 ms at the cap made BBR -- which paces far above a cap it has not measured
        yet -- overflow it; local drops are not retransmissions, the kernel backs off its
        retries, and 2 MB uploads at 6.25 Mbit/s took 28-52 s instead of 2.6 s.
        """
        workers = self.spec.worker_names()
        if worker not in workers:
            raise SpecError(f"worker={worker!r}; allowed {workers}")
        up = self.spec.point("up").link
        up_rate = self._rates.get(self._place("up").dev) or up.rate_mbps
        up_queue = (up.queue_bytes if up.queue_bytes is not None
                    else default_queue_bytes(up_rate))
        burst = qdisc.cap_burst_bytes(rate_mbps, up_queue, len(workers), self.spec.offload)
        place = self._place(f"{worker}.up")
        self._change_rate(place.host, place.dev, rate_mbps, f"worker cap {worker}",
                          queue_bytes=place.point.link.effective_queue_bytes(),
                          burst_bytes=burst)

    def _change_rate(self, host: str | None, dev: str, rate_mbps: float, what: str,
                     queue_bytes: int | None = None, netem: bool = False,
                     burst_bytes: int | None = None) -> None:
        if dev not in self._rates:
            raise SpecError(f"{what}: {dev} carries no gradbed qdisc (its LinkSpec is "
                            f"unshaped); give it a rate_mbps to change it at run time")
        # Validate both values (SpecError naming the field) before touching the kernel.
        LinkSpec(rate_mbps=rate_mbps, queue_bytes=queue_bytes)
        if queue_bytes is None and self._auto_queue.get(dev, False):
            # The spec left the queue to gradbed (20 ms at the rate): keep it 20 ms at the
            # new rate, or a cap from 1000 to 2.5 Mbit/s would leave an 8 s queue behind.
            queue_bytes = default_queue_bytes(rate_mbps)
        tc = self._dev_tc(host, dev)
        # The rate change goes over rtnetlink from this process; the log shows the
        # equivalent command.
        argv, = qdisc.change_rate_commands(dev, rate_mbps, offload=self.spec.offload,
                                           burst_bytes=burst_bytes)
        if tc.via:
            # On another server netlink does not reach: the command itself, over the run's
            # shared ssh connection (a round trip later; the trace's lead timer learns it).
            tc.run(argv)
        else:
            tc.echo(argv, "via netlink")
        if not tc.dry_run and not tc.via:
            cls = qdisc.htb_class(rate_mbps, self.spec.offload, burst_bytes)
            try:
                self._rtnetlink(host, dev).change_htb_class(dev, cls)
            except OSError as e:
                raise TcError(argv, e.errno or -1, f"netlink: {e}", tc.where) from e
        if queue_bytes is not None:
            tc.run_all(qdisc.change_queue_commands(dev, queue_bytes, netem=netem,
                                                   ack_first=self._ack_first.get(dev, False)))
        self._rates[dev] = rate_mbps

    def _rtnetlink(self, host: str | None, dev: str) -> RtNetlink:
        """One netlink socket per namespace, opened on first use, closed at teardown."""
        if self._cluster is not None:
            self._cluster.require_here(host or dev.rsplit("-eth", 1)[0], dev)
        if host not in self._netlink:
            self._netlink[host] = RtNetlink(None if host is None else self._pid(host))
        return self._netlink[host]

    # ----------------------------------------------------------------- counters
    def point_stats(self, point: str) -> QdiscStats:
        """The counters of shaping point ``point``'s queue (its bfifo leaf), read over
        rtnetlink on this machine (what ``tc -s qdisc show`` reads, without its two
        processes: the link sampler reads every watched point every 100 ms)."""
        place = self._place(point)
        tc = self._dev_tc(place.host, place.dev)
        if tc.via or tc.dry_run:
            return qdisc.bottleneck_counters(tc.run(qdisc.stats_command(place.dev),
                                                    echo=False))
        try:
            found = self._rtnetlink(place.host, place.dev).qdisc_counters(place.dev)
        except OSError as e:
            raise TcError(qdisc.stats_command(place.dev), e.errno or -1, f"netlink: {e}",
                          tc.where) from e
        return qdisc.bottleneck_of([QdiscStats(
            kind=c.kind, handle=qdisc.tc_handle(c.classid), parent=qdisc.tc_handle(c.parent),
            sent_bytes=c.sent_bytes, sent_pkts=c.sent_pkts, drops=c.drops,
            overlimits=c.overlimits, requeues=c.requeues, backlog_bytes=c.backlog_bytes,
            backlog_pkts=c.backlog_pkts) for c in found])

    def point_classes(self, point: str) -> dict[str, ClassCounters]:
        """The counters of every HTB class of shaping point ``point`` (``"1:1"``: the
        rate-limited class every packet through the point passes; with ``ack_first``
        also ``"1:10"``, pure ACKs, and ``"1:11"``, everything else), read over
        rtnetlink: no fork, ~15 us, so a sampler can read every point every few ms."""
        place = self._place(point)
        try:
            classes = self._rtnetlink(place.host, place.dev).class_counters(place.dev)
        except OSError as e:
            raise TcError(["tc", "-s", "class", "show", "dev", place.dev], e.errno or -1,
                          f"netlink: {e}", self._dev_tc(place.host, place.dev).where) from e
        out = {f"{c.classid >> 16:x}:{c.classid & 0xFFFF:x}": c for c in classes
               if c.kind == "htb"}
        if qdisc.CLASS_ID not in out:
            raise SpecError(f"point {point!r}: {place.dev} has no htb class {qdisc.CLASS_ID} "
                            f"(found {sorted(out)}); is it shaped?")
        return out

    def qdisc_stats(self, host: str | None, dev: str) -> list[QdiscStats]:
        """Every qdisc on ``dev`` (in ``host``'s namespace, or the root one for None)."""
        return qdisc.parse_tc_stats(self._dev_tc(host, dev).run(qdisc.stats_command(dev),
                                                           echo=False))
