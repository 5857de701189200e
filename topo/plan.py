"""The commands that build a network spec, as data: what ``topo.build.Network`` runs and
what ``gradbed run --dry-run`` prints, from these functions (:func:`build_plan`,
:func:`impairments`).

Pure (no root, nothing touched). Each :class:`Step` names the namespace it runs in (a
host, or the root namespace for a switch port), the interface, and what it is for: the
interface's offload settings, or the shaping point it installs (``topo.qdisc``'s
HTB -> [netem ->] bfifo chain on the egress of the point's interface).

Delay and loss go into netem on the point's own egress where the kernel has netem
(loss only while ``NetSpec.loss_seed`` is None: a seeded loss always goes to the delay line,
netem or not, since neither netem nor the statistic match draws from a seed here).
Elsewhere (``topo.netfilter``) they are applied where the packets arrive: for every
receiving host H and source S, :func:`impairments` sums the delays of the shaping points
on the path S -> H (a host's uplink, a trunk, the receiver's downlink...) and combines
their losses, and one ``HostImpairment`` per host installs the rules and runs its delay
line. The HTB and the queue stay on the egress either way; for a constant delay the order
of a FIFO rate limit and a delay line does not change what a single path sees.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from topo import qdisc
from topo.netfilter import Impairment, delay_queues, loss_args, mechanisms, rule_commands
from topo.placement import describe_placement, server_of
from topo.spec import LinkSpec, NetSpec, PointPlace, ShapingPoint, SpecError


@dataclass(frozen=True)
class Step:
    """One command of the build: ``argv`` in ``host``'s namespace (None = the root one)."""

    host: str | None
    dev: str
    what: str  # "offload", or the name of the shaping point being installed
    argv: tuple[str, ...]

    def where(self) -> str:
        return self.dev if self.host is None else f"{self.dev} (in {self.host})"


def delay_loss(place: PointPlace, caps: Mapping[str, Any], seeded: bool = False) -> LinkSpec:
    """The link one shaping point's qdisc chain installs: with its delay and loss (netem,
    added by ``qdisc.shaping_commands``) where the kernel has netem; without them
    elsewhere, where :func:`impairments` applies them with netfilter at the receivers.
    ``seeded``: the loss is the delay line's seeded draw, never netem's.
    ``require_impairments`` has refused a kernel with neither."""
    link = place.point.link
    if not caps.get("netem"):
        return replace(link, delay_ms=0.0, loss_pct=0.0)
    return replace(link, loss_pct=0.0) if seeded else link


def require_impairments(spec: NetSpec, caps: Mapping[str, Any]) -> dict[str, str | None]:
    """The delay and loss mechanisms a build of ``spec`` uses (``topo.netfilter
    .mechanisms``); raises CapabilityError naming the shaping point's field when it asks
    for one this kernel lacks."""
    seeded = spec.loss_seed is not None
    mech = mechanisms(caps, seeded_loss=seeded)
    for place in spec.places():
        p = place.point
        who = p.origin or f"point {p.name}"
        for field, value, kind, need in (("delay_ms", p.link.delay_ms, "delay",
                                          "netem or NFQUEUE (iptables)"),
                                         ("loss_pct", p.link.loss_pct, "loss",
                                          "NFQUEUE (iptables) for a seeded loss" if seeded
                                          else "netem or the statistic match (iptables)")):
            if value > 0 and mech[kind] is None:
                said = "; ".join(f"{k}: {v}" for k, v in sorted(caps.items())
                                 if k.endswith("_error"))
                raise qdisc.CapabilityError(
                    f"{who}.{field}={value:g} needs {need} (shaping point {p.name} on "
                    f"{place.dev}), and this kernel has neither (gradbed probe shows what "
                    "it has)" + (f"; the probe said: {said}" if said else ""))
    return mech


def paths(spec: NetSpec, src: str) -> dict[str, tuple[list[ShapingPoint], str]]:
    """For every node reachable from host ``src``: the shaping points a packet crosses on
    the way (in order) and the interface it arrives on. Breadth first, so on a tree (every
    shape here) the one path."""
    adj: dict[str, list[tuple[str, ShapingPoint, str]]] = {}
    for e in spec.edges:
        adj.setdefault(e.a, []).append((e.b, e.a_to_b, e.b_intf))
        adj.setdefault(e.b, []).append((e.a, e.b_to_a, e.a_intf))
    found: dict[str, tuple[list[ShapingPoint], str]] = {src: ([], "")}
    todo = deque([src])
    while todo:
        node = todo.popleft()
        for nxt, point, intf in adj.get(node, []):
            if nxt not in found:
                found[nxt] = ([*found[node][0], point], intf)
                todo.append(nxt)
    return found


def impairments(spec: NetSpec, netem: bool = False) -> dict[str, list[Impairment]]:
    """Per receiving host, the netfilter impairments that give every path of ``spec`` its
    delay and loss: H delays what S sends by the sum of ``delay_ms`` over the points on
    S -> H (:func:`paths`) and drops it with ``1 - prod(1 - loss_pct / 100)``. Sources
    with the same figures share one rule group; a group of every other host matches any
    source. ``netem``: the kernel has netem, which does the delay (and an unseeded loss),
    so only a seeded loss (``spec.loss_seed``) is left here."""
    hosts = spec.host_names()
    from_src = {s: paths(spec, s) for s in hosts}
    out: dict[str, list[Impairment]] = {}
    for h in hosts:
        groups: dict[tuple[float, float, str], list[str]] = {}
        for src in hosts:
            if src == h or h not in from_src[src]:
                continue
            points, dev = from_src[src][h]
            delay_ms = 0.0 if netem else sum(p.link.delay_ms for p in points)
            keep = 1.0
            for p in points:
                keep *= 1 - p.link.loss_pct / 100
            loss_pct = round(100 * (1 - keep), 9)
            if netem and spec.loss_seed is None:
                loss_pct = 0.0
            if delay_ms > 0 or loss_pct > 0:
                groups.setdefault((delay_ms, loss_pct, dev), []).append(spec.ip(src))
        imps = [Impairment(dev=dev, delay_ms=d, loss_pct=lp,
                           sources=() if len(ips) == len(hosts) - 1 else tuple(ips),
                           loss_seed=spec.loss_seed if lp > 0 else None)
                for (d, lp, dev), ips in groups.items()]
        if imps:
            out[h] = imps
    return out


def describe_impairments(spec: NetSpec, caps: Mapping[str, Any]) -> list[str]:
    """The delay and loss part of the dry run: the mechanisms, and without netem each
    host's delay line and iptables rules (what ``topo.build.Network`` installs)."""
    mech = require_impairments(spec, caps)
    out = [f"# delay by {mech['delay']}, loss by {mech['loss']}"
           + (f" (seed {spec.loss_seed})" if spec.loss_seed is not None else "")]
    for host, imps in impairments(spec, netem=bool(caps.get("netem"))).items():
        out.append(f"# delay and loss arriving at {host}")
        queues = delay_queues(imps)
        if queues:
            out.append("$ python -m topo.delayline "
                       + " ".join(f"--queue {q}:{d!r}" for q, d in queues)
                       + "".join(f" {a}" for a in loss_args(imps)) + f"   # in {host}")
        for argv in rule_commands(imps):
            out.append("$ " + " ".join(argv) + f"   # in {host}")
    return out


def point_steps(place: PointPlace, caps: Mapping[str, Any], offload: bool,
                seeded: bool = False) -> list[Step]:
    """The steps that install one shaping point (empty for an unshaped one)."""
    cmds = qdisc.shaping_commands(place.dev, delay_loss(place, caps, seeded), caps,
                                  offload=offload,
                                  ack_first=place.point.ack_first)
    return [Step(place.host, place.dev, place.point.name, tuple(c)) for c in cmds]


def require_local(spec: NetSpec, why: str = "") -> None:
    """Refuse a spec that places a host or switch on another machine, naming the first.

    ``topo.placement`` fills each node's ``placement`` from the ``[cluster]`` section, and
    the dry run prints it; a builder without the servers' ssh access (``topo.build
    .Network`` without ``access``), or ``why`` a caller gives, cannot go there."""
    placed = [(h.name, h.placement) for h in spec.hosts]
    placed += [(s.name, s.placement) for s in spec.switches]
    for name, placement in placed:
        if placement:
            raise SpecError(f"{name}.placement={placement!r}: " + (why or (
                "building on other servers (Mininet Cluster Edition) needs their ssh "
                "access: Network(spec, access=SshAccess(...)), docs/cluster.md"))
                + "; leave cluster.servers = [\"localhost\"] to run here")


def build_plan(spec: NetSpec, caps: Mapping[str, Any]) -> list[Step]:
    """Every command that shapes ``spec``'s network once Mininet made its namespaces,
    veths and bridges: offload settings on every interface, then every shaping point.
    Raises ``CapabilityError`` when the kernel cannot do it, before anything is built.
    A node placed on another server keeps its steps; ``describe_plan`` names the server
    each runs on."""
    require_impairments(spec, caps)
    seeded = spec.loss_seed is not None
    shaping = [s for place in spec.places()
               for s in point_steps(place, caps, spec.offload, seeded)]
    offload = [Step(host, dev, "offload", tuple(c))
               for host, dev, segs in spec.interfaces()
               for c in qdisc.offload_commands(dev, spec.offload, segs)]
    return offload + shaping


def group_steps(steps: Sequence[Step], where: Mapping[str, str]
                ) -> list[tuple[str | None, str, list[list[str]]]]:
    """The steps as (host, an interface, commands) per namespace, each namespace's steps in
    their order: a host's own, or a server's root namespace (``where``: node -> server,
    empty on one machine). Interfaces do not depend on each other, so each namespace's
    commands can go to its server as one session (``topo.tc.Tc.run_all``)."""
    out: dict[tuple[str | None, str], tuple[str, list[list[str]]]] = {}
    for step in steps:
        node = step.host or step.dev.rsplit("-eth", 1)[0]
        out.setdefault((step.host, where.get(node, "")), (step.dev, []))[1].append(
            list(step.argv))
    return [(host, dev, commands) for (host, _), (dev, commands) in out.items()]


def describe_plan(spec: NetSpec, steps: list[Step]) -> list[str]:
    """The plan as the dry run prints it: a comment line per interface and point, then
    ``$ argv`` lines; with nodes on several servers, first the placement
    (``topo.placement.describe_placement``) and each interface's server."""
    out = [f"# {spec.shape}: {len(spec.hosts)} hosts ("
           + ", ".join(f"{h.name}={h.role or '-'}" for h in spec.hosts) + "), switches "
           + ", ".join(s.name for s in spec.switches)]
    placed = describe_placement(spec)
    out += placed
    last = None
    for s in steps:
        head = (s.where(), s.what)
        if head != last:
            on = f" on {server_of(spec, s.dev.rsplit('-eth', 1)[0])}" if placed else ""
            out.append(f"# {s.where()}{on}: "
                       f"{s.what if s.what == 'offload' else 'point ' + s.what}")
            last = head
        out.append("$ " + " ".join(s.argv))
    return out
