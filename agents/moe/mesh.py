"""A full TCP mesh between H expert hosts, and all-to-all exchanges over it.

Host i listens on its own address and connects to every host j < i; a connection opens
with HELLO (role ``expert``, the sender's index, the run's tag) and WELCOME, so each
pair of hosts shares exactly one TCP connection, used in both directions.

:meth:`Mesh.exchange` is one all-to-all: this host sends one frame to every peer and
receives one frame from every peer, all at once (a thread per send and per receive:
two hosts sending each other more than their socket buffers hold would deadlock if
either only sent first). What may arrive is fixed before any byte is read: each
receive checks the header against an :class:`~agents.moe.exchange.Expect` before it
reads the payload into a tensor of exactly the expected size. A peer cannot make this
host allocate more than ``max_payload_bytes`` for one frame.

Byte counts: ``sent``/``received`` per peer, frame headers included, so a test can hold
them to the formulas in :mod:`agents.moe.zero` and :mod:`agents.moe.hosts`.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from agents import codec, wire
from agents.codec import DType, FrameError, MsgType
from agents.moe.exchange import Expect, check_header


class Mesh:
    """This host's connections to every other expert host. A context manager."""

    def __init__(self, me: int, addrs: list[tuple[str, int]], run_tag: int, *,
                 crc: bool = True, max_payload_bytes: int = 1 << 30,
                 timeout_s: float = 60.0) -> None:
        if not 0 <= me < len(addrs):
            raise ValueError(f"host index {me} not in [0, {len(addrs)})")
        self.me = me
        self.hosts = len(addrs)
        self.addrs = addrs
        self.run_tag = run_tag
        self.crc = crc
        self.max_payload_bytes = max_payload_bytes
        self.timeout_s = timeout_s
        self.socks: dict[int, socket.socket] = {}
        self.writers: dict[int, wire.FrameWriter] = {}
        self.readers: dict[int, wire.FrameReader] = {}
        self.sent: dict[int, int] = {}
        self.received: dict[int, int] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._listener: socket.socket | None = None

    @property
    def peers(self) -> list[int]:
        """Other hosts, starting after this one (host i talks to i+1 first): with every
        host in this order, no host's link is the first target of all others."""
        return [(self.me + s) % self.hosts for s in range(1, self.hosts)]

    # -- connecting ----------------------------------------------------------------------

    def open(self) -> Mesh:
        host, port = self.addrs[self.me]
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((host, port))
        ls.listen(self.hosts)
        ls.settimeout(self.timeout_s)
        self._listener = ls
        for j in range(self.me):
            self._connect(j)
        deadline = time.monotonic() + self.timeout_s
        while len(self.socks) < self.hosts - 1:
            ls.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                conn, _ = ls.accept()
            except TimeoutError as e:
                missing = sorted(set(range(self.hosts)) - set(self.socks) - {self.me})
                raise TimeoutError(f"expert host {self.me}: hosts {missing} did not connect "
                                   f"within {self.timeout_s} s") from e
            try:
                self._accept(conn)
            except (FrameError, OSError) as e:
                # A stranger or a broken peer: refuse it, keep waiting for the real ones.
                print(f"expert host {self.me}: refused a connection: {e}", flush=True)
                conn.close()
        self._pool = ThreadPoolExecutor(max_workers=2 * max(1, self.hosts - 1),
                                        thread_name_prefix=f"mesh{self.me}")
        return self

    def _register(self, j: int, s: socket.socket) -> None:
        s.settimeout(None)
        wire.set_socket_options(s, nodelay=True)
        self.socks[j] = s
        self.writers[j] = wire.FrameWriter(s, run_tag=self.run_tag, worker=self.me,
                                           crc=self.crc)
        self.readers[j] = wire.FrameReader(s, expect_tag=self.run_tag,
                                           max_payload_bytes=self.max_payload_bytes)
        self.sent[j] = self.received[j] = 0

    def _connect(self, j: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                s = socket.create_connection(self.addrs[j], timeout=self.timeout_s)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        hdr, body = codec.frame_for_bytes(codec.hello_payload("expert", self.me),
                                          msg_type=MsgType.HELLO, run_tag=self.run_tag,
                                          worker=self.me)
        wire.send_frame(s, hdr, body)
        reader = wire.FrameReader(s, expect_tag=self.run_tag, max_payload_bytes=4096)
        h, payload = reader.read_frame()
        hello = codec.parse_hello(payload)
        if h.msg_type != MsgType.WELCOME or hello.role != "expert" or hello.worker != j:
            raise FrameError(f"expert host {self.me}: {self.addrs[j]} answered "
                             f"{h.msg_type.name} from {hello.role} {hello.worker}, "
                             f"expected WELCOME from expert {j}")
        self._register(j, s)

    def _accept(self, conn: socket.socket) -> None:
        conn.settimeout(self.timeout_s)
        reader = wire.FrameReader(conn, expect_tag=self.run_tag, max_payload_bytes=4096)
        h, payload = reader.read_frame()
        if h.msg_type != MsgType.HELLO:
            raise FrameError(f"expected HELLO, got {h.msg_type.name}")
        hello = codec.parse_hello(payload)
        j = hello.worker
        if hello.role != "expert" or j != h.worker or not self.me < j < self.hosts:
            raise FrameError(f"HELLO from {hello.role} {j} (frame says {h.worker}): not an "
                             f"expert host in ({self.me}, {self.hosts})")
        if j in self.socks:
            raise FrameError(f"HELLO: expert host {j} is already connected")
        hdr, body = codec.frame_for_bytes(codec.hello_payload("expert", self.me),
                                          msg_type=MsgType.WELCOME, run_tag=self.run_tag,
                                          worker=self.me)
        wire.send_frame(conn, hdr, body)
        self._register(j, conn)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        for s in self.socks.values():
            try:
                s.close()
            except OSError:
                pass
        self.socks.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def __enter__(self) -> Mesh:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- exchanging ----------------------------------------------------------------------

    def _send(self, j: int, t: torch.Tensor, kind: MsgType, iteration: int, chunk: int) -> int:
        n = self.writers[j].send_message([t.detach().contiguous()], msg_type=kind,
                                         iteration=iteration, chunk=chunk)
        self.sent[j] += n
        return n

    def _recv(self, j: int, want: Expect) -> torch.Tensor:
        reader = self.readers[j]
        before = reader.bytes_read
        h = reader.read_header()
        check_header(h, want, f"expert host {self.me} <- {j} ({reader.peer})")
        t = reader.read_tensor(h)
        self.received[j] += reader.bytes_read - before
        return t

    def exchange(self, kind: MsgType, iteration: int, chunk: int,
                 sends: Mapping[int, torch.Tensor], recv_numel: Mapping[int, int],
                 dtype: DType = DType.FLOAT32) -> dict[int, torch.Tensor]:
        """One all-to-all: ``sends[j]`` to every peer j, and from every peer j exactly
        ``recv_numel[j]`` elements of ``dtype`` in a ``kind`` frame of this step and
        chunk. Returns the received flat tensors by peer."""
        if self.hosts == 1:
            return {}
        assert self._pool is not None, "Mesh.exchange before open()"
        if set(sends) != set(self.peers) or set(recv_numel) != set(self.peers):
            raise ValueError(f"exchange: sends to {sorted(sends)} and receives from "
                             f"{sorted(recv_numel)}, expected every peer {sorted(self.peers)}")
        futs_send = [self._pool.submit(self._send, j, sends[j], kind, iteration, chunk)
                     for j in self.peers]
        futs_recv = {j: self._pool.submit(self._recv, j, Expect(kind, iteration, chunk, j,
                                                                 dtype, recv_numel[j]))
                     for j in self.peers}
        try:
            out = {j: f.result() for j, f in futs_recv.items()}
            for f in futs_send:
                f.result()
        except BaseException:
            # A bad frame or a dead peer: the stream is out of sync, and the other
            # threads may wait forever on peers that wait on us. Shut every connection.
            for s in self.socks.values():
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            raise
        return out
