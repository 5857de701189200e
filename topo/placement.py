"""Which server runs each host and switch of a network spec, as data: Mininet Cluster
Edition's placers (``mininet/examples/cluster.py``: ``SwitchBinPlacer``,
``RoundRobinPlacer``, ``RandomPlacer``) run over the spec's node names and links, with a
config's pins laid over them.

Pure: the placers (``topo.placers``, imported only for more than one server) only read
names, nothing is built and no server is contacted. The result is the spec itself with
``HostSpec.placement`` and ``SwitchSpec.placement`` filled in, so the dry run
(``topo.plan.describe_placement``) and the builder read the same data. A placement of ""
means this machine: a one-server cluster on ``localhost`` (the default) returns the spec
unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from topo.spec import EdgeSpec, NetSpec, SpecError

LOCAL = "localhost"


@dataclass(frozen=True)
class Crossing:
    """A link whose two ends run on different servers: a tunnel joins them there."""

    edge: EdgeSpec
    a_server: str
    b_server: str

    def describe(self) -> str:
        e = self.edge
        return (f"{e.a_intf} on {self.a_server} <-> {e.b_intf} on {self.b_server} "
                f"(points {e.a_to_b.name}, {e.b_to_a.name})")


def expand_pins(spec: NetSpec, pins: Mapping[str, str]) -> dict[str, str]:
    """Node name -> server for every pin: a node's own name pins it, a role name every host
    of that role; a node's own pin wins over its role's. An unknown key is an error naming
    the nodes and roles this spec has."""
    nodes = [*spec.host_names(), *(s.name for s in spec.switches)]
    roles = sorted({h.role for h in spec.hosts if h.role})
    out: dict[str, str] = {}
    for key, server in pins.items():
        if key not in nodes and key not in roles:
            raise SpecError(f"cluster.pins.{key}: the {spec.shape} has no node or role "
                            f"{key!r}; nodes {nodes}, roles {roles}")
        if key not in nodes:
            out.update({h.name: server for h in spec.hosts
                        if h.role == key and h.name not in pins})
    out.update({k: v for k, v in pins.items() if k in nodes})
    return out


def place(spec: NetSpec, servers: Sequence[str], placement: str = "switchbin",
          pins: Mapping[str, str] | None = None, seed: int = 0) -> NetSpec:
    """``spec`` with every host and switch placed on one of ``servers`` by ``placement``
    (``switchbin``, ``roundrobin`` or ``random``; see ``agents.core.cluster_config``),
    ``pins`` (node or role -> server) first. Nodes are offered to the placer switches
    first, then hosts, each in spec order. A node on ``localhost`` keeps placement "".
    One server that is ``localhost``: the spec unchanged."""
    servers = list(servers)
    if not servers:
        raise SpecError("cluster.servers is empty; allowed 1 or more servers")
    pinned = expand_pins(spec, pins or {})
    for node, server in pinned.items():
        if server not in servers:
            raise SpecError(f"cluster.pins: {node} -> {server!r} is not one of "
                            f"cluster.servers {servers}")
    if servers == [LOCAL]:
        return spec
    # Mininet is imported only for a spec that leaves this machine.
    from topo.placers import PinnedSwitchBinPlacer, RoundRobinPlacer, SeededRandomPlacer

    hosts = list(spec.host_names())
    switches = [s.name for s in spec.switches]
    links = [(e.a, e.b) for e in spec.edges]
    where: dict[str, str]
    if placement == "switchbin":
        placer = PinnedSwitchBinPlacer(servers=servers, nodes=switches + hosts, hosts=hosts,
                                       switches=switches, links=links, pins=pinned)
        where = {n: str(placer.place(n)) for n in switches + hosts}
    elif placement in ("roundrobin", "random"):
        kw: dict[str, Any] = dict(servers=servers, nodes=switches + hosts, hosts=hosts,
                                  switches=switches, links=links)
        rr = (RoundRobinPlacer(**kw) if placement == "roundrobin"
              else SeededRandomPlacer(**kw, seed=seed))
        where = {n: pinned[n] if n in pinned else str(rr.place(n)) for n in switches + hosts}
    else:
        raise SpecError(f"cluster.placement = {placement!r}; allowed switchbin, roundrobin, "
                        "random")

    def at(node: str) -> str:
        return "" if where[node] == LOCAL else where[node]

    return replace(spec,
                   hosts=tuple(replace(h, placement=at(h.name)) for h in spec.hosts),
                   switches=tuple(replace(s, placement=at(s.name)) for s in spec.switches))


def node_servers(spec: NetSpec) -> dict[str, str]:
    """Node name -> the server that runs it (``localhost`` for this machine), switches
    first, then hosts, in spec order."""
    out = {s.name: s.placement or LOCAL for s in spec.switches}
    out.update({h.name: h.placement or LOCAL for h in spec.hosts})
    return out


def server_of(spec: NetSpec, node: str) -> str:
    """The server that runs ``node`` (``localhost`` for this machine)."""
    where = node_servers(spec)
    if node not in where:
        raise SpecError(f"node {node!r} is not in the {spec.shape}")
    return where[node]


def servers_used(spec: NetSpec) -> list[str]:
    """Every server some node of ``spec`` runs on, in order of first use."""
    return list(dict.fromkeys(node_servers(spec).values()))


def crossings(spec: NetSpec) -> list[Crossing]:
    """The links of ``spec`` whose ends run on different servers, in edge order."""
    where = node_servers(spec)
    return [Crossing(e, where[e.a], where[e.b]) for e in spec.edges
            if where[e.a] != where[e.b]]


def describe_placement(spec: NetSpec) -> list[str]:
    """The placement part of the dry run: every node's server, then every link that
    crosses servers. Empty for a spec on this machine alone."""
    if servers_used(spec) == [LOCAL]:
        return []
    out = ["# placement over servers " + ", ".join(servers_used(spec))]
    out += [f"#   {node} on {server}" for node, server in node_servers(spec).items()]
    cross = crossings(spec)
    out.append(f"# {len(cross)} link(s) cross servers" + (":" if cross else ""))
    out += [f"#   {c.describe()}" for c in cross]
    return out
