"""The commands that build a network spec, as data: what ``topo.build.Network`` runs and
what ``gradbed run --dry-run`` prints, from this one function (:func:`build_plan`).

Pure (no root, nothing touched). Each :class:`Step` names the namespace it runs in (a
host, or the root namespace for a switch port), the interface, and what it is for: the
interface's offload settings, or the shaping point it installs (``topo.qdisc``'s
HTB -> [netem ->] bfifo chain on the egress of the point's interface).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from topo import qdisc
from topo.spec import LinkSpec, NetSpec, PointPlace


@dataclass(frozen=True)
class Step:
    """One command of the build: ``argv`` in ``host``'s namespace (None = the root one)."""

    host: str | None
    dev: str
    what: str  # "offload", or the name of the shaping point being installed
    argv: tuple[str, ...]

    def where(self) -> str:
        return self.dev if self.host is None else f"{self.dev} (in {self.host})"


def delay_loss(place: PointPlace, caps: Mapping[str, Any]) -> tuple[LinkSpec, list[Step]]:
    """How one shaping point's delay and loss are applied: the link its qdisc chain
    installs, plus any steps of their own.

    Today delay and loss ride in the point's own qdisc chain as netem (added by
    ``qdisc.shaping_commands``) where the kernel has netem, and a kernel without it is
    refused with ``CapabilityError`` naming the point, never silently ignored. A
    netfilter delay line (NFQUEUE and the statistic match) takes over here where netem is
    missing: it returns the link without delay and loss, and its own steps.
    """
    link = place.point.link
    qdisc.require_netem(link, caps, f"{place.point.label} on {place.dev}")
    return link, []


def point_steps(place: PointPlace, caps: Mapping[str, Any], offload: bool) -> list[Step]:
    """The steps that install one shaping point (empty for an unshaped one)."""
    link, steps = delay_loss(place, caps)
    cmds = qdisc.shaping_commands(place.dev, link, caps, offload=offload,
                                  ack_first=place.point.ack_first)
    return [*steps, *(Step(place.host, place.dev, place.point.name, tuple(c)) for c in cmds)]


def build_plan(spec: NetSpec, caps: Mapping[str, Any]) -> list[Step]:
    """Every command that shapes ``spec``'s network once Mininet made its namespaces,
    veths and bridges: offload settings on every interface, then every shaping point.
    Raises ``CapabilityError`` before anything is built when the kernel cannot do it."""
    shaping = [s for place in spec.places() for s in point_steps(place, caps, spec.offload)]
    offload = [Step(host, dev, "offload", tuple(c))
               for host, dev, segs in spec.interfaces()
               for c in qdisc.offload_commands(dev, spec.offload, segs)]
    return offload + shaping


def describe_plan(spec: NetSpec, steps: list[Step]) -> list[str]:
    """The plan as the dry run prints it: a comment line per interface and point, then
    ``$ argv`` lines."""
    out = [f"# {spec.shape}: {len(spec.hosts)} hosts ("
           + ", ".join(f"{h.name}={h.role or '-'}" for h in spec.hosts) + "), switches "
           + ", ".join(s.name for s in spec.switches)]
    last = None
    for s in steps:
        head = (s.where(), s.what)
        if head != last:
            out.append(f"# {s.where()}: {s.what if s.what == 'offload' else 'point ' + s.what}")
            last = head
        out.append("$ " + " ".join(s.argv))
    return out
