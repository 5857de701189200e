"""The dumbbell: two switches joined by a trunk, the trunk the bottleneck.

The classic setting for cross traffic (Mininet-HiFi's and Pantheon's experiments): the
workers and the background sources ``bgJ`` hang off the left switch ``gbsw0``; the PS and
the background sinks ``sinkJ`` (one per source) off the right switch ``gbsw1``. Gradients
and background flows meet only on the trunk; the PS's own access link is not shared, so
the flows compete where a wide-area link would be.

Shaping points (egress, as everywhere):

- ``up`` (left -> right, gradients and background uploads): ``gbsw0-eth1``, the trunk's
  left end, at ``net.bottleneck_mbps`` with ``net.queue_bytes``, delay and loss;
- ``down`` (right -> left, weights): ``gbsw1-eth1`` at ``net.bottleneck_down_mbps``;
- ``HOST.up`` / ``HOST.down``: every host's access link, at ``net.worker_link_mbps``.
"""

from __future__ import annotations

from agents.core.config import ExperimentConfig
from agents.core.nodes import worker_node
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

LEFT, RIGHT = "gbsw0", "gbsw1"
TRUNK_PORT = 1


@register("dumbbell")
def dumbbell(cfg: ExperimentConfig) -> NetSpec:
    n = cfg.net
    trunk_up = LinkSpec(rate_mbps=n.bottleneck_mbps, queue_bytes=n.queue_bytes,
                        delay_ms=n.delay_ms, loss_pct=n.loss_pct)
    trunk_down = LinkSpec(rate_mbps=n.down_mbps, queue_bytes=n.queue_bytes,
                          delay_ms=n.delay_ms, loss_pct=n.loss_pct)
    access = LinkSpec(rate_mbps=n.worker_link_mbps)
    # Everyone on the left shares the trunk's up queue; the sinks share its down queue.
    left_segs = sender_gso_segs(trunk_up.effective_queue_bytes(), trunk_up.rate_mbps,
                                n.workers + n.background_hosts)
    right_segs = sender_gso_segs(trunk_down.effective_queue_bytes(), trunk_down.rate_mbps,
                                 1 + n.background_hosts)
    left = [HostSpec(worker_node(k), "worker", "worker", f"10.0.0.{10 + k}", k, left_segs)
            for k in range(n.workers)]
    left += [HostSpec(f"bg{j}", "background", "flowgen", f"10.0.0.{100 + j}", j, left_segs)
             for j in range(n.background_hosts)]
    # ps gets one segment per packet, as in the star: its sends stay packet-exact.
    right = [HostSpec("ps", "ps", "ps", "10.0.0.1", 0, 1)]
    right += [HostSpec(f"sink{j}", "sink", "", f"10.0.0.{200 + j}", j, right_segs)
              for j in range(n.background_hosts)]
    edges = [EdgeSpec(LEFT, TRUNK_PORT, RIGHT, TRUNK_PORT,
                      a_to_b=ShapingPoint("up", trunk_up),
                      b_to_a=ShapingPoint("down", trunk_down))]
    for sw, hosts in ((LEFT, left), (RIGHT, right)):
        for port, h in enumerate(hosts, start=TRUNK_PORT + 1):
            edges.append(EdgeSpec(h.name, 0, sw, port,
                                  a_to_b=ShapingPoint(f"{h.name}.up", access,
                                                      ack_first=n.ack_first and h.kind != "ps"),
                                  b_to_a=ShapingPoint(f"{h.name}.down", access)))
    return NetSpec(shape="dumbbell", hosts=tuple(left + right),
                   switches=(SwitchSpec(LEFT), SwitchSpec(RIGHT)), edges=tuple(edges),
                   offload=n.offload, watch=("up", "down"))
