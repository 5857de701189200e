"""Socket pacing with ``SO_MAX_PACING_RATE``: the ``pacing`` enforcement of link/N shaping.

DESIGN.md section 1.1 caps each worker at B/N either with an HTB class or by asking the
kernel to pace the worker's TCP socket. ``SO_MAX_PACING_RATE`` takes **bytes per second**
(the kernel compares it with ``sk_pacing_rate``, which is in bytes/s). Since Linux 4.13 TCP
paces by itself with a per-socket hrtimer (Eric Dumazet's "TCP internal pacing"), so no
``fq`` qdisc is needed, which matters here: this kernel has no fq. A 32-bit value works on
every kernel (0xFFFFFFFF means unlimited); kernels since 4.20 also accept 64 bits, used only
for rates above 4 GB/s.
"""

from __future__ import annotations

import socket
import struct

# asm-generic/socket.h; Python's socket module does not export it.
SO_MAX_PACING_RATE: int = getattr(socket, "SO_MAX_PACING_RATE", 47)

_U32_MAX = 0xFFFFFFFF
UNLIMITED = 2**64 - 1


def rate_bps_to_bytes_per_s(rate_bps: float) -> int:
    """Bit/s (the units of every rate in gradbed's configs) to the kernel's bytes/s."""
    if not rate_bps > 0:
        raise ValueError(f"rate_bps={rate_bps}: must be > 0 (use clear_max_pacing_rate)")
    return max(1, round(rate_bps / 8))


def set_max_pacing_rate(sock: socket.socket, rate_bps: float) -> int:
    """Cap ``sock``'s pacing at ``rate_bps`` bit/s; returns the bytes/s given to the kernel."""
    value = rate_bps_to_bytes_per_s(rate_bps)
    if value < _U32_MAX:
        optval = struct.pack("=I", value)
    else:
        optval = struct.pack("=Q", value)
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, optval)
    except OSError as e:
        raise OSError(e.errno, f"SO_MAX_PACING_RATE={value} B/s on fd {sock.fileno()}: "
                               f"{e.strerror}") from e
    return value


def clear_max_pacing_rate(sock: socket.socket) -> None:
    """Remove the cap (the kernel's ~0U means unlimited)."""
    sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("=I", _U32_MAX))


def get_max_pacing_rate(sock: socket.socket) -> int:
    """The socket's cap in bytes/s (:data:`UNLIMITED` when uncapped)."""
    buf = sock.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, 8)
    if len(buf) == 8:
        return int(struct.unpack("=Q", buf)[0])
    value = int(struct.unpack("=I", buf[:4])[0])
    return UNLIMITED if value == _U32_MAX else value
