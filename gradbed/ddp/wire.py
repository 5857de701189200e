"""What a DDP communication hook puts on each rank's TCP connections, and how to read it.

**The formula** (one definition; ``docs/ddp.md`` states it and the tests check it against
the kernel's counters within 1 %). A bucket whose compressed payload holds ``P`` bytes of
tensor buffers crosses each rank's connections, per iteration, as

- ``allreduce`` (dense, fp16, and the agreement on the adaptive rate): gloo's ring
  reduce-scatter then all-gather, ``2 (N - 1) / N x P`` sent and as much received;
- ``allgather`` (top-k, random-k, QSGD, signSGD: every rank's payload differs, so none can
  be summed on the wire): a ring all-gather, ``(N - 1) x P`` sent and received.

gloo adds a small header per message, which the formula leaves out (well under 1 % for a
bucket of more than a few kilobytes).

:func:`own_tcp_bytes` reads those counters from inside a rank: the sum of
``tcpi_bytes_acked`` and ``tcpi_bytes_received`` over the process's TCP sockets, which are
gloo's connections to its peers (and the c10d store's, idle between rendezvous and exit).
"""

from __future__ import annotations

import os
import socket

from agents.net.tcpinfo import read_tcp_info

COLLECTIVES = ("allreduce", "allgather")


def sent_bytes(collective: str, payload_bytes: int, world: int) -> float:
    """Bytes one rank sends (and receives) for ``payload_bytes`` of one bucket's payload
    among ``world`` ranks (module docstring)."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if collective == "allreduce":
        return 2.0 * (world - 1) / world * payload_bytes
    if collective == "allgather":
        return float((world - 1) * payload_bytes)
    raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")


def sparse_breakeven_ratio(world: int, value_bytes: int, index_bytes: int = 4) -> float:
    """The element ratio above which a sparse bucket (values and int32 indices through
    ``allgather``) sends more than the dense bucket through ``allreduce``: ``(N - 1) x r x
    (value + index)`` against ``2 (N - 1) / N x value`` per element, so ``r = 2 value /
    (N (value + index))``; 1/N for float32."""
    if world < 2:
        return 1.0  # nothing crosses a wire: either costs nothing
    return 2.0 * value_bytes / (world * (value_bytes + index_bytes))


def own_tcp_bytes() -> tuple[int, int]:
    """``(bytes_acked, bytes_received)`` summed over this process's TCP sockets, read
    through a duplicate of each descriptor (closing the duplicate leaves the connection
    alone); listening sockets count zero, other sockets are skipped."""
    acked = received = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:  # closed meanwhile (the listing's own descriptor, a reconnect)
            continue
        with sock:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET,
                                                                      socket.AF_INET6):
                continue
            try:
                info = read_tcp_info(sock)
            except OSError:
                continue
        acked += info.bytes_acked or 0
        received += info.bytes_received or 0
    return acked, received
