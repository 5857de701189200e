"""The fabric: N hosts on one switch, every access link shaped both ways.

The home of roles that talk all to all or along a chain (pipeline stages, MoE expert
hosts): no single link is the bottleneck, each host's own link is. Hosts ``gbh0..gbh{N-1}``
(N = ``topo.hosts``, or ``net.workers`` when 0) all run ``topo.role`` (kind = the role's
name, rank = I; "" starts nothing, for scripts and ``--cli``).

Shaping points, for every host I:

- ``gbhI.up`` (gbhI -> switch): ``gbhI-eth0`` inside gbhI, at ``net.worker_link_mbps`` with
  ``net.queue_bytes``, and ``net.delay_ms``/``net.loss_pct``: a host-to-host path crosses
  exactly one ``up`` point, so the one-way delay between two hosts is ``delay_ms``;
- ``gbhI.down`` (switch -> gbhI): the switch port facing gbhI, same rate and queue, no delay.

Both carry ``topo.access_burst_ms`` as their HTB bucket (``LinkSpec.burst_ms``) when set.

No point is sampled into ``links.parquet`` by default (each sample costs a ``tc`` fork per
point); give a point a trace, or add a shape of your own with ``watch``.
"""

from __future__ import annotations

from agents.core.config import ExperimentConfig
from topo.shapes import register
from topo.spec import (
    EdgeSpec,
    HostSpec,
    LinkSpec,
    NetSpec,
    ShapingPoint,
    SwitchSpec,
    sender_gso_segs,
)

SWITCH = "gbsw0"


@register("fabric")
def fabric(cfg: ExperimentConfig) -> NetSpec:
    n, t = cfg.net, cfg.topo
    count = t.hosts or n.workers
    burst_ms = t.access_burst_ms or None  # topo.access_burst_ms; 0 = the default bucket
    up = LinkSpec(rate_mbps=n.worker_link_mbps, queue_bytes=n.queue_bytes,
                  delay_ms=n.delay_ms, loss_pct=n.loss_pct, burst_ms=burst_ms)
    down = LinkSpec(rate_mbps=n.worker_link_mbps, queue_bytes=n.queue_bytes,
                    burst_ms=burst_ms)
    # All the others may send to one host at once (an all-to-all): they share its down queue.
    segs = sender_gso_segs(down.effective_queue_bytes(), down.rate_mbps, max(1, count - 1))
    kind = t.role or "fabric"
    hosts = tuple(HostSpec(f"gbh{i}", kind, t.role, f"10.0.0.{10 + i}", i, segs)
                  for i in range(count))
    edges = tuple(EdgeSpec(h.name, 0, SWITCH, i + 1,
                           a_to_b=ShapingPoint(f"{h.name}.up", up, ack_first=n.ack_first),
                           b_to_a=ShapingPoint(f"{h.name}.down", down))
                  for i, h in enumerate(hosts))
    return NetSpec(shape="fabric", hosts=hosts, switches=(SwitchSpec(SWITCH),), edges=edges,
                   offload=n.offload)
