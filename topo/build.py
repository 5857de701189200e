"""Build a StarSpec in Mininet, with gradbed's own qdiscs, and always tear it down.

The "build" half of Mininet's describe/build split (STYLE.md). Mininet provides only the
namespaces, veths and a ``LinuxBridge`` (no controller: this kernel has no OVS datapath).
Links are plain ``Link`` objects, not ``TCLink``: rates, queues and delay are installed by
``topo.qdisc`` through ``topo.tc``, so rates above 1000 Mbit/s work, failures raise, and
rate changes (link/N shaping of seeds/004, bandwidth traces) use ``tc class change``
without ever dropping a queue.

Where each LinkSpec is enforced (all on egress, the only direction a qdisc shapes):

- ``bottleneck_up`` (workers -> PS): the switch port facing ps, ``gbsw0-eth1``;
- ``bottleneck_down`` (PS -> workers): ``ps-eth0`` inside ps;
- ``worker_link``: ``wI-eth0`` inside wI (its HTB is what ``set_worker_cap`` changes) and
  the switch port facing wI.

Delay and loss (``delay_ms``, ``loss_pct``) go into netem on the same egress where the
kernel has it. Elsewhere (``topo.netfilter``) they are applied where the packets arrive:
``impairments`` sums, for each receiving host and source, the delays of the two links on
the path (the sender's own access link, then the receiver's) and combines their losses,
and one ``HostImpairment`` per host installs the rules and runs the delay line. The
bottleneck's HTB and queue stay on the egress either way; for a constant delay the
order of a FIFO rate limit and a delay line does not change what a single path sees.

``StarNetwork`` is a context manager: teardown (processes, ``net.stop()``, targeted
cleanup, lock) runs in ``finally`` and also when the build fails halfway.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any, Literal

from topo import qdisc
from topo.cleanup import cleanup
from topo.lock import DEFAULT_LOCK_PATH, NetLock
from topo.netfilter import HostImpairment, Impairment, mechanisms
from topo.netlink import RtNetlink
from topo.probe import probe
from topo.qdisc import QdiscStats
from topo.spec import LinkSpec, SpecError, StarSpec, default_queue_bytes
from topo.tc import Tc, TcError

Direction = Literal["up", "down"]
DIRECTIONS: tuple[Direction, ...] = ("up", "down")


def host_links(spec: StarSpec, host: str) -> tuple[LinkSpec, LinkSpec]:
    """The (out, in) LinkSpecs of ``host``: the egress of its own interface, and the
    egress of the switch port facing it. For ps these are the two bottleneck directions."""
    spec.ip(host)  # raises SpecError naming an unknown host
    if host == "ps":
        return spec.bottleneck_down, spec.bottleneck_up
    return spec.worker_link, spec.worker_link


def impairments(spec: StarSpec) -> dict[str, list[Impairment]]:
    """Per receiving host, the netfilter impairments that give every path of the star its
    delay and loss (``topo.netfilter``): the path S -> H crosses out(S) then in(H)
    (``host_links``), so H delays what S sends by out(S).delay_ms + in(H).delay_ms and
    loses it with 1 - (1 - out(S).loss)(1 - in(H).loss). Sources with the same figures
    share one rule group; a group of every other host matches any source."""
    hosts = spec.host_names()
    out: dict[str, list[Impairment]] = {}
    for h in hosts:
        groups: dict[tuple[float, float], list[str]] = {}
        into = host_links(spec, h)[1]
        for src in hosts:
            if src == h:
                continue
            via = host_links(spec, src)[0]
            delay_ms = via.delay_ms + into.delay_ms
            keep = (1 - via.loss_pct / 100) * (1 - into.loss_pct / 100)
            loss_pct = round(100 * (1 - keep), 9)
            if delay_ms > 0 or loss_pct > 0:
                groups.setdefault((delay_ms, loss_pct), []).append(spec.ip(src))
        n_others = len(hosts) - 1
        imps = [Impairment(dev=f"{h}-eth0", delay_ms=d, loss_pct=lp,
                           sources=() if len(ips) == n_others else tuple(ips))
                for (d, lp), ips in groups.items()]
        if imps:
            out[h] = imps
    return out


def require_impairments(spec: StarSpec, caps: Mapping[str, Any]) -> dict[str, str | None]:
    """The delay and loss mechanisms this build will use (``topo.netfilter.mechanisms``);
    raises CapabilityError naming the link when the spec asks for one the kernel lacks."""
    mech = mechanisms(caps)
    for name, link in (("bottleneck_up", spec.bottleneck_up),
                       ("bottleneck_down", spec.bottleneck_down),
                       ("worker_link", spec.worker_link)):
        for field, value, kind, need in (("delay_ms", link.delay_ms, "delay",
                                          "netem or NFQUEUE (iptables)"),
                                         ("loss_pct", link.loss_pct, "loss",
                                          "netem or the statistic match (iptables)")):
            if value > 0 and mech[kind] is None:
                raise qdisc.CapabilityError(
                    f"topo.{name}.{field}={value:g} needs {need}, and this kernel has "
                    f"neither (gradbed probe shows what it has)")
    return mech


class StarNetwork:
    """A running star: ``with StarNetwork(spec) as net: net.popen("w0", [...])``.

    log: receives every external command as ``$ tc ...`` plus progress lines.
    lock_path / lock_timeout_s: the machine-wide network lock (topo.lock).
    caps: kernel capabilities (topo.probe); probed when None.
    """

    def __init__(self, spec: StarSpec, *, log: Callable[[str], None] | None = None,
                 lock_path: str = DEFAULT_LOCK_PATH, lock_timeout_s: float = 600.0,
                 caps: dict[str, Any] | None = None) -> None:
        if not isinstance(spec, StarSpec):
            raise SpecError(f"spec={spec!r} is not a StarSpec")
        self.spec = spec
        self.log = log
        self.caps = caps
        self.tc = Tc(log=log)
        self._lock = NetLock(lock_path, lock_timeout_s, log=log)
        self._net: Any = None
        self._procs: list[subprocess.Popen[Any]] = []
        self._rates: dict[str, float | None] = {}
        self._netlink: dict[str | None, RtNetlink] = {}
        self._auto_queue: dict[str, bool] = {}
        self._ack_first: dict[str, bool] = {}  # dev -> built with the ACKs-first layout
        self.removed_at_start: list[str] = []
        # Delay and loss: the mechanisms in use, and the netfilter ones per host.
        self.mechanisms: dict[str, str | None] = {"delay": None, "loss": None}
        self.host_impairments: list[HostImpairment] = []
        self.impairment_records: list[dict[str, Any]] = []
        self.lock_wait_s = 0.0
        self.build_s = 0.0
        self.removed_at_exit: list[str] = []

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> StarNetwork:
        t0 = time.monotonic()
        self._lock.acquire()
        # Waiting for another run's network is not bring-up time: keep them apart.
        self.lock_wait_s = time.monotonic() - t0
        try:
            self._build()
            self.build_s = time.monotonic() - t0 - self.lock_wait_s
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._teardown()

    def _say(self, msg: str) -> None:
        if self.log is not None:
            self.log(msg)

    def _build(self) -> None:
        spec = self.spec
        if self.caps is None:
            self.caps = probe()
        # Refuse what the kernel cannot do before creating anything.
        self.mechanisms = require_impairments(spec, self.caps)
        self.removed_at_start = cleanup()
        for line in self.removed_at_start:
            self._say(f"cleanup before build: {line}")

        from mininet.link import Link
        from mininet.log import setLogLevel
        from mininet.net import Mininet
        from mininet.node import Host
        from mininet.nodelib import LinuxBridge

        setLogLevel("error")  # our own log carries the commands; Mininet's is noise here
        net = Mininet(topo=None, controller=None, switch=LinuxBridge, host=Host, link=Link,
                      build=False, autoSetMacs=True)
        self._net = net
        sw = net.addSwitch(spec.switch_name, cls=LinuxBridge, stp=False)
        for name in spec.host_names():
            net.addHost(name, ip=f"{spec.ip(name)}/24")
        for name in spec.host_names():
            net.addLink(net[name], sw, port1=0, port2=spec.switch_port(name),
                        intfName1=f"{name}-eth0",
                        intfName2=f"{spec.switch_name}-eth{spec.switch_port(name)}")
        net.build()
        net.start()
        self._say(f"star up: {spec.workers} workers, switch {spec.switch_name}")

        self.set_offload(spec.offload)

        for d in DIRECTIONS:
            self._shape(d, self._link(d))
        for w in spec.worker_names() + spec.extra_host_names():
            self._shape_dev(w, f"{w}-eth0", spec.worker_link, ack_first=spec.ack_first)
            self._shape_dev(None, self._switch_port_dev(w), spec.worker_link)
        if not self._netem:
            for host, imps in impairments(spec).items():
                hi = HostImpairment(host, self.pid(host), imps, tc=self.tc)
                # Appended first: a start that fails halfway is still torn down.
                self.host_impairments.append(hi)
                hi.__enter__()

    @property
    def _netem(self) -> bool:
        return bool((self.caps or {}).get("netem"))

    def _qdisc_link(self, link: LinkSpec) -> LinkSpec:
        """``link`` as its egress qdiscs see it: without netem, delay and loss live in
        netfilter on the receiving side (``impairments``), not in the qdisc."""
        return link if self._netem else replace(link, delay_ms=0.0, loss_pct=0.0)

    def check_impairments(self) -> None:
        """Raise ImpairmentError if a delay line has died (its link drops everything)."""
        for hi in self.host_impairments:
            hi.check()

    def impairment_record(self) -> dict[str, Any]:
        """Which mechanism gave delay and loss, and (after teardown) what each host's
        delay line did: for the run's meta.json."""
        return {"delay_mechanism": self.mechanisms["delay"] if self._any("delay_ms") else None,
                "loss_mechanism": self.mechanisms["loss"] if self._any("loss_pct") else None,
                "hosts": self.impairment_records
                or [hi.record() for hi in self.host_impairments]}

    def _any(self, field: str) -> bool:
        return any(getattr(link, field) > 0 for link in (
            self.spec.bottleneck_up, self.spec.bottleneck_down, self.spec.worker_link))

    def _teardown(self) -> None:
        for nl in self._netlink.values():
            nl.close()
        self._netlink.clear()
        try:
            # While the namespaces exist: rules out, delay lines stopped, records kept.
            for hi in reversed(self.host_impairments):
                hi.__exit__(None, None, None)
            self.impairment_records = [hi.record() for hi in self.host_impairments]
            self.host_impairments.clear()
            for proc in self._procs:
                if proc.poll() is None:
                    proc.terminate()
            for proc in self._procs:
                try:
                    proc.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            self._procs.clear()
            if self._net is not None:
                try:
                    self._net.stop()
                finally:
                    self._net = None
        finally:
            try:
                self.removed_at_exit = cleanup()
                for line in self.removed_at_exit:
                    self._say(f"cleanup after stop: {line}")
            finally:
                self._lock.release()

    # ----------------------------------------------------------------- shaping
    def set_offload(self, on: bool) -> None:
        """GSO/TSO/GRO on or off on every interface of the star (both veth ends).

        HTB burst sizes stay those of the spec's offload setting; the minimum burst only
        matters below ~50 Mbit/s, where GSO frames are rare.
        """
        for name in self.spec.host_names():
            self._host_tc(name).run_all(qdisc.offload_commands(
                f"{name}-eth0", on, self.spec.sender_gso_segs(name)))
            self.tc.run_all(qdisc.offload_commands(self._switch_port_dev(name), on))

    def _link(self, direction: Direction) -> LinkSpec:
        if direction == "up":
            return self.spec.bottleneck_up
        if direction == "down":
            return self.spec.bottleneck_down
        raise SpecError(f"direction={direction!r}; allowed {list(DIRECTIONS)}")

    def _switch_port_dev(self, host: str) -> str:
        return f"{self.spec.switch_name}-eth{self.spec.switch_port(host)}"

    def _host_tc(self, host: str) -> Tc:
        return self.tc.in_netns(self.pid(host), host)

    def _dev_tc(self, host: str | None) -> Tc:
        return self.tc if host is None else self._host_tc(host)

    def _shape_dev(self, host: str | None, dev: str, link: LinkSpec, *,
                   ack_first: bool = False) -> None:
        cmds = qdisc.shaping_commands(dev, self._qdisc_link(link), self.caps or {},
                                      offload=self.spec.offload, ack_first=ack_first)
        self._dev_tc(host).run_all(cmds)
        self._rates[dev] = link.rate_mbps
        self._auto_queue[dev] = link.queue_bytes is None
        self._ack_first[dev] = qdisc.acks_first(self._qdisc_link(link), ack_first)

    def _shape(self, direction: Direction, link: LinkSpec) -> None:
        host, dev = self._bottleneck_where(direction)
        self._shape_dev(host, dev, link)

    def _bottleneck_where(self, direction: Direction) -> tuple[str | None, str]:
        self._link(direction)  # validates direction
        if direction == "up":
            return None, self._switch_port_dev("ps")
        return "ps", "ps-eth0"

    def bottleneck_dev(self, direction: Direction) -> str:
        """Interface whose egress qdisc is the bottleneck in this direction."""
        return self._bottleneck_where(direction)[1]

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
        tc = self._dev_tc(host)
        # The rate change goes over rtnetlink from this process (topo/netlink.py: a
        # fork+exec of tc lands 15-60 ms late here); the log shows the equivalent command.
        argv, = qdisc.change_rate_commands(dev, rate_mbps, offload=self.spec.offload,
                                           burst_bytes=burst_bytes)
        tc.echo(argv, "via netlink")
        if not tc.dry_run:
            cls = qdisc.htb_class(rate_mbps, self.spec.offload, burst_bytes)
            try:
                self._rtnetlink(host).change_htb_class(dev, cls)
            except OSError as e:
                raise TcError(argv, e.errno or -1, f"netlink: {e}", tc.where) from e
        if queue_bytes is not None:
            tc.run_all(qdisc.change_queue_commands(dev, queue_bytes, netem=netem,
                                                   ack_first=self._ack_first.get(dev, False)))
        self._rates[dev] = rate_mbps

    def _rtnetlink(self, host: str | None) -> RtNetlink:
        """One netlink socket per namespace, opened on first use, closed at teardown."""
        if host not in self._netlink:
            self._netlink[host] = RtNetlink(None if host is None else self.pid(host))
        return self._netlink[host]

    def set_bottleneck_rate(self, direction: Direction, rate_mbps: float,
                            queue_bytes: int | None = None) -> None:
        """Change the bottleneck's HTB rate in place (``tc class change``).

        queue_bytes: also resize the bfifo in place (``tc qdisc change``). None keeps the
            spec's fixed queue, or re-derives the default (20 ms) when the spec left it None.
        """
        host, dev = self._bottleneck_where(direction)
        self._change_rate(host, dev, rate_mbps, f"bottleneck {direction}", queue_bytes,
                          self._qdisc_link(self._link(direction)).needs_netem)

    def set_worker_cap(self, worker: str, rate_mbps: float) -> None:
        """Cap a worker's sending rate (link/N shaping) on its egress HTB class.

        The bfifo keeps the worker link's own size: this queue holds only the worker's
        own packets (TCP small queues bound it for loss-based senders), and shrinking it
        to 20 ms at the cap made BBR -- which paces far above a cap it has not measured
        yet -- overflow it; local drops are not retransmissions, the kernel backs off its
        retries, and 2 MB uploads at 6.25 Mbit/s took 28-52 s instead of 2.6 s.
        """
        if worker not in self.spec.worker_names():
            raise SpecError(f"worker={worker!r}; allowed {self.spec.worker_names()}")
        up = self._link("up")
        up_rate = self._rates.get(self.bottleneck_dev("up")) or up.rate_mbps
        up_queue = (up.queue_bytes if up.queue_bytes is not None
                    else default_queue_bytes(up_rate))
        burst = qdisc.cap_burst_bytes(rate_mbps, up_queue,
                                      len(self.spec.worker_names()), self.spec.offload)
        self._change_rate(worker, f"{worker}-eth0", rate_mbps, f"worker cap {worker}",
                          queue_bytes=self.spec.worker_link.effective_queue_bytes(),
                          burst_bytes=burst)

    def rate_mbps(self, dev: str) -> float | None:
        """The HTB rate gradbed last set on ``dev`` (None when unshaped)."""
        return self._rates.get(dev)

    def bottleneck_stats(self, direction: Direction) -> QdiscStats:
        host, dev = self._bottleneck_where(direction)
        text = self._dev_tc(host).run(qdisc.stats_command(dev), echo=False)
        return qdisc.bottleneck_counters(text)

    def qdisc_stats(self, host: str | None, dev: str) -> list[QdiscStats]:
        """Every qdisc on ``dev`` (in ``host``'s namespace, or the root one for None)."""
        return qdisc.parse_tc_stats(self._dev_tc(host).run(qdisc.stats_command(dev),
                                                           echo=False))

    def set_congestion_control(self, algo: str) -> None:
        """Set TCP congestion control in every host (the sysctl is per namespace)."""
        allowed = list((self.caps or {}).get("tcp_congestion_control") or [])
        if algo not in allowed:
            raise SpecError(f"tcp congestion control {algo!r} is not available on this "
                            f"kernel; allowed {allowed}")
        # Outside the initial namespace the kernel only lets a namespace default to an
        # algorithm on the global allowed list (EPERM otherwise), so add it there first.
        allowed_path = "/proc/sys/net/ipv4/tcp_allowed_congestion_control"
        with open(allowed_path) as f:
            globally_allowed = f.read().split()
        if algo not in globally_allowed:
            value = " ".join([*globally_allowed, algo])
            self.tc.run(["sysctl", "-w", f"net.ipv4.tcp_allowed_congestion_control={value}"])
        for name in self.spec.host_names():
            self._host_tc(name).run(["sysctl", "-w", f"net.ipv4.tcp_congestion_control={algo}"])

    # ----------------------------------------------------------------- hosts
    def _require_net(self) -> Any:
        if self._net is None:
            raise RuntimeError("StarNetwork is not running (use it as a context manager)")
        return self._net

    def host(self, name: str) -> Any:
        """The Mininet Host object (for interactive use; prefer popen for processes)."""
        self.spec.ip(name)  # raises SpecError naming an unknown host
        return self._require_net()[name]

    def ip(self, name: str) -> str:
        return self.spec.ip(name)

    def pid(self, name: str) -> int:
        return int(self.host(name).pid)

    def popen(self, name: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside host ``name``'s network namespace.

        The process shares the file system (Unix control sockets in the run directory
        work) and is terminated, then killed, when the network is torn down.
        """
        full = ["nsenter", "-t", str(self.pid(name)), "-n", "--", *argv]
        kw.setdefault("env", {**os.environ})
        proc = subprocess.Popen(full, **kw)
        self._procs.append(proc)
        return proc

    def wait_listening(self, name: str, port: int, timeout_s: float = 10.0) -> bool:
        """Wait until a TCP socket listens on ``port`` in host ``name`` (a server started
        with :meth:`popen` is not listening yet when it returns). False on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            out = self.run(name, ["ss", "-ltnH", f"sport = :{port}"]).stdout
            if out.strip():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def run(self, name: str, argv: Sequence[str], timeout_s: float = 60.0,
            ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in host ``name`` to completion; raise on a non-zero exit."""
        full = ["nsenter", "-t", str(self.pid(name)), "-n", "--", *argv]
        return subprocess.run(full, capture_output=True, text=True, timeout=timeout_s,
                              check=True)
