"""Lower bounds a policy cannot beat, to read measured iteration times against.

A synchronous iteration of the chunk-pipelined PS (``agents/dp/ps.py``: chunk c comes down as
soon as every worker has sent it) cannot end before

    compute_s + max(U + D / C, U / C + D)

where U = N x S x w / B_up is the whole upload of N workers' S-byte gradients through the
up bottleneck, D = N x S x w / B_down the whole download of the new weights, C the number of
chunks, and w = frame / payload the TCP-over-Ethernet wire cost of one payload byte
(1514 / 1448 counted at the qdisc). The first term is the upload followed by the last
chunk's download, the second the first chunk's upload followed by the whole download:
the downlink can start no earlier than the first chunk is complete and end no earlier than
one chunk after the last one is. It leaves out ACKs, round trips and the frame headers of
the wire protocol, so a real run is always above it.

The incast benchmark reports it per row: a shaped p99 below 0.7 x unshaped is reachable
only where floor / unshaped p99 < 0.7.
"""

from __future__ import annotations

from agents.core.ethernet import TCP_GOODPUT_FRACTION

__all__ = ["sync_iteration_floor_s"]


def sync_iteration_floor_s(*, workers: int, gradient_bytes: int, chunks: int,
                           up_bps: float, down_bps: float, compute_s: float = 0.0,
                           wire_per_payload: float = 1 / TCP_GOODPUT_FRACTION) -> float:
    """Seconds a synchronous, chunk-pipelined PS iteration takes at the least (module
    docstring). Raises ValueError naming the argument that is out of range."""
    checks = [("workers", workers, workers >= 1, ">= 1"),
              ("gradient_bytes", gradient_bytes, gradient_bytes >= 0, ">= 0"),
              ("chunks", chunks, chunks >= 1, ">= 1"),
              ("up_bps", up_bps, up_bps > 0, "> 0"),
              ("down_bps", down_bps, down_bps > 0, "> 0"),
              ("compute_s", compute_s, compute_s >= 0, ">= 0"),
              ("wire_per_payload", wire_per_payload, wire_per_payload >= 1, ">= 1")]
    for name, value, ok, allowed in checks:
        if not ok:
            raise ValueError(f"sync_iteration_floor_s: {name}={value!r}, must be {allowed}")
    wire_bits = workers * gradient_bytes * wire_per_payload * 8
    up_s, down_s = wire_bits / up_bps, wire_bits / down_bps
    return compute_s + max(up_s + down_s / chunks, up_s / chunks + down_s)
