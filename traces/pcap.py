"""Packet-capture replay as background traffic (DESIGN.md section 2: pcap replay, scapy to
read and rewrite, tcpreplay to send).

A capture from elsewhere carries other hosts' addresses. :func:`rewrite_pcap` readdresses
every IPv4 packet so it travels from a background host to the PS through the bottleneck
(Ethernet and IP source and destination; IP, TCP and UDP checksums recomputed) and keeps
each packet's timestamp, so ``tcpreplay`` reproduces the capture's timing. Packets that
cannot cross the emulated link unchanged are left out and counted: non-IPv4 frames (ARP,
IPv6, other link types) and frames above the link's 1514-byte MTU (captures taken with
segmentation offload hold such "packets").

:func:`pcap_summary` reads a capture without writing anything; ``gradbed run`` calls it
before it builds a network, so a file that is not a capture is an error naming it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from agents.core.bandwidth import TraceError

__all__ = ["MAX_FRAME_BYTES", "PcapSummary", "pcap_summary", "read_capture", "rewrite_pcap"]

MAX_FRAME_BYTES = 1514


@dataclass(frozen=True)
class PcapSummary:
    packets: int                  # frames in the file
    ipv4_packets: int             # of which IPv4 and at most MAX_FRAME_BYTES: what is replayed
    ipv4_bytes: int               # their frame bytes
    duration_s: float             # last timestamp - first, over every frame

    @property
    def mean_mbps(self) -> float:
        return self.ipv4_bytes * 8 / self.duration_s / 1e6 if self.duration_s > 0 else 0.0


def read_capture(path: str | os.PathLike[str]) -> list:  # type: ignore[type-arg]
    """Every frame of the capture at ``path``. TraceError naming the file when it is
    missing, not a capture, empty, or holds no IPv4 frame to replay."""
    import scapy.layers.inet  # noqa: F401  (registers IP/TCP/UDP, and Ethernet as link type 1)
    import scapy.layers.l2  # noqa: F401
    from scapy.error import Scapy_Exception
    from scapy.utils import rdpcap

    if not Path(path).is_file():
        raise TraceError(f"{path}: cannot read: no such file")
    try:
        packets = list(rdpcap(str(path)))
    except (Scapy_Exception, OSError, ValueError, EOFError) as e:
        raise TraceError(f"{path}: not a pcap capture: {e}") from None
    if not packets:
        raise TraceError(f"{path}: the capture holds no packets")
    if not any(_replayable(p) for p in packets):
        raise TraceError(f"{path}: none of its {len(packets)} packets is an IPv4 frame of "
                         f"at most {MAX_FRAME_BYTES} bytes; nothing to replay")
    return packets


def _replayable(pkt: object) -> bool:
    from scapy.layers.inet import IP
    from scapy.layers.l2 import Ether

    return (pkt.haslayer(Ether) and pkt.haslayer(IP)  # type: ignore[attr-defined]
            and len(pkt) <= MAX_FRAME_BYTES)  # type: ignore[arg-type]


def _summary(packets: list) -> PcapSummary:  # type: ignore[type-arg]
    keep = [p for p in packets if _replayable(p)]
    times = [float(p.time) for p in packets]
    return PcapSummary(packets=len(packets), ipv4_packets=len(keep),
                       ipv4_bytes=sum(len(p) for p in keep),
                       duration_s=max(times) - min(times))


def pcap_summary(path: str | os.PathLike[str]) -> PcapSummary:
    """What replaying ``path`` would send (errors as :func:`read_capture`)."""
    return _summary(read_capture(path))


def rewrite_pcap(packets: list, dst: str | os.PathLike[str], *,  # type: ignore[type-arg]
                 src_mac: str, dst_mac: str, src_ip: str, dst_ip: str) -> PcapSummary:
    """Write the replayable ones of ``packets`` (from :func:`read_capture`, which is read
    once for every host that replays it) to ``dst``, readdressed from (``src_mac``,
    ``src_ip``) to (``dst_mac``, ``dst_ip``), timestamps kept. Returns the summary of what
    was written."""
    from scapy.layers.inet import IP, TCP, UDP
    from scapy.layers.l2 import Ether
    from scapy.utils import wrpcap

    out = []
    for p in packets:
        if not _replayable(p):
            continue
        q = p.copy()
        q[Ether].src, q[Ether].dst = src_mac, dst_mac
        q[IP].src, q[IP].dst = src_ip, dst_ip
        del q[IP].chksum
        for layer in (TCP, UDP):
            if q.haslayer(layer):
                del q[layer].chksum
        q = Ether(bytes(q))  # rebuild: checksums and lengths recomputed
        q.time = p.time
        out.append(q)
    if not out:
        raise ValueError(f"rewrite_pcap: none of {len(packets)} packets is replayable")
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(dst).with_name(f".{Path(dst).name}.tmp")
    wrpcap(str(tmp), out)
    os.replace(tmp, dst)
    return _summary(out)
