"""Sizes of a TCP/IPv4 segment on an Ethernet wire, defined once for every layer.

The shaped links count frames as qdiscs do (the 14-byte Ethernet header included, no
preamble or FCS); the agents and the analysis count TCP payload. ``TCP_GOODPUT_FRACTION``
converts between the two: a link shaped at rate R carries at most R x 1448/1514 of TCP
payload with a 1500-byte MTU and TCP timestamps on (Linux's default);
:func:`tcp_goodput_fraction` gives the same for another MTU (a cluster's links have 1450).
"""

from __future__ import annotations

# Ethernet frame of a 1500-byte MTU as qdiscs count it (the 14-byte header included); a
# 64 KB GSO packet holds 43 of them.
WIRE_FRAME_BYTES = 1514
# TCP payload of one such frame (IPv4, TCP with timestamps: 1514 - 14 - 20 - 32), and the
# TCP payload per byte on the wire: a shaped link's goodput ceiling is rate x this.
TCP_MSS_BYTES = 1448
TCP_GOODPUT_FRACTION = TCP_MSS_BYTES / WIRE_FRAME_BYTES
GSO_SEGS_MAX = 65_536 // WIRE_FRAME_BYTES
# What a frame carries besides TCP payload: the Ethernet header on the wire, and the IPv4
# and TCP (with timestamps) headers inside the MTU.
ETHERNET_HEADER_BYTES = 14
IP_TCP_HEADER_BYTES = 52


def tcp_goodput_fraction(mtu_bytes: int) -> float:
    """TCP payload per byte on the wire for full frames of a link with MTU ``mtu_bytes``:
    ``(mtu - 52) / (mtu + 14)``; 1448/1514 (``TCP_GOODPUT_FRACTION``) at 1500, 1398/1464
    at 1450 (the links of a run over several servers)."""
    if mtu_bytes <= IP_TCP_HEADER_BYTES:
        raise ValueError(f"mtu_bytes={mtu_bytes}: must exceed the {IP_TCP_HEADER_BYTES} "
                         "bytes of IPv4 and TCP headers")
    return (mtu_bytes - IP_TCP_HEADER_BYTES) / (mtu_bytes + ETHERNET_HEADER_BYTES)
