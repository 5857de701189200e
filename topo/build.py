"""Build any network spec in Mininet, with gradbed's own qdiscs, and always tear it down.

The "build" half of Mininet's describe/build split (STYLE.md). Mininet provides only the
namespaces, veths and ``LinuxBridge`` switches (no controller: this kernel has no OVS
datapath). Links are plain ``Link`` objects, not ``TCLink``: rates, queues and delay are
installed by the commands of ``topo.plan.build_plan`` (the same list ``--dry-run``
prints) through ``topo.tc``, so rates above 1000 Mbit/s work and failures raise. Rate
changes (link/N shaping of seeds/004, bandwidth traces on any shaping point) and the
points' counters are ``topo.points``: ``tc class change`` without ever dropping a queue.

Every shaping point sits on the egress of its interface (``NetSpec.places``): in a
host's namespace for a host's own interface, in the root namespace for a switch port.
For the star: ``up`` is ``gbsw0-eth1``, ``down`` is ``ps-eth0``, ``wK.up`` is ``wK-eth0``
(what ``set_worker_cap`` changes).

Delay and loss go into netem on the same egress where the kernel has it; elsewhere
(``topo.netfilter``) they are applied where the packets arrive, one ``HostImpairment``
per receiving host with the figures of ``topo.plan.impairments`` (the sum over each
path's shaping points).

``Network`` is a context manager: teardown (processes, ``net.stop()``, targeted cleanup,
lock) runs in ``finally`` and also when the build fails halfway.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol

from topo import qdisc
from topo.cleanup import cleanup
from topo.lock import DEFAULT_LOCK_PATH, NetLock
from topo.netfilter import HostImpairment, Impairment, ImpairmentError
from topo.netlink import ClassCounters
from topo.placement import LOCAL, servers_used
from topo.plan import Step, build_plan, group_steps, require_local
from topo.plan import impairments as _impairments
from topo.plan import require_impairments as _require_impairments
from topo.points import ShapedPoints
from topo.probe import probe
from topo.qdisc import QdiscStats
from topo.spec import NetSpec, SpecError
from topo.tc import Tc

if TYPE_CHECKING:  # topo.cluster imports Mininet, needed only for a spread network
    from topo.cluster import Cluster, SshAccess
    from topo.server_lock import LockSet

Direction = Literal["up", "down"]
DIRECTIONS: tuple[Direction, ...] = ("up", "down")


class HasNetSpec(Protocol):
    """A shape's own parameters (``topo.shapes.star.StarSpec``) that describe a network."""

    def net_spec(self) -> NetSpec: ...


def _net_spec(spec: NetSpec | HasNetSpec) -> NetSpec:
    if isinstance(spec, NetSpec):
        return spec
    if not callable(getattr(spec, "net_spec", None)):
        raise SpecError(f"spec={spec!r} is neither a NetSpec nor has net_spec()")
    return spec.net_spec()


def impairments(spec: NetSpec | HasNetSpec) -> dict[str, list[Impairment]]:
    """``topo.plan.impairments`` of a NetSpec or of a shape's own spec (a StarSpec)."""
    return _impairments(_net_spec(spec))


def require_impairments(spec: NetSpec | HasNetSpec, caps: Mapping[str, Any]
                        ) -> dict[str, str | None]:
    """``topo.plan.require_impairments`` of a NetSpec or of a shape's own spec."""
    return _require_impairments(_net_spec(spec), caps)


class Spawner(Protocol):
    """Starts ``argv`` in the network namespace of process ``netns_pid`` with Popen's
    keywords; returns what it started (Popen's ``poll``, ``wait``, ``terminate``, ``kill``,
    ``pid``, ``returncode``, ``stdin``) or None when it cannot."""

    def __call__(self, argv: list[str], netns_pid: int, **kw: Any) -> Any: ...


class Network:
    """A running network: ``with Network(spec) as net: net.popen("w0", [...])``.

    spec: a ``NetSpec`` (or anything with ``net_spec()``, such as a ``StarSpec``).
    log: receives every external command as ``$ tc ...`` plus progress lines.
    lock_path / lock_timeout_s: the machine-wide network lock (topo.lock).
    caps: kernel capabilities (topo.probe); probed when None.
    access: how to reach the servers of a spec placed over several (``topo.cluster``);
        None builds every node here and refuses a spec placed elsewhere.
    spawner: starts a process in a host of this machine instead of ``nsenter``, given the
        argv, the host's namespace pid and Popen's keywords (``controller.warm``: agents
        forked from an interpreter that has imported torch); it returns None for what it
        cannot start, which then starts as usual.
    """

    def __init__(self, spec: NetSpec | HasNetSpec, *, log: Callable[[str], None] | None = None,
                 lock_path: str = DEFAULT_LOCK_PATH, lock_timeout_s: float = 600.0,
                 caps: dict[str, Any] | None = None, access: SshAccess | None = None,
                 spawner: Spawner | None = None) -> None:
        self.spec: NetSpec = _net_spec(spec)
        self._spawner = spawner
        # Refused before the lock or any namespace.
        self.cluster = _cluster(self.spec, access, log)
        self.log = log
        self.caps = caps
        self.tc = Tc(log=log)
        self._lock = NetLock(lock_path, lock_timeout_s, log=log)
        self._lock_timeout_s = lock_timeout_s
        self._locks: NetLock | LockSet = self._lock
        self._net: Any = None
        self._procs: list[Any] = []  # Popen, or what the spawner returned
        self.points = ShapedPoints(self.spec, self._dev_tc, self.pid, self.cluster)
        self.removed_at_start: list[str] = []
        # Delay and loss: the mechanisms in use, and the netfilter ones per host.
        self.mechanisms: dict[str, str | None] = {"delay": None, "loss": None}
        self.host_impairments: list[HostImpairment] = []
        self.impairment_records: list[dict[str, Any]] = []
        self.lock_wait_s = 0.0
        self.build_s = 0.0
        self._checks: Future[None] | None = None  # the cluster's, started with the locks
        self.removed_at_exit: list[str] = []

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> Network:
        t0 = time.monotonic()
        if self.cluster is not None:
            # Each server's lock too, in the order every run takes them
            # (topo.server_lock): two runs sharing a server never build over each other.
            self._locks = self.cluster.lock_set(self._lock, self._lock_timeout_s)
            # The servers' checks only read them (versions, clock offsets): their ssh
            # round trips run while the locks are taken, not after.
            self._checks = _in_background(self.cluster.check)
        try:
            self._locks.acquire()
        except BaseException:
            if self.cluster is not None and self._checks is not None:
                _settled(self._checks)
                self.cluster.close()
            raise
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
        # The whole plan first: what the kernel cannot do is refused before anything exists.
        self.mechanisms = _require_impairments(spec, self.caps)
        plan = build_plan(spec, self.caps)
        if self._checks is not None:
            self._checks.result()  # a server refused: before anything is built
        self.removed_at_start = self._cleanup()
        for line in self.removed_at_start:
            self._say(f"cleanup before build: {line}")
        from mininet.log import setLogLevel

        setLogLevel("error")  # our own log carries the commands; Mininet's is noise here
        net = _local_mininet(spec) if self.cluster is None else self.cluster.mininet()
        self._net = net
        net.build()
        net.start()
        self._say(f"{spec.shape} up: {len(spec.hosts)} hosts, switches "
                  f"{', '.join(s.name for s in spec.switches)}")
        self._run_steps(plan)
        self.points.record(self.caps)
        # Without netem every delay and loss; with it only a seeded loss.
        if not self._netem or self._seeded:
            for host, imps in _impairments(spec, netem=self._netem).items():
                # Its rules and its delay line go in on the host's own server.
                hi = HostImpairment(host, self.pid(host), imps,
                                    tc=self._on_server(self.tc, host))
                # Appended first: a start that fails halfway is still torn down.
                self.host_impairments.append(hi)
            self._each_host(lambda hi: hi.__enter__())

    @property
    def _seeded(self) -> bool:
        return self.spec.loss_seed is not None

    @property
    def _netem(self) -> bool:
        return bool((self.caps or {}).get("netem"))

    def check_impairments(self) -> None:
        """Raise ImpairmentError if a delay line has died (its link drops everything)."""
        for hi in self.host_impairments:
            hi.check()

    def dead_delay_line(self) -> str:
        """What :meth:`check_impairments` would raise, as a line; "" while all live."""
        try:
            self.check_impairments()
        except ImpairmentError as e:
            return str(e)
        return ""

    def impairment_record(self) -> dict[str, Any]:
        """Which mechanism gave delay and loss, and (after teardown) what each host's
        delay line did: for the run's meta.json."""
        return {"delay_mechanism": self.mechanisms["delay"] if self._any("delay_ms") else None,
                "loss_mechanism": self.mechanisms["loss"] if self._any("loss_pct") else None,
                "loss_seeded": self._seeded and self._any("loss_pct"),
                "loss_seed": self.spec.loss_seed,
                "hosts": self.impairment_records
                or [hi.record() for hi in self.host_impairments]}

    def _any(self, field: str) -> bool:
        return any(getattr(p.point.link, field) > 0 for p in self.spec.places())

    def _each_host(self, fn: Callable[[HostImpairment], object], reverse: bool = False
                   ) -> None:
        """``fn`` for each host's impairments: here one after another; on other servers
        all at once (each host's rules and delay line are a few ssh round trips of its
        own, and hosts do not depend on each other). The first error is raised once all
        have run."""
        his = self.host_impairments[::-1] if reverse else list(self.host_impairments)
        if self.cluster is None:
            for hi in his:
                fn(hi)
            return
        with ThreadPoolExecutor(max_workers=8) as pool:
            futures = [pool.submit(fn, hi) for hi in his]
        for f in futures:
            f.result()

    def _run_steps(self, steps: Sequence[Step]) -> None:
        if self.cluster is None:
            for host, dev, commands in group_steps(steps, {}):
                self._dev_tc(host, dev).run_all(commands)
            return
        # One ssh session per namespace, mostly waiting on its round trip; namespaces do
        # not depend on each other, so all of them at once. The first failure is raised.
        groups = group_steps(steps, self.cluster.where)
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(lambda g: self._dev_tc(g[0], g[1]).run_all(g[2]), groups))

    def _cleanup(self) -> list[str]:
        """``topo.cleanup`` here (when a node runs here) and on every remote server."""
        here = cleanup() if self.cluster is None or self.cluster.local_used else []
        return here + (self.cluster.cleanup() if self.cluster is not None else [])

    def _teardown(self) -> None:
        if self._checks is not None:  # a build refused early: its checks still ran
            _settled(self._checks)
        self.points.close()
        try:
            # While the namespaces exist: rules out, delay lines stopped, records kept.
            self._each_host(lambda hi: hi.__exit__(None, None, None), reverse=True)
            self.impairment_records = [hi.record() for hi in self.host_impairments]
            self.host_impairments.clear()
            if self.cluster is not None and "start" in self.cluster.clocks:
                self.cluster.record_clocks("end")
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
                    if self.cluster is not None:
                        for node in self.cluster.forget_lost_nodes(self._net):
                            self._say(f"teardown: {node} is gone with its server")
                    self._net.stop()
                finally:
                    self._net = None
        finally:
            try:
                self.removed_at_exit = self._cleanup()
                for line in self.removed_at_exit:
                    self._say(f"cleanup after stop: {line}")
                if self.cluster is not None:
                    self.cluster.close()
            finally:
                self._locks.release()

    # ----------------------------------------------------------------- shaping
    def set_offload(self, on: bool) -> None:
        """GSO/TSO/GRO on or off on every interface (both veth ends); with offload off a
        host's own interface keeps its spec's GSO segment limit.

        HTB burst sizes stay those of the spec's offload setting; the minimum burst only
        matters below ~50 Mbit/s, where GSO frames are rare.
        """
        self._run_steps([Step(host, dev, "offload", tuple(c))
                         for host, dev, segs in self.spec.interfaces()
                         for c in qdisc.offload_commands(dev, on, segs)])

    def _host_tc(self, host: str) -> Tc:
        return self._on_server(self.tc.in_netns(self.pid(host), host), host)

    def _dev_tc(self, host: str | None, dev: str = "") -> Tc:
        """Commands for ``dev``: in ``host``'s namespace, or the root namespace of the
        server that owns the interface (a switch port's switch; this machine's without
        ``dev``)."""
        if host is not None:
            return self._host_tc(host)
        return self._on_server(self.tc, dev.rsplit("-eth", 1)[0]) if dev else self.tc

    def _on_server(self, tc: Tc, node: str) -> Tc:
        if self.cluster is None:
            return tc
        via, server = self.cluster.via(node)
        return tc.on_server(via, server) if via else tc

    def point_dev(self, point: str) -> str:
        """Interface whose egress carries shaping point ``point``."""
        return self.spec.place(point).dev

    def bottleneck_dev(self, direction: Direction) -> str:
        """Interface whose egress qdisc is the bottleneck (point ``up`` or ``down``)."""
        return self.point_dev(self._direction(direction))

    def _direction(self, direction: str) -> str:
        if direction not in DIRECTIONS:
            raise SpecError(f"direction={direction!r}; allowed {list(DIRECTIONS)}")
        return direction

    # What the run does to its shaping points, and what it reads of them: topo.points.
    def set_point_rate(self, point: str, rate_mbps: float,
                       queue_bytes: int | None = None) -> None:
        """:meth:`topo.points.ShapedPoints.set_point_rate`: a rate changed in place."""
        self.points.set_point_rate(point, rate_mbps, queue_bytes)

    def set_bottleneck_rate(self, direction: Direction, rate_mbps: float,
                            queue_bytes: int | None = None) -> None:
        """:meth:`set_point_rate` on the bottleneck's ``up`` or ``down`` point."""
        self.set_point_rate(self._direction(direction), rate_mbps, queue_bytes)

    def set_worker_cap(self, worker: str, rate_mbps: float) -> None:
        """:meth:`topo.points.ShapedPoints.set_worker_cap`: link/N shaping's cap."""
        self.points.set_worker_cap(worker, rate_mbps)

    def rate_mbps(self, dev: str) -> float | None:
        """The HTB rate gradbed last set on ``dev`` (None when unshaped)."""
        return self.points.rate_mbps(dev)

    def point_stats(self, point: str) -> QdiscStats:
        """:meth:`topo.points.ShapedPoints.point_stats`: a point's queue counters."""
        return self.points.point_stats(point)

    def point_classes(self, point: str) -> dict[str, ClassCounters]:
        """:meth:`topo.points.ShapedPoints.point_classes`: a point's HTB class counters."""
        return self.points.point_classes(point)

    def bottleneck_stats(self, direction: Direction) -> QdiscStats:
        return self.point_stats(self._direction(direction))

    def qdisc_stats(self, host: str | None, dev: str) -> list[QdiscStats]:
        """Every qdisc on ``dev`` (in ``host``'s namespace, or the root one for None)."""
        return self.points.qdisc_stats(host, dev)

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
        def set_in(name: str) -> None:
            self._host_tc(name).run(["sysctl", "-w", f"net.ipv4.tcp_congestion_control={algo}"])

        if self.cluster is None:
            for name in self.spec.host_names():
                set_in(name)
            return
        # On other servers each is an ssh round trip, mostly waiting: all hosts at once.
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(set_in, self.spec.host_names()))

    # ----------------------------------------------------------------- hosts
    def _require_net(self) -> Any:
        if self._net is None:
            raise RuntimeError("Network is not running (use it as a context manager)")
        return self._net

    def host(self, name: str) -> Any:
        """The Mininet Host object (for interactive use; prefer popen for processes)."""
        self.spec.ip(name)  # raises SpecError naming an unknown host
        return self._require_net()[name]

    @property
    def mininet(self) -> Any:
        """The running ``mininet.net.Mininet`` (for ``mininet.cli.CLI``)."""
        return self._require_net()

    def ip(self, name: str) -> str:
        return self.spec.ip(name)

    def pid(self, name: str) -> int:
        return int(self.host(name).pid)

    def popen(self, name: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside host ``name``'s network namespace.

        The process shares the file system (Unix control sockets in the run directory
        work) and is terminated, then killed, when the network is torn down.
        """
        kw.setdefault("env", {**os.environ})
        tc = self._host_tc(name)
        proc = None
        if self._spawner is not None and not tc.via:  # a host of this machine
            proc = self._spawner(list(argv), self.pid(name), **kw)
        if proc is None:
            proc = subprocess.Popen(tc.full_argv(argv), **kw)  # on the server that runs it
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
        full = self._host_tc(name).full_argv(argv)  # on the server that runs it
        return subprocess.run(full, capture_output=True, text=True, timeout=timeout_s,
                              check=True)


def _in_background(fn: Callable[[], None]) -> Future[None]:
    """``fn()`` on a thread of its own; its result (or error) in the future."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gbchecks")
    try:
        return pool.submit(fn)
    finally:
        pool.shutdown(wait=False)


def _settled(future: Future[None]) -> None:
    """Wait for ``future`` and drop what it raised (the error in hand matters more)."""
    try:
        future.result()
    except Exception:  # noqa: BLE001 - already failing with another error
        pass


def _cluster(spec: NetSpec, access: SshAccess | None,
             log: Callable[[str], None] | None) -> Cluster | None:
    """The servers of a spec placed over several (None: every node here); without
    ``access`` a node placed elsewhere is refused (``topo.plan.require_local``)."""
    if access is None or servers_used(spec) == [LOCAL]:
        require_local(spec)
        return None
    from topo.cluster import Cluster

    return Cluster(spec, access, log)


def _local_mininet(spec: NetSpec) -> Any:
    """The spec's nodes and links in a plain ``Mininet`` on this machine (not built yet)."""
    from mininet.link import Link
    from mininet.net import Mininet
    from mininet.node import Host
    from mininet.nodelib import LinuxBridge

    net = Mininet(topo=None, controller=None, switch=LinuxBridge, host=Host, link=Link,
                  build=False, autoSetMacs=True)
    for sw in spec.switches:
        net.addSwitch(sw.name, cls=LinuxBridge, stp=False)
    for h in spec.hosts:
        net.addHost(h.name, ip=f"{h.ip}/24")
    for e in spec.edges:
        net.addLink(net[e.a], net[e.b], port1=e.a_port, port2=e.b_port,
                    intfName1=e.a_intf, intfName2=e.b_intf)
    return net


# The name this builder had while it built only stars; scripts and benchmarks use it.
StarNetwork = Network
