"""Uploads timed by the kernel's transmit stamps, for tests/topo/test_drain_mininet.py (run
inside hosts).

``python tests/support/stamp_probe.py serve PORT`` reads and discards everything, until the peer
closes; ``python tests/support/stamp_probe.py probe HOST PORT UPLOADS CHUNKS CHUNK_BYTES GAP_MS
PACKET_BYTES`` makes UPLOADS uploads of CHUNKS writes of CHUNK_BYTES each, GAP_MS apart,
60 ms idle before each (the shaper's bucket fills again), through the worker's own reader
(agents.net.txstamps) on a socket with a timeout like the worker's, and prints one JSON line:
each upload's ``queued_departure_rate_bps`` (null: no packet waited; PACKET_BYTES is the
host's GSO packet, as the worker is told it) and its stamp count.
"""

from __future__ import annotations

import json
import socket
import sys
import time

from agents.core.drain import queued_departure_rate_bps
from agents.net.txstamps import TxStampReader


def serve(port: int) -> None:
    with socket.create_server(("0.0.0.0", port)) as srv:
        conn, _ = srv.accept()
        with conn:
            while conn.recv(1 << 16):
                pass


def probe(host: str, port: int, uploads: int, chunks: int, chunk_bytes: int,
          gap_ms: float, packet_bytes: int) -> dict[str, list]:
    rates: list[float | None] = []
    counts: list[int] = []
    with socket.create_connection((host, port), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = TxStampReader(s)
        payload = b"x" * chunk_bytes
        for _ in range(uploads):
            time.sleep(0.06)
            reader.start_upload()
            for c in range(chunks):
                if c:
                    time.sleep(gap_ms / 1000)
                begun_ns = time.time_ns()
                s.sendall(payload)
                reader.wrote(chunk_bytes, begun_ns)
            stamps = reader.collect()
            rates.append(queued_departure_rate_bps(stamps, reader.writes,
                                                   packet_bytes=packet_bytes))
            counts.append(len(stamps))
        reader.close()
    return {"rates_bps": rates, "stamps": counts}


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    else:
        a = sys.argv[2:]
        print(json.dumps(probe(a[0], int(a[1]), int(a[2]), int(a[3]), int(a[4]),
                               float(a[5]), int(a[6]))))
