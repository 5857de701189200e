"""Background flows drawn from a flow-size distribution, with their completion times
(``[background] kind = "flows"``; controller/background.py starts it).

Two roles, each a process inside an emulated host:

- ``sink`` (in the PS host) accepts connections; each flow sends an 8-byte big-endian
  length, then that many bytes; the sink reads them all and answers one byte.
- ``source`` (in a background host) replays ``agents.core.flowsize.flow_arrivals``: at each
  arrival it opens a new TCP connection (slow start included, as a real short flow has),
  sends the flow and waits for the sink's byte. The flow completion time (FCT) runs from
  the ``connect`` call to that byte, so it counts the handshake, the transfer and the
  last byte's delivery. Each flow is a ``flow_done`` event (start_s, size_bytes, fct_s);
  on exit the source logs one ``background`` event with its totals, as the bulk iperf3
  flows do. SIGINT or SIGTERM stops new arrivals; flows still running are logged as
  ``flow_unfinished``.

Flows run on their own threads, at most ``--max-concurrent`` at once: an arrival beyond
that is logged as ``flow_skipped`` rather than queued, so the offered load never silently
shifts in time.
"""

from __future__ import annotations

import argparse
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agents.core.events import EventLog
from agents.core.flowsize import flow_arrivals, load_flow_cdf
from agents.net import ending

HEADER = struct.Struct("!Q")
_ZEROS = memoryview(bytes(1 << 20))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError(f"peer closed after {len(buf)} of {n} bytes")
        buf += part
    return bytes(buf)


def _serve_flow(conn: socket.socket) -> None:
    with conn:
        try:
            (size,) = HEADER.unpack(_recv_exact(conn, HEADER.size))
            left = size
            scratch = bytearray(1 << 20)
            while left > 0:
                n = conn.recv_into(scratch, min(left, len(scratch)))
                if n == 0:
                    return
                left -= n
            conn.sendall(b"\x01")
        except OSError:
            return


def sink(bind: str, port: int) -> int:
    srv = socket.create_server((bind, port), backlog=512, reuse_port=False)
    print(f"flowgen sink on {bind}:{port}", flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_serve_flow, args=(conn,), daemon=True).start()


class Source:
    """Replays a list of ``(start_s, size_bytes)`` flows against a sink."""

    def __init__(self, flows: list[tuple[float, int]], connect: tuple[str, int], bind: str,
                 log: EventLog, congestion: str = "", max_concurrent: int = 256) -> None:
        self.flows = flows
        self.connect = connect
        self.bind = bind
        self.log = log
        self.congestion = congestion
        self.max_concurrent = max_concurrent
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._running: dict[int, tuple[float, int]] = {}
        self.done_bytes = 0
        self.done = 0
        self.failed = 0
        self.skipped = 0

    def _flow(self, i: int, start_s: float, size: int) -> None:
        t0 = time.monotonic()
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                if self.congestion:
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION,
                                 self.congestion.encode())
                s.bind((self.bind, 0))
                s.connect(self.connect)
                s.sendall(HEADER.pack(size))
                left = size
                while left > 0:
                    n = s.send(_ZEROS[:min(left, len(_ZEROS))])
                    left -= n
                _recv_exact(s, 1)
            fct = time.monotonic() - t0
            with self._lock:
                self.done += 1
                self.done_bytes += size
            self.log.emit("flow_done", flow=i, start_s=start_s, size_bytes=size, fct_s=fct)
        except OSError as e:
            with self._lock:
                self.failed += 1
            if not self.stop.is_set():
                self.log.emit("flow_failed", flow=i, start_s=start_s, size_bytes=size,
                              error=str(e))
        finally:
            with self._lock:
                self._running.pop(i, None)

    def run(self) -> None:
        t_start = time.monotonic()
        for i, (start_s, size) in enumerate(self.flows):
            if self.stop.wait(max(0.0, t_start + start_s - time.monotonic())):
                break
            with self._lock:
                busy = len(self._running) >= self.max_concurrent
                if not busy:
                    self._running[i] = (start_s, size)
            if busy:
                self.skipped += 1
                self.log.emit("flow_skipped", flow=i, start_s=start_s, size_bytes=size)
                continue
            threading.Thread(target=self._flow, args=(i, start_s, size), daemon=True).start()
        self.stop.wait()  # the flows are over; stay until the run ends
        elapsed = time.monotonic() - t_start
        with self._lock:
            unfinished = dict(self._running)
        for i, (start_s, size) in unfinished.items():
            self.log.emit("flow_unfinished", flow=i, start_s=start_s, size_bytes=size)
        self.log.emit("background", host=self.log.node, bytes=self.done_bytes,
                      mbps=self.done_bytes * 8 / elapsed / 1e6 if elapsed > 0 else 0.0,
                      seconds=elapsed, flows=self.done, failed=self.failed,
                      skipped=self.skipped, unfinished=len(unfinished))


def heartbeats(mode: str, run_dir: Path) -> None:
    """With ``--auth stdin`` (the controller started us): read the key bundle, end when the
    controller goes, and send heartbeats on the control socket like every other agent, so
    that a hung source is declared lost (and the run goes on without it). Imported here,
    not at the top: the module itself stays as light as a source started by hand needs."""
    if mode != "stdin":
        return
    from agents.net import auth
    from agents.net.control import liveness_client

    keys = auth.read_bundle()
    auth.exit_with_controller()
    liveness_client(run_dir, keys)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agents.traffic.flowgen", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="role", required=True)
    sk = sub.add_parser("sink")
    sk.add_argument("--bind", required=True)
    sk.add_argument("--port", type=int, required=True)
    so = sub.add_parser("source")
    so.add_argument("--run-dir", type=Path, required=True)
    so.add_argument("--node", required=True)
    so.add_argument("--connect", required=True, help="sink address, IP:PORT")
    so.add_argument("--bind", required=True)
    so.add_argument("--cdf", required=True)
    so.add_argument("--cdf-format", default="auto")
    so.add_argument("--cdf-interpolation", default="auto")
    so.add_argument("--cdf-packet-bytes", type=int, default=0)
    so.add_argument("--load-mbps", type=float, required=True)
    so.add_argument("--duration-s", type=float, required=True)
    so.add_argument("--seed", type=int, default=0)
    so.add_argument("--congestion", default="")
    so.add_argument("--max-concurrent", type=int, default=256)
    so.add_argument("--auth", choices=("stdin", "file"), default="file",
                    help="stdin: started by the controller (its key bundle on stdin, "
                         "heartbeats on the control socket, exit when the controller goes); "
                         "file: by hand or a test, no heartbeat")
    args = ap.parse_args(argv)
    if args.role == "sink":
        return sink(args.bind, args.port)
    host, _, port = args.connect.rpartition(":")
    cdf = load_flow_cdf(args.cdf, format=args.cdf_format, interpolation=args.cdf_interpolation,
                        packet_bytes=args.cdf_packet_bytes,
                        log=lambda m: print(m, file=sys.stderr, flush=True))
    flows = flow_arrivals(cdf, args.load_mbps, args.duration_s, args.seed)
    heartbeats(args.auth, args.run_dir)
    log = EventLog.for_node(args.run_dir, args.run_dir.name, args.node)
    src = Source(flows, (host, int(port)), args.bind, log, args.congestion,
                 args.max_concurrent)

    def on_signal(signum: int, frame: Any) -> None:
        src.stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    log.emit("flows_planned", flows=len(flows), bytes=sum(s for _, s in flows),
             load_mbps=args.load_mbps, duration_s=args.duration_s, cdf=args.cdf)

    def run() -> int:
        src.run()
        return 0

    # A failed flow is logged and the source goes on; what reaches here (the event log's
    # disk, the thread limit) ends it with one line naming the node.
    return ending.run_agent(run, name=lambda: f"flowgen {args.node}", errors=(OSError,),
                          code=2, on_error=lambda e: log.emit("flowgen_error", error=e),
                          close=log.close)


if __name__ == "__main__":
    ending.exit_process(main())
