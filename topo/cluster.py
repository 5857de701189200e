"""A network spread over several servers, built with Mininet Cluster Edition
(``mininet/examples/cluster.py``), for ``topo.build.Network``.

Upstream's classes are subclassed, not copied:

- :class:`ClusterHost` and :class:`ClusterBridge` are its ``RemoteHost`` and a remote
  ``LinuxBridge`` (upstream has only Open vSwitch, which this kernel lacks): its
  ``RemoteMixin`` runs their shells over ``ssh -tt``; here with the run's own key and ssh
  options and without ``sudo`` (the servers are entered as root, no sudo binary needed).
- :class:`VxlanLink` is its ``RemoteGRELink`` with a VXLAN tunnel (this kernel has VXLAN
  and no GRE) for a link whose ends are on different servers, and a veth pair otherwise;
  upstream's GRE link already gives every link the tunnel's MTU (:data:`LINK_MTU`), so
  TCP never sends a frame the tunnel would fragment and every link of the run has the
  same MTU.
- ``MininetCluster`` holds the servers; the placement is the spec's own
  (``topo.placement``), so the build places nodes exactly as the dry run printed.

Every shaping command runs on the server that owns its interface (``Tc.on_server``).
Teardown is scoped to the run: ``net.stop()``, then ``topo.cleanup`` on each server over
ssh (gradbed's names only), never upstream's ``mn -c`` on every server.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from mininet.examples.cluster import MininetCluster, Placer, RemoteGRELink, RemoteHost, RemoteMixin
from mininet.nodelib import LinuxBridge

from agents.core.cluster_config import ClusterConfig
from topo import clocks
from topo.cleanup import SSH_DIR_PREFIX
from topo.placement import LOCAL, crossings, node_servers, servers_used
from topo.server_lock import Lock, LockSet, ServerLock, lock_order
from topo.spec import NetSpec, SpecError

T = TypeVar("T")

# VXLAN over IPv4 adds 50 bytes (outer Ethernet 14, IPv4 20, UDP 8, VXLAN 8) to a frame of
# the tunnel's MTU; with a 1500-byte underlay that leaves 1450, upstream's GRE figure too.
LINK_MTU = 1450
VXLAN_PORT = 4789
# VXLAN ids of a run's tunnels; distinct per link of a run (a server may end several).
VNI_BASE = 4200
SSH_TIMEOUT_S = 60.0
# Where gradbed lives: the same path on every server (docs/cluster.md).
REPO = Path(__file__).resolve().parents[1]


def on_each(servers: Sequence[str], fn: Callable[[str], T]) -> dict[str, T]:
    """``fn(server)`` for every server at once (each mostly waits on its own ssh round
    trips, so a run's start and end cost one server's time, not their sum); the results
    in the servers' order. The first failure is raised once all have finished."""
    if len(servers) < 2:
        return {s: fn(s) for s in servers}
    with ThreadPoolExecutor(max_workers=len(servers)) as pool:
        futures = {s: pool.submit(fn, s) for s in servers}
        return {s: f.result() for s, f in futures.items()}


@dataclass(frozen=True)
class SshAccess:
    """How the controller reaches the servers: ``ssh [-F ssh_config] [-i key_path]
    user@server``. The user must be root there (namespaces, links, qdiscs)."""

    user: str = "root"
    key_path: str = ""
    ssh_config: str = ""
    # A folder for ssh's shared connections (ControlMaster): one TCP and key exchange per
    # server for the whole run instead of one per command (about a second each on a
    # loaded machine: a star's build took 165 s without). "" = a new connection each time.
    control_dir: str = ""

    @classmethod
    def from_config(cls, c: ClusterConfig) -> SshAccess:
        """The ``[cluster]`` section's user, key and ssh_config."""
        return cls(user=c.user, key_path=c.key_path, ssh_config=c.ssh_config)

    def argv(self, server_ip: str, tty: bool = False) -> list[str]:
        """The ssh command that runs one command line on ``server_ip``; ``tty``: with
        ``-tt``, as upstream runs a node's shell (its prompt needs a terminal)."""
        out = ["ssh", "-q", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10",
               "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3"]
        if self.ssh_config:
            out += ["-F", self.ssh_config]
        if self.key_path:
            out += ["-i", self.key_path, "-o", "IdentitiesOnly=yes"]
        if self.control_dir:
            out += ["-o", "ControlMaster=auto", "-o", f"ControlPath={self.control_dir}/%C",
                    "-o", "ControlPersist=60"]
        return [*out, *(["-tt"] if tty else []), f"{self.user}@{server_ip}"]


# What every server must run alike; read from package metadata (no import of torch).
VERSIONED = ("gradbed", "mininet", "torch")
VERSION_PROBE = ("import json, importlib.metadata as m\n"
                 "def v(n):\n"
                 "    try:\n"
                 "        return m.version(n)\n"
                 "    except m.PackageNotFoundError:\n"
                 "        return None\n"
                 f"print(json.dumps({{n: v(n) for n in {VERSIONED!r}}}))")


def local_versions() -> dict[str, str | None]:
    """This machine's versions of :data:`VERSIONED` (what ``VERSION_PROBE`` prints)."""
    out: dict[str, str | None] = {}
    for name in VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def version_mismatches(server: str, here: Mapping[str, str | None],
                       there: Mapping[str, str | None]) -> list[str]:
    """One line per package of :data:`VERSIONED` whose version on ``server`` differs from
    this machine's, naming both."""
    return [f"cluster server {server}: {name} {there.get(name) or 'missing'} there, "
            f"{here.get(name) or 'missing'} here" for name in VERSIONED
            if there.get(name) != here.get(name)]


class _Remote(RemoteMixin):  # type: ignore[misc]
    """Upstream's remote node with the run's ssh command and no ``sudo``."""

    def __init__(self, name: str, *, access: SshAccess, **kwargs: Any) -> None:
        self.access = access
        super().__init__(name, user=access.user, **kwargs)

    def startShell(self, *args: Any, **kwargs: Any) -> None:  # noqa: N802  (Mininet's name)
        if self.isRemote:
            self.sshcmd = self.access.argv(self.serverIP, tty=True)
        super().startShell(*args, **kwargs)

    def _popen(self, cmd: Any, sudo: bool = True, tt: bool = True, **params: Any) -> Any:
        # Upstream wraps a remote command in "sudo -E", and a local one, when not asked
        # for sudo, in "sudo -u USER"; as root neither is needed.
        return super()._popen(cmd, sudo=not self.isRemote, tt=tt, **params)


class ClusterHost(_Remote, RemoteHost):  # type: ignore[misc]
    """An emulated host on any server."""


class ClusterBridge(_Remote, LinuxBridge):  # type: ignore[misc]
    """A Linux bridge (no controller, no STP) in any server's root namespace."""


class VxlanLink(RemoteGRELink):  # type: ignore[misc]
    """Upstream's GRE link with a VXLAN tunnel between servers: both ends get ``LINK_MTU``
    (upstream's same-server branch sets it on veths too)."""

    _vni = itertools.count(VNI_BASE)
    # server -> the address its peers reach it at (set by Cluster before links are made)
    underlay: Mapping[str, str] = {}

    def makeTunnel(self, node1: Any, node2: Any, intfname1: str, intfname2: str,  # noqa: N802
                   addr1: str | None = None, addr2: str | None = None) -> None:
        vni = next(self._vni)
        for node, peer, intf, addr in ((node1, node2, intfname1, addr1),
                                       (node2, node1, intfname2, addr2)):
            local, remote = self.underlay[node.server], self.underlay[peer.server]
            # One session per end (each ssh round trip costs), stopping at a failure;
            # then into the node's namespace (a switch's is its server's own).
            script = "\n".join([
                f"ip link delete {intf} 2>/dev/null",
                f"ip link add name {intf} type vxlan id {vni} local {local} remote {remote} "
                f"dstport {VXLAN_PORT} || exit 1",
                *([f"ip link set {intf} address {addr} || exit 1"] if addr else []),
                f"ip link set dev {intf} mtu {LINK_MTU} up || exit 1",
                f"ip link set {intf} netns {node.pid} || exit 1",
                "echo ok"])
            # A remote command line is parsed again by the server's shell; a local one
            # goes to sh as it is.
            out = node.rcmd(["sh", "-c", shlex.quote(script) if node.isRemote else script])
            if out.strip() != "ok":
                raise SpecError(f"VXLAN end {intf} on {node.server} ({node}) failed: "
                                f"{out.strip()}")


def server_ip(server: str) -> str:
    """``server``'s IPv4 address as Mininet Cluster Edition finds it ("" when none)."""
    return str(RemoteMixin.findServerIP(server) or "")


class Cluster:
    """The servers of one run: their addresses, the ssh that reaches them, the
    ``MininetCluster`` that builds the spec on them, and the run-scoped cleanup."""

    def __init__(self, spec: NetSpec, access: SshAccess,
                 log: Callable[[str], None] | None = None) -> None:
        self.spec = spec
        self.access = access
        self.log = log
        self.where = node_servers(spec)
        self.servers = servers_used(spec)
        self.remote = [s for s in self.servers if s != LOCAL]
        self.ips = {s: server_ip(s) for s in self.servers}
        # "start"/"end" -> server -> its CLOCK_MONOTONIC offset (topo.clocks), for meta.json
        self.clocks: dict[str, dict[str, dict[str, float | int | str]]] = {}
        for s, ip in self.ips.items():
            if not ip:
                raise SpecError(f"cluster.servers: {s!r} has no IPv4 address here "
                                "(getent ahostsv4)")

    @property
    def local_used(self) -> bool:
        return LOCAL in self.servers

    def via(self, node: str) -> tuple[tuple[str, ...], str]:
        """(the ssh prefix, the server) that runs a command where ``node`` lives;
        ((), "localhost") on this machine."""
        server = self.where[node]
        return ((), LOCAL) if server == LOCAL else (tuple(self.access.argv(self.ips[server])),
                                                    server)

    def require_here(self, node: str, dev: str) -> None:
        """Refuse what only works from this machine (rtnetlink: class counters) on an
        interface of another server, naming it."""
        if self.where[node] != LOCAL:
            raise SpecError(f"{dev} on {self.where[node]}: class counters over netlink "
                            "on another server are not supported yet (topo.class_sample_ms "
                            "= 0, or keep the sampled links on this machine)")

    def ssh(self, server: str, command: str, timeout_s: float = SSH_TIMEOUT_S
            ) -> subprocess.CompletedProcess[str]:
        argv = self.access.argv(self.ips[server])
        if self.log is not None:
            self.log(f"$ {shlex.join(argv)} {shlex.quote(command)}")
        return subprocess.run([*argv, command], capture_output=True, text=True,
                              timeout=timeout_s, check=False)

    def precheck(self) -> None:
        """Before anything is built: every remote server answers ssh as root and runs the
        same gradbed, Mininet and torch as this machine (else one error naming each
        difference); the answer opens the connection the run's commands share
        (``SshAccess.control_dir``)."""
        if not self.access.control_dir:
            # Named by this process: gradbed cleanup removes it once this process is gone.
            self.access = replace(self.access, control_dir=tempfile.mkdtemp(
                prefix=f"{SSH_DIR_PREFIX}{os.getpid()}-"))
        here, wrong = local_versions(), []
        probe = (f"id -u && cd {shlex.quote(str(REPO))} && "
                 f"{shlex.quote(sys.executable)} -c {shlex.quote(VERSION_PROBE)}")
        for s, p in self._on_each(lambda s: self.ssh(s, probe)).items():
            lines = p.stdout.splitlines()
            if p.returncode != 0 or not lines or lines[0].strip() != "0":
                raise SpecError(f"cluster server {s}: ssh {self.access.user}@{self.ips[s]} "
                                f"failed (exit {p.returncode}): "
                                f"{(p.stderr or p.stdout).strip() or 'not root there'}")
            wrong += version_mismatches(s, here, json.loads(lines[-1]))
        if wrong:
            raise SpecError("\n".join([*wrong, "every server needs the same gradbed, "
                                       "Mininet and torch (docs/cluster.md)"]))

    def check(self) -> None:
        """:meth:`precheck`, then the start's clock offsets: what a run learns of its
        servers before it builds on them, touching nothing there."""
        self.precheck()
        self.record_clocks("start")

    def record_clocks(self, when: str) -> None:
        """Measure every remote server's clock offset now (min-RTT ping-pong over its
        ssh session) into ``clocks[when]``."""
        self.clocks[when] = {}

        def measure(s: str) -> clocks.ClockOffset | Exception:
            try:
                return clocks.measure(self.access.argv(self.ips[s]))
            except (OSError, subprocess.TimeoutExpired) as e:
                return e

        for s, off in self._on_each(measure).items():
            if isinstance(off, Exception):
                # At the end a server may be gone: recorded, and teardown goes on.
                if when == "start":
                    raise off
                self.clocks[when][s] = {"error": str(off)}
                continue
            self.clocks[when][s] = off.describe()
            if self.log is not None:
                self.log(f"clock of {s}: {off.offset_ns / 1e9:+.6f} s "
                         f"(+- {off.error_ns / 1e6:.3f} ms, {when})")

    def _on_each(self, fn: Callable[[str], T]) -> dict[str, T]:
        return on_each(self.remote, fn)

    def _underlay(self) -> dict[str, str]:
        """server -> the address peers reach it at (this machine: its route's source)."""
        out = {s: self.ips[s] for s in self.remote}
        if self.local_used and self.remote:
            out[LOCAL] = self._local_address()
        return out

    def _local_address(self) -> str:
        """This machine's address towards the servers (its route's source)."""
        route = subprocess.run(["ip", "route", "get", self.ips[self.remote[0]]],
                               capture_output=True, text=True, check=True).stdout
        return route.split(" src ")[1].split()[0]

    def lock_set(self, here: Lock, timeout_s: float) -> LockSet:
        """This machine's network lock ``here`` (held even when no node runs here: its
        cleanup would take what another run started) and every remote server's, in
        :func:`topo.server_lock.lock_order` of their addresses, this machine's at its
        address towards the servers."""
        addresses = {s: self.ips[s] for s in self.remote}
        addresses[LOCAL] = self._local_address() if self.remote else "127.0.0.1"
        own = replace(self.access, control_dir="")  # outlives the shared connections
        locks: dict[str, Lock] = {s: ServerLock(s, own.argv(self.ips[s]), timeout_s,
                                                log=self.log) for s in self.remote}
        locks[LOCAL] = here
        return LockSet([locks[s] for s in lock_order(addresses)])

    def mininet(self) -> Any:
        """The spec's nodes and links in a ``MininetCluster`` (not built yet)."""
        VxlanLink.underlay = self._underlay()
        net = MininetCluster(topo=None, controller=None, switch=ClusterBridge,
                             host=ClusterHost, link=VxlanLink, build=False,
                             autoSetMacs=True, servers=self.servers, user=self.access.user,
                             serverIP=self.ips, precheck=False, placement=Placer)
        for sw in self.spec.switches:
            net.addSwitch(sw.name, cls=ClusterBridge, stp=False, **self._node(sw.name))
        for h in self.spec.hosts:
            net.addHost(h.name, ip=f"{h.ip}/24", **self._node(h.name))
        for e in self.spec.edges:
            net.addLink(net[e.a], net[e.b], port1=e.a_port, port2=e.b_port,
                        intfName1=e.a_intf, intfName2=e.b_intf)
        return net

    def _node(self, name: str) -> dict[str, Any]:
        server = self.where[name]
        return {"server": server, "serverIP": self.ips[server], "access": self.access}

    def forget_lost_nodes(self, net: Any) -> list[str]:
        """Take out of ``net`` every node whose shell has ended (its server was lost), and
        every link with an end on one: Mininet's ``stop()`` would wait forever for an
        answer from such a shell. What they leave on the servers that remain (a tunnel end
        on a bridge) has gradbed's names, and the run-scoped cleanup removes it. Returns
        the nodes taken out."""
        nodes = [*net.hosts, *net.switches]
        lost = {n for n in nodes if n.shell is None or n.shell.poll() is not None}
        if lost:
            net.links = [ln for ln in net.links
                         if ln.intf1.node not in lost and ln.intf2.node not in lost]
            net.hosts = [h for h in net.hosts if h not in lost]
            net.switches = [sw for sw in net.switches if sw not in lost]
        return sorted(f"{n.name} on {self.where.get(n.name, '?')}" for n in lost)

    def built_placement(self, net: Any) -> dict[str, str]:
        """Node -> the server Mininet built it on (to compare with the dry run's)."""
        return {n: str(net[n].server) for n in self.where}

    def crossing_count(self) -> int:
        return len(crossings(self.spec))

    def cleanup(self) -> list[str]:
        """``topo.cleanup`` on every remote server over ssh: what this run's names left
        there, nothing else. One line per removed thing, prefixed with its server."""
        code = ("from topo.cleanup import cleanup; from topo.remote_delayline import "
                "remove_folders; print('\\n'.join(cleanup() + remove_folders()))")
        out = []
        command = f"cd {shlex.quote(str(REPO))} && {shlex.quote(sys.executable)} -c " \
                  f"{shlex.quote(code)}"
        for s, p in self._on_each(lambda s: self.ssh(s, command)).items():
            if p.returncode != 0:
                out.append(f"{s}: cleanup failed (exit {p.returncode}): {p.stderr.strip()}")
            out += [f"{s}: {line}" for line in p.stdout.splitlines() if line.strip()]
        return out

    def close(self) -> None:
        """End the shared ssh connections and remove their folder."""
        if not self.access.control_dir:
            return
        for s in self.remote:
            subprocess.run([*self.access.argv(self.ips[s])[:-1], "-O", "exit",
                            f"{self.access.user}@{self.ips[s]}"],
                           capture_output=True, timeout=SSH_TIMEOUT_S, check=False)
        shutil.rmtree(self.access.control_dir, ignore_errors=True)
