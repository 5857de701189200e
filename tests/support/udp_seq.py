"""Numbered UDP datagrams, for the seeded-loss test (run inside hosts).

``python tests/support/udp_seq.py serve PORT QUIET_S`` receives datagrams until none has come for
QUIET_S seconds (after the first), then prints the sequence numbers it got as JSON;
``python tests/support/udp_seq.py send HOST PORT N PPS`` sends N datagrams numbered 0..N-1 at
about PPS per second (in bursts of 50, so a busy machine does not slow the count).
Each datagram is 64 bytes: the number as 8 big-endian bytes, then zeros.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import time

SIZE_BYTES = 64
SO_RCVBUFFORCE = 33  # asm-generic/socket.h
RCVBUF_BYTES = 64 << 20
BURST = 50


def serve(port: int, quiet_s: float) -> None:
    got: list[int] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        # Room for every datagram even if this process stalls on a busy machine: plain
        # SO_RCVBUF is capped by net.core.rmem_max (208 KB, ~250 datagrams), and a datagram
        # the socket drops would read as a loss on the link. SO_RCVBUFFORCE (root) is not.
        try:
            s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RCVBUF_BYTES)
        except OSError:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
        s.bind(("0.0.0.0", port))
        print("ready", file=sys.stderr, flush=True)
        s.settimeout(60.0)  # for the first datagram
        while True:
            try:
                data = s.recv(2048)
            except TimeoutError:
                break
            if len(data) == SIZE_BYTES:  # hostile bytes: anything else is not ours
                got.append(struct.unpack_from("!Q", data)[0])
            s.settimeout(quiet_s)
    print(json.dumps(got))


def send(host: str, port: int, n: int, pps: float) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        t0 = time.monotonic()
        for i in range(n):
            s.sendto(struct.pack("!Q", i).ljust(SIZE_BYTES, b"\0"), (host, port))
            if i % BURST == BURST - 1:
                ahead = t0 + (i + 1) / pps - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]), float(sys.argv[3]))
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
