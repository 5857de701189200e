"""The kernel's transmit timestamps of a TCP upload (``SO_TIMESTAMPING``), for
``adaptive.rate_source = "drain"`` (agents/core/drain.py says what they are used for).

With ``SOF_TIMESTAMPING_TX_SCHED | TX_SOFTWARE | SOFTWARE | OPT_ID | OPT_TSONLY`` on a TCP
socket the kernel queues, on the socket's error queue, two stamps for the last byte of
every write: ``SCM_TSTAMP_SCHED`` when its packet entered the interface's qdisc and
``SCM_TSTAMP_SND`` when the qdisc handed it to the driver, each keyed (``ee_data``) by the
byte's offset counted from when the option was set (Documentation/networking/timestamping.rst).
Writes the kernel merged into one packet share the later key's stamps.

Side effects live here (setsockopt, reading the error queue); :func:`parse_stamp` is pure.

**Why a dup of the socket, read by a thread.** The worker's thread that receives the
PS's reply holds the socket in a blocking ``recv`` for most of the iteration, so the
stamps are read through a duplicate of the descriptor, with ``MSG_DONTWAIT``, by a thread
that waits for them with ``poll``. A non-empty error queue makes ``poll`` report POLLERR:
a socket with a Python timeout (which polls before every ``recv`` and ``send``) would spin
while stamps are pending, so the worker's socket uses the kernel's own timeouts instead
(``wire.set_kernel_timeouts``), and this thread empties the queue as the stamps arrive.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading

from agents.core.drain import TxStamp, WriteStart

SO_TIMESTAMPING = 37          # linux/asm-generic/socket.h (SO_TIMESTAMPING_OLD)
SOF_TIMESTAMPING_TX_SOFTWARE = 1 << 1
SOF_TIMESTAMPING_SOFTWARE = 1 << 4
SOF_TIMESTAMPING_OPT_ID = 1 << 7
SOF_TIMESTAMPING_TX_SCHED = 1 << 8
SOF_TIMESTAMPING_OPT_TSONLY = 1 << 11
FLAGS = (SOF_TIMESTAMPING_TX_SCHED | SOF_TIMESTAMPING_TX_SOFTWARE | SOF_TIMESTAMPING_SOFTWARE
         | SOF_TIMESTAMPING_OPT_ID | SOF_TIMESTAMPING_OPT_TSONLY)
SCM_TSTAMP_SND, SCM_TSTAMP_SCHED = 0, 1
SO_EE_ORIGIN_TIMESTAMPING = 4
IP_RECVERR, IPV6_RECVERR = 11, 25
# struct sock_extended_err: ee_errno u32, ee_origin u8, ee_type u8, ee_code u8, ee_pad u8,
# ee_info u32 (SCM_TSTAMP_*), ee_data u32 (the key).
_EXT_ERR = struct.Struct("=IBBBBII")
# struct scm_timestamping: three struct timespec; [0] is the software stamp.
_TIMESPEC = struct.Struct("=qq")


def parse_stamp(ancdata: list[tuple[int, int, bytes]]) -> tuple[int, int, int] | None:
    """``(kind, key, ts_ns)`` of one error-queue message's control data, or None when it
    carries no software transmit timestamp (another error, a truncated message)."""
    ts_ns = kind = key = None
    for level, ctype, data in ancdata:
        if level == socket.SOL_SOCKET and ctype == SO_TIMESTAMPING and len(data) >= 16:
            sec, nsec = _TIMESPEC.unpack_from(data, 0)
            ts_ns = sec * 1_000_000_000 + nsec
        elif ((level, ctype) in ((socket.IPPROTO_IP, IP_RECVERR),
                                 (socket.IPPROTO_IPV6, IPV6_RECVERR))
              and len(data) >= _EXT_ERR.size):
            _, origin, _, _, _, info, data_key = _EXT_ERR.unpack_from(data, 0)
            if origin == SO_EE_ORIGIN_TIMESTAMPING:
                kind, key = info, data_key
    if ts_ns is None or kind is None or key is None or ts_ns == 0:
        return None
    return kind, key, ts_ns


def pair_stamps(raw: list[tuple[int, int, int]]) -> list[TxStamp]:
    """One :class:`TxStamp` per key that got both a SCHED and an SND stamp, in key order."""
    sched: dict[int, int] = {}
    snd: dict[int, int] = {}
    for kind, key, ts_ns in raw:
        if kind == SCM_TSTAMP_SCHED:
            sched[key] = ts_ns
        elif kind == SCM_TSTAMP_SND:
            snd[key] = ts_ns
    return [TxStamp(k, sched[k], snd[k]) for k in sorted(sched.keys() & snd.keys())]


class TxStampReader:
    """Stamps every write on ``sock`` from now on; the caller reports each write, its bytes
    and when it began it (:meth:`wrote`), and after an upload :meth:`collect` returns the
    upload's stamps and :attr:`writes` its writes.

    A thread empties the error queue as the stamps arrive: a pending stamp makes ``poll``
    report POLLERR on the socket, so a timed ``send`` waiting for room in a full buffer, or
    a timed ``recv`` waiting for the reply, would spin until the queue is read."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPING, FLAGS)
        # Not setblocking(False): O_NONBLOCK belongs to the open file, which the dup
        # shares, and the worker's socket blocks in the kernel (wire.set_kernel_timeouts).
        # Each read says MSG_DONTWAIT instead.
        self._errq = socket.socket(fileno=os.dup(sock.fileno()))
        self.written = 0          # bytes written since the option was set (the key space)
        self._upload_from = 0
        self._writes: list[WriteStart] = []
        self._raw: list[tuple[int, int, int]] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tx-stamps", daemon=True)
        self._thread.start()

    def start_upload(self) -> None:
        self._upload_from = self.written
        self._writes = []

    @property
    def upload_from(self) -> int:
        """The key (stream offset) of the current upload's first byte."""
        return self._upload_from

    def wrote(self, n_bytes: int, start_ns: int) -> None:
        """``n_bytes`` were written in one write that the caller began at ``start_ns``
        (``time.time_ns()``, the stamps' clock, read before the write: the estimator asks
        whether these bytes were already waiting when an earlier packet left)."""
        if n_bytes > 0:
            self._writes.append(WriteStart(self.written, start_ns))
        self.written += n_bytes

    @property
    def writes(self) -> list[WriteStart]:
        """The current upload's writes, in stream order."""
        return list(self._writes)

    def _read(self) -> list[tuple[int, int, int]]:
        out: list[tuple[int, int, int]] = []
        while True:
            try:
                _, anc, _, _ = self._errq.recvmsg(0, 1024,
                                                  socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return out
            stamp = parse_stamp(anc)
            if stamp is not None:
                out.append(stamp)

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._errq, select.POLLPRI)  # POLLERR and POLLHUP come regardless
        while not self._closed:
            try:
                events = poller.poll(200)
                got = self._read() if events else []
            except OSError:
                break  # the descriptor went away (close)
            if got:
                with self._cv:
                    self._raw += got
                    self._cv.notify_all()
            elif any(ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL)
                     for _, ev in events):
                break  # an error or hang-up that is not a stamp: the connection is done
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def collect(self, limit_s: float = 5.0) -> list[TxStamp]:
        """Wait (at most ``limit_s``) until the upload's last byte left the qdisc, then
        return the stamps of the upload's writes, in key order, and forget them."""
        last = self.written - 1
        with self._cv:
            if last >= self._upload_from:
                self._cv.wait_for(lambda: self._closed or any(
                    k == SCM_TSTAMP_SND and key >= last for k, key, _ in self._raw),
                    timeout=limit_s)
            raw, self._raw = self._raw, []
        return [s for s in pair_stamps(raw) if s.key >= self._upload_from]

    def close(self) -> None:
        self._closed = True
        self._thread.join(timeout=1.0)
        self._errq.close()
