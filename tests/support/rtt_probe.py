"""TCP_INFO's min_rtt over a real connection, for the delay tests (run inside hosts).

``python tests/support/rtt_probe.py serve PORT`` echoes every byte back, once;
``python tests/support/rtt_probe.py probe HOST PORT N`` sends N one-byte requests, each after the
previous echo (so each ACK rides on the echo and no delayed ACK inflates a sample), then
prints the kernel's ``tcpi_min_rtt`` in microseconds.
"""

from __future__ import annotations

import socket
import sys

from agents.net.tcpinfo import read_tcp_info


def serve(port: int) -> None:
    with socket.create_server(("0.0.0.0", port)) as srv:
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := conn.recv(4096):
                conn.sendall(data)


def probe(host: str, port: int, n: int) -> int:
    with socket.create_connection((host, port), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(n):
            s.sendall(b"x")
            if s.recv(1) != b"x":
                raise RuntimeError("echo server closed early")
        info = read_tcp_info(s)
    if info.min_rtt_us is None:
        raise RuntimeError("this kernel's TCP_INFO has no min_rtt")
    return info.min_rtt_us


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    else:
        print(probe(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
