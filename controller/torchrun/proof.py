"""Did the ranks' bytes cross the emulated links? The one definition of each number that
``summary.json``'s ``torchrun.bytes`` section carries (pure).

- ``payload_sent_bytes[host]``: TCP payload the host's ranks sent to other hosts, the sum of
  ``tcpi_bytes_acked`` over its connections that leave the host (each connection's last
  counters, from sock_diag's destroy broadcast; SYN and FIN count one byte each);
  ``payload_received_bytes`` likewise from ``tcpi_bytes_received``.
- ``store_sent_bytes[host]``: the part of ``payload_sent_bytes`` that went over the c10d
  store's connections (rendezvous and ``init_process_group``, the store's port at either
  end): torchrun's agents talk to the store whatever the script does, so these bytes
  prove nothing about the training traffic and the bypass check leaves them out.
- ``local_bytes[host]``: what its connections to itself carried (loopback, or its own
  address): traffic no shaped link saw.
- ``interface_tx_bytes`` / ``interface_rx_bytes``: the host's emulated interface, as the
  kernel counts it (headers and ACKs included: about 5 % more than the payload at MTU
  1500, more under loss).
- Ring all-reduce of S bytes among N hosts, one process each: every host sends and
  receives ``2 (N - 1) / N * S`` (:func:`ring_allreduce_bytes`). With K processes per
  host, gloo's ring over N K ranks crosses each host's link once per direction, so a host
  sends ``2 (N K - 1) / (N K) * S`` over its link and its ranks pass ``2 (K - 1) / (N K)
  * S`` among themselves inside it (:func:`ring_allreduce_bytes` with ``per_host``).
  ``allreduce_equivalent_bytes`` inverts the first: the S a host's sent bytes stand for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from controller.torchrun.sockdiag import ConnSample, is_local


def ring_allreduce_bytes(size_bytes: float, hosts: int, per_host: int = 1) -> float:
    """Bytes one host sends over its link for a ring all-reduce of ``size_bytes`` among
    ``hosts`` hosts of ``per_host`` processes each: ``2 (R - 1) / R * S``, R = hosts *
    per_host (the ring enters and leaves each host once)."""
    ranks = hosts * per_host
    return 2 * (ranks - 1) / ranks * size_bytes if ranks > 1 else 0.0


def host_bytes(conns: Iterable[tuple[str, ConnSample]], ips: Mapping[str, str],
               store_port: int = 0) -> dict[str, dict[str, int]]:
    """Per host: payload sent and received over connections leaving it (``store_sent``:
    the part sent over the store's connections, ``store_port`` at either end), and local
    bytes."""
    out = {h: {"sent": 0, "received": 0, "local": 0, "connections": 0, "store_sent": 0}
           for h in ips}
    for host, c in conns:
        if c.state == "LISTEN":
            continue
        row = out[host]
        if is_local(c, ips[host]):
            row["local"] += c.bytes_acked
        else:
            row["sent"] += c.bytes_acked
            row["received"] += c.bytes_received
            row["connections"] += 1
            if store_port and store_port in (c.sport, c.dport):
                row["store_sent"] += c.bytes_acked
    return out


def bypass_cause(per_host: Mapping[str, Mapping[str, int]],
                 iface_tx: Mapping[str, int],
                 ranks: Mapping[str, Sequence[int]] | None = None) -> str | None:
    """Why the training traffic did not cross the emulated links, or None when it did. A
    host whose connections sent nothing to other hosts but the store's (rendezvous) while
    the run had several hosts bypassed them: over loopback when its local connections
    carried bytes, else by shared memory / peer-to-peer copies or not over TCP at all.
    ``ranks`` (host -> its global ranks) names the ranks beside their hosts."""
    if len(per_host) < 2:
        return None
    silent = [h for h, b in per_host.items() if b["sent"] - b.get("store_sent", 0) <= 0]
    if not silent:
        return None
    local = [h for h in silent if per_host[h]["local"] > 0]
    tx = ", ".join(f"{h} {iface_tx.get(h, 0)} B" for h in silent)

    def named(hosts: list[str]) -> str:
        if not ranks:
            return ", ".join(hosts)
        return ", ".join(f"{h} (rank{'s' if len(ranks[h]) > 1 else ''} "
                         f"{', '.join(map(str, ranks[h]))})" for h in hosts)

    if local:
        return (f"training traffic bypassed the emulated links: hosts {named(silent)} sent "
                f"no TCP payload to another host but rendezvous "
                f"({', '.join(local)} over loopback; "
                f"interface tx: {tx}); check GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME and "
                "that the script uses the launcher's MASTER_ADDR")
    return (f"training traffic bypassed the emulated links: hosts {named(silent)} sent no "
            f"TCP payload but rendezvous (interface tx: {tx}); shared memory or peer-to-peer "
            "(NCCL_SHM_DISABLE / NCCL_P2P_DISABLE unset?), or the script made no collective call")


def bytes_summary(per_host: Mapping[str, Mapping[str, int]], iface: Mapping[str, tuple[int, int]],
                  per_proc: int) -> dict[str, Any]:
    """``summary.json``'s ``torchrun.bytes``: per-host numbers and the ring equivalents."""
    n = len(per_host)
    factor = ring_allreduce_bytes(1.0, n, per_proc)
    return {
        "payload_sent_bytes": {h: b["sent"] for h, b in per_host.items()},
        "payload_received_bytes": {h: b["received"] for h, b in per_host.items()},
        "store_sent_bytes": {h: b.get("store_sent", 0) for h, b in per_host.items()},
        "local_bytes": {h: b["local"] for h, b in per_host.items()},
        "connections": {h: b["connections"] for h, b in per_host.items()},
        "interface_rx_bytes": {h: rx for h, (rx, _) in iface.items()},
        "interface_tx_bytes": {h: tx for h, (_, tx) in iface.items()},
        "interface_over_payload": {
            h: round(iface[h][1] / b["sent"], 4) if b["sent"] and h in iface else None
            for h, b in per_host.items()},
        "ring_factor": factor,
        "allreduce_equivalent_bytes": {h: round(b["sent"] / factor) if factor else None
                                       for h, b in per_host.items()},
        "formula": f"ring all-reduce of S bytes: each host sends 2(R-1)/R x S over its link, "
                   f"R = {n} hosts x {per_proc} per host",
    }
