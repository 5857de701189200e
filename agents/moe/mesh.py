"""A full TCP mesh between H expert hosts, and all-to-all exchanges over it.

Host i listens on its own address and connects to every host j < i, so each pair of
hosts shares exactly one TCP connection, used in both directions. Each connection is an
authenticated :class:`agents.net.link.Link`: challenge-response under the pair key only
hosts i and j hold (``keys[j]``, from the controller through stdin), then a MAC with a
sequence number on every frame, so no host can pass for another and a replayed frame is
refused.

:meth:`Mesh.exchange` is one all-to-all: this host sends one frame to every peer and
receives one frame from every peer, all at once (a thread per send and per receive:
two hosts sending each other more than their socket buffers hold would deadlock if
either only sent first); an exchange of small frames only (:data:`INLINE_MAX_BYTES`)
sends and then reads on the calling thread. What may arrive is fixed before any byte is read: each
receive checks the header against an :class:`~agents.moe.exchange.Expect` before it
reads the payload into a tensor of exactly the expected size. A peer cannot make this
host allocate more than ``max_payload_bytes`` for one frame.

Byte counts: ``sent``/``received`` per peer, frame headers included, so a test can hold
them to the formulas in :mod:`agents.moe.zero` and :mod:`agents.moe.hosts`.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from agents.core.guard_config import GuardConfig
from agents.moe.exchange import Expect, check_counts, check_header
from agents.net import admission, auth, handshake, link, protocol, wire
from agents.net.admission import AdmissionLimits
from agents.net.codec import DType, MsgType


def mesh_links(host: int, hosts: int) -> list[auth.Link]:
    """The expert-mesh links host ``host`` is an end of: one to every other host."""
    return [("expert", f"e{host}", f"e{j}") for j in range(hosts) if j != host]


def mesh_keys(bundle: auth.KeyBundle, host: int, hosts: int) -> dict[int, bytes]:
    """Host ``host``'s link keys by peer index, from its bundle (KeyError naming a
    missing link)."""
    return {j: bundle.link_key(m, a, b) for j, (m, a, b)
            in zip((j for j in range(hosts) if j != host), mesh_links(host, hosts),
                   strict=True)}


def file_keys(secret: bytes, host: int, hosts: int) -> dict[int, bytes]:
    """:func:`mesh_keys` of an expert host started with ``--auth file`` (tests, by hand)."""
    return mesh_keys(auth.file_bundle(secret, f"e{host}", mesh_links(host, hosts)), host,
                     hosts)


#: An exchange whose every frame carries at most this many payload bytes (the dispatch's
#: counts, the evaluation's totals) runs on the calling thread: it sends to every peer,
#: then reads from every peer. Each such frame fits any socket's send buffer, so sending
#: first cannot deadlock; and the peer's frame wakes this thread itself rather than a
#: pool thread that must then wake it. On 2 loaded cores each such hand-off waits for a
#: core, and the counts phase is pure latency (docs/moe.md: it was ~10 % of a dispatch).
INLINE_MAX_BYTES = 4096
R = TypeVar("R")


class Mesh:
    """This host's connections to every other expert host. A context manager."""

    def __init__(self, me: int, addrs: list[tuple[str, int]], run_tag: int, *,
                 run_id: str, keys: Mapping[int, bytes], crc: bool = True,
                 max_payload_bytes: int = 1 << 30, timeout_s: float = 60.0,
                 handshake_timeout_s: float = handshake.DEFAULT_TIMEOUT_S,
                 limits: AdmissionLimits | None = None,
                 log: handshake.EventSink | None = None) -> None:
        """``keys[j]``: the key of the link to host j (:func:`agents.net.auth.pair_key`), for
        every other host. ``timeout_s``: for every host to be reached;
        ``handshake_timeout_s``: for each connection's handshake; ``limits``: the
        admission limits of its listener (``[guard]``'s defaults when None); ``log``: where the
        handshakes are reported (the host's event log)."""
        if not 0 <= me < len(addrs):
            raise ValueError(f"host index {me} not in [0, {len(addrs)})")
        missing = sorted(set(range(len(addrs))) - {me} - set(keys))
        if missing:
            raise ValueError(f"expert host {me}: no link key for hosts {missing}")
        self.run_id = run_id
        self.keys = dict(keys)
        self.me = me
        self.hosts = len(addrs)
        self.addrs = addrs
        self.run_tag = run_tag
        self.crc = crc
        self.max_payload_bytes = max_payload_bytes
        self.timeout_s = timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.limits = limits or AdmissionLimits.from_guard(GuardConfig())
        self.answered: set[int] = set()  # hosts whose handshake this end answered
        self.log = log
        self.socks: dict[int, socket.socket] = {}
        self.links: dict[int, link.Link] = {}
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
        """Dial every host below this one and take the handshakes of every host above it.
        Those handshakes run on threads under the admission limits
        (``agents.net.handshake.accept_forever``), each host above this one keeping a slot
        of its own (its address), so strangers trickling their hellos hold their slots,
        not the real hosts' way in; refusals are reported aggregated."""
        host, port = self.addrs[self.me]
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((host, port))
        ls.listen(max(handshake.LISTEN_BACKLOG, self.hosts))
        self._listener = ls
        joined: queue.SimpleQueue[link.Link] = queue.SimpleQueue()
        stopped = threading.Event()
        threading.Thread(target=handshake.accept_forever, name=f"mesh{self.me}-accept",
                         daemon=True, args=(ls, lambda conn, _: joined.put(self._accept(conn))),
                         kwargs=dict(stopped=stopped, report=self._refused,
                                     limits=self.limits,
                                     expected={a for a, _ in self.addrs[self.me + 1:]})
                         ).start()
        try:
            for j in range(self.me):
                self._connect(j)
            deadline = time.monotonic() + self.timeout_s
            while len(self.socks) < self.hosts - 1:
                try:
                    lk = joined.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    missing = sorted(set(range(self.hosts)) - set(self.socks) - {self.me})
                    raise TimeoutError(f"expert host {self.me}: hosts {missing} did not "
                                       f"connect within {self.timeout_s} s") from None
                if lk.peer in self.socks:  # two handshakes for one host raced
                    lk.sock.close()
                    continue
                self._register(lk)
        finally:
            stopped.set()  # the mesh is complete: nobody else may join
        self._pool = ThreadPoolExecutor(max_workers=2 * max(1, self.hosts - 1),
                                        thread_name_prefix=f"mesh{self.me}")
        return self

    def _refused(self, r: admission.RefusalReport) -> None:
        print(f"expert host {self.me}: refused {r.count} connection(s) from {r.source} "
              f"({r.reason}): {r.example}", flush=True)
        if self.log is not None:
            self.log.emit("refused", source=r.source, reason=r.reason, count=r.count,
                          example=r.example)

    def _register(self, lk: link.Link) -> None:
        s = lk.sock
        s.settimeout(None)
        wire.set_socket_options(s, nodelay=True)
        self.socks[lk.peer] = s
        self.links[lk.peer] = lk
        self.readers[lk.peer] = lk.reader(self.max_payload_bytes)
        self.sent[lk.peer] = self.received[lk.peer] = 0

    def _connect(self, j: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                # From this host's own address: the one host j keeps a slot for.
                s = socket.create_connection(self.addrs[j], timeout=self.timeout_s,
                                             source_address=(self.addrs[self.me][0], 0))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        name = f"expert host {self.me} -> {j} ({wire.peer_name(s)})"
        try:
            dialer = protocol.Dialer(self.run_id, "expert", self.me, self.keys[j],
                                     welcome_from=("expert", j))
            session, _ = handshake.dial(s, dialer, run_tag=self.run_tag, name=name,
                                        timeout_s=self.handshake_timeout_s, log=self.log)
            self._register(link.Link.dialed(s, session, peer=j, name=name,
                                            run_tag=self.run_tag))
        except BaseException:
            s.close()
            raise

    def _accept(self, conn: socket.socket) -> link.Link:
        """The handshake of a connection a host above this one opened (on an accept
        thread); raises HandshakeError for anyone else."""
        name = f"expert host {self.me} <- {wire.peer_name(conn)}"
        # Only hosts above us dial us, each once.
        waiting = {j: k for j, k in self.keys.items() if j > self.me and j not in self.answered}
        answerer = protocol.Answerer(self.run_id, "expert", protocol.keys_by_index(waiting),
                                     accepts=f"expert hosts {sorted(waiting)}")
        session = handshake.answer(conn, answerer, run_tag=self.run_tag, name=name,
                                   welcome=("expert", self.me),
                                   timeout_s=self.handshake_timeout_s, log=self.log)
        lk = link.Link.answered(conn, session, name=name, run_tag=self.run_tag)
        self.answered.add(lk.peer)  # set.add is atomic: a second try for it is refused
        return lk

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

    def _send(self, j: int, ts: Sequence[torch.Tensor], kind: MsgType, iteration: int,
              chunk: int) -> int:
        """One message of ``len(ts)`` parts to peer j, in one gathered write."""
        n = self.links[j].send_message([t.detach().contiguous() for t in ts], msg_type=kind,
                                       worker=self.me, iteration=iteration, chunk=chunk,
                                       crc=self.crc)
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
        if (max(t.numel() * t.element_size() for t in sends.values()) <= INLINE_MAX_BYTES
                and max(recv_numel.values()) * dtype.itemsize <= INLINE_MAX_BYTES):
            self.post(kind, iteration, chunk, sends)
            return self.collect(kind, iteration, chunk, recv_numel, dtype)
        expects = {j: Expect(kind, iteration, chunk, j, dtype, recv_numel[j])
                   for j in self.peers}
        return self._both_ways(
            lambda j: self._send(j, [sends[j]], kind, iteration, chunk),
            lambda j: self._recv(j, expects[j]))

    def _both_ways(self, send: Callable[[int], object], recv: Callable[[int], R]
                   ) -> dict[int, R]:
        """``send(j)`` and ``recv(j)`` for every peer j at once on the pool (each socket
        direction its own thread, so no two hosts wait on each other's reads); returns
        what ``recv`` gave by peer. Any failure aborts the mesh."""
        assert self._pool is not None
        try:
            futs_send = [self._pool.submit(send, j) for j in self.peers]
            futs_recv = {j: self._pool.submit(recv, j) for j in self.peers}
            out = {j: f.result() for j, f in futs_recv.items()}
            for f in futs_send:
                f.result()
        except BaseException:
            self._abort()
            raise
        return out

    def dispatch(self, iteration: int, chunk: int,
                 sends: Mapping[int, tuple[torch.Tensor, torch.Tensor]], *, experts: int,
                 capacity: int, width: int, layer: int
                 ) -> dict[int, tuple[list[int], torch.Tensor]]:
        """A dispatch's all-to-all, one round: to every peer j one ``TOKENS`` message of
        two parts, ``sends[j]`` = (how many rows go to each of j's ``experts`` experts, as
        int32; those rows, flat float32), and from every peer the same. The counts ride
        with the rows: a separate round of counts cost a round trip of small frames per
        dispatch, which on loaded cores was half of it (docs/linerate.md).

        What arrives is checked as it is read: the counts part's header (``experts``
        int32, part 0 of 2), every count in [0, ``capacity``] (hostile input: the counts
        size the read that follows), then the rows part's header against exactly
        sum(counts) x ``width`` elements before its payload is read. Returns each peer's
        counts and rows."""
        if self.hosts == 1:
            return {}
        assert self._pool is not None, "Mesh.dispatch before open()"
        if set(sends) != set(self.peers):
            raise ValueError(f"dispatch: sends to {sorted(sends)}, expected every peer "
                             f"{sorted(self.peers)}")
        for j, (counts, rows) in sends.items():
            if counts.numel() != experts or rows.numel() != int(counts.sum()) * width:
                raise ValueError(f"dispatch: to {j}: {counts.numel()} counts summing to "
                                 f"{int(counts.sum())} with {rows.numel()} values, expected "
                                 f"{experts} counts and {width} values per row")

        def recv(j: int) -> tuple[list[int], torch.Tensor]:
            return self._recv_counted(j, iteration, chunk, experts, capacity, width, layer)

        most_bytes = 4 * experts * (1 + capacity * width)  # the most a peer may send
        if (max(4 * (c.numel() + r.numel()) for c, r in sends.values()) <= INLINE_MAX_BYTES
                and most_bytes <= INLINE_MAX_BYTES):
            try:
                for j in self.peers:  # small frames: see exchange()
                    self._send(j, sends[j], MsgType.TOKENS, iteration, chunk)
                return {j: recv(j) for j in self.peers}
            except BaseException:
                self._abort()
                raise
        return self._both_ways(
            lambda j: self._send(j, sends[j], MsgType.TOKENS, iteration, chunk), recv)

    def _recv_counted(self, j: int, iteration: int, chunk: int, experts: int, capacity: int,
                      width: int, layer: int) -> tuple[list[int], torch.Tensor]:
        """Peer j's dispatch message (see :meth:`dispatch`): its counts, then its rows."""
        reader = self.readers[j]
        peer = f"expert host {self.me} <- {j} ({reader.peer})"
        before = reader.bytes_read
        h = reader.read_header()
        check_header(h, Expect(MsgType.TOKENS, iteration, chunk, j, DType.INT32, experts),
                     peer, part=0, nparts=2)
        counts = check_counts(reader.read_tensor(h), capacity, peer, layer)
        h = reader.read_header(boundary=False)  # EOF here truncates the message
        check_header(h, Expect(MsgType.TOKENS, iteration, chunk, j, DType.FLOAT32,
                               sum(counts) * width), peer, part=1, nparts=2)
        rows = reader.read_tensor(h)
        self.received[j] += reader.bytes_read - before
        return counts, rows

    def post(self, kind: MsgType, iteration: int, chunk: int,
             sends: Mapping[int, torch.Tensor]) -> None:
        """The sending half of an all-to-all of small frames, on the calling thread:
        ``sends[j]`` (at most :data:`INLINE_MAX_BYTES`) to every peer j. Its receiving
        half, :meth:`collect`, may come later (the frames wait in the peers' buffers)."""
        if self.hosts == 1:
            return
        assert self._pool is not None, "Mesh.post before open()"
        if set(sends) != set(self.peers):
            raise ValueError(f"post: sends to {sorted(sends)}, expected every peer "
                             f"{sorted(self.peers)}")
        big = [j for j, t in sends.items() if t.numel() * t.element_size() > INLINE_MAX_BYTES]
        if big:
            raise ValueError(f"post: frames to {big} exceed {INLINE_MAX_BYTES} bytes")
        try:
            for j in self.peers:
                self._send(j, [sends[j]], kind, iteration, chunk)
        except BaseException:
            self._abort()
            raise

    def collect(self, kind: MsgType, iteration: int, chunk: int,
                recv_numel: Mapping[int, int],
                dtype: DType = DType.FLOAT32) -> dict[int, torch.Tensor]:
        """The receiving half of an all-to-all of small frames, on the calling thread:
        from every peer j exactly ``recv_numel[j]`` elements (at most
        :data:`INLINE_MAX_BYTES` bytes) of ``dtype`` in a ``kind`` frame of this step and
        chunk."""
        if self.hosts == 1:
            return {}
        assert self._pool is not None, "Mesh.collect before open()"
        if set(recv_numel) != set(self.peers):
            raise ValueError(f"collect: receives from {sorted(recv_numel)}, expected every "
                             f"peer {sorted(self.peers)}")
        if max(recv_numel.values()) * dtype.itemsize > INLINE_MAX_BYTES:
            raise ValueError(f"collect: frames over {INLINE_MAX_BYTES} bytes")
        try:
            return {j: self._recv(j, Expect(kind, iteration, chunk, j, dtype, recv_numel[j]))
                    for j in self.peers}
        except BaseException:
            self._abort()
            raise

    def _abort(self) -> None:
        """A bad frame or a dead peer: the streams are out of sync, and other threads (here
        and on the peers) may wait forever on peers that wait on us. Shut every
        connection."""
        for s in self.socks.values():
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
