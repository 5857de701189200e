"""A worker's own uplink rate, timed by the kernel as its upload leaves the shaper
(sans-I/O).

The adaptive keep ratio (DESIGN.md 1.1, seeds/004) needs the rate of *this worker's* link.
Three earlier estimates did not give it on ``configs/heterogeneous.toml`` (docs/fidelity.md):
``bytes_acked`` deltas ``sample_ms`` apart while the gradient is written see no second
reading on a short compressed upload; the ACK clock of a whole upload reads whatever paced
the bytes (the link, but also a slow writer, a congestion window smaller than the upload, a
delayed last ACK), so fast workers read far below their link and cut for nothing; and
``TCP_INFO`` readings polled around the upload were taken when a Python thread got the CPU
back, which on a busy machine was after the queue had drained (2 samples in 97 uploads).

**What the kernel tells.** gradbed's uplink shaper is the HTB on the worker's own
interface. With ``SO_TIMESTAMPING`` (``TX_SCHED``, ``TX_SOFTWARE``, ``OPT_ID``) the kernel
stamps the last byte of every write twice: when its packet entered the interface's qdisc
(``sched_ns``) and when the qdisc handed it to the driver (``snd_ns``), keyed by the byte's
offset in the stream (:class:`TxStamp`). No thread has to be awake at either moment.

**When the link alone set the pace.** HTB lets a packet go as soon as its class has
tokens (``tokens >= 0``) and charges it afterwards, so after an idle spell the bucket's
credit lets the first bytes through at once, and from then on every packet leaves at the
moment the tokens paid for the packet before it have been earned back at the link's rate.
A packet that *waited* in the shaper (``snd_ns - sched_ns >= wait_min_ns``) was released by
that clock: it found the tokens spent. A packet that did not wait left as soon as it was
written: the writer (CPU, compression between chunks), TCP's window or the bucket's credit
set that moment, and it says nothing about the rate.

**Waiting is not enough: the writer must have been ahead.** A packet also waits when the
qdisc itself runs late (its softirq deferred, a core waking from idle): measured on a quiet
2-core VM, a single 5 KB write on an idle 100 Mbit/s link waited 15-70 us between the two
stamps, with the bucket full. Two such waits, on consecutive writes 3 ms apart, read as a
run of 5 KB in 3 ms: an 11 Mbit/s "link" where a writer slower than its link left it idle
(tests/topo/test_drain_mininet.py's slow writer read 9-11 Mbit/s so in about half of its
runs on a quiet machine). The stamps alone
cannot tell that pair from a real 11 Mbit/s link whose writer kept pace with it: both
give the same four times. What tells them apart is whether the data waited: on a link
that set the pace, the bytes after a departing packet were already in the kernel (in the
qdisc or, held back by TCP Small Queues, in the socket) when it left. So two consecutive
waited stamps ``x-1, x`` belong to one run only if the write holding byte ``key_{x-1} + 1``
was begun (:class:`WriteStart`) no later than ``snd_{x-1}``; otherwise the link may have
idled between them, waiting for the writer, and the run breaks there. A writer exactly
keeping pace with its link gives no sample that way either, which errs on the side the
estimate is for (no sample leaves the keep as it is).

Over the longest run of consecutive stamps ``a .. b`` (key order) whose packets all waited,
with the writer ahead at every step, the tokens were spent at both ends, and what was paid
for between ``snd_a`` and ``snd_b`` is
every byte from the start of ``a``'s packet to the start of ``b``'s. A stamped packet holds
its key and at most ``packet_bytes`` (the sender's GSO packet: segments x MSS), and no
earlier stamped key. While the shaper holds the flow back, TCP Small Queues keep the writes
in the socket, and a write is appended to the packet being built there: a packet keeps the
key of the last write that ends in it (the earlier ones are never stamped), and when a
write ends inside a packet that the next write fills, the key sits inside its packet. So
the packet's start is taken as

    start_x = max(key_{x-1}, key_x - packet_bytes) + 1
    queued_departure_rate_bps = 8 x (start_b - start_a) / (snd_b - snd_a)

with ``key_{-1} = first_key - 1`` for the upload's first stamp (``first_key``: the first
write's). Where packets end at their
keys it is exact for writes of one packet each and for writes of one size; each end is
otherwise off by less than one packet: measured in Mininet, w0's 3.6 KB writes on a
10 Mbit/s uplink of one-segment packets with a 30 ms RTT read 7 % high over 10 KB runs
(tests/topo/test_drain_mininet.py).
Taking the previous key as the start alone (this module before 2026-11-26) counts a
stamped write merged with others, or spanning several packets, as one packet's worth.
With the bottleneck's 8-segment packets on w0's traced uplink (topo.spec gives it one
segment now) it read a real 10 Mbit/s upload as 2.1-4.3 Mbit/s, and the conservative
estimate below held that for the rest of the run: w0 sent 2 % of its gradient.

**The estimate the keep is planned on** (:func:`conservative_rate_bps`) is the minimum of
the last ``window`` samples, carried across iterations: a dip lowers the keep from the next
upload on and holds it for ``window`` uploads, so the worker under-sends rather than
over-sends while its link wanders (the p99 target is about the dips). An upload whose
packets never waited (the link was not the limit) gives no sample and leaves the window as
it is. A minimum within ``eps`` of the plan counts as the plan itself: a flow on a link as
fast as planned reads a little either side of it, and cutting it for that would slow
training for nothing.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from agents.core.ethernet import TCP_MSS_BYTES

# A packet counts as having waited in the shaper after this long: well above the stamps'
# own jitter (microseconds), below one full-size packet's time at 200 Mbit/s.
WAIT_MIN_NS = 50_000


@dataclass(frozen=True)
class TxStamp:
    """The kernel's two transmit timestamps of one write's last byte: ``key`` is the byte's
    offset in the stream (``SOF_TIMESTAMPING_OPT_ID``), ``sched_ns`` when its packet
    entered the interface's qdisc, ``snd_ns`` when the qdisc handed it to the driver
    (both ``CLOCK_REALTIME``)."""

    key: int
    sched_ns: int
    snd_ns: int

    @property
    def wait_ns(self) -> int:
        """How long the packet waited in the qdisc (the shaper)."""
        return self.snd_ns - self.sched_ns


@dataclass(frozen=True)
class WriteStart:
    """One write of an upload: ``key`` is the offset of its first byte in the stream (the
    stamps' key space), ``ts_ns`` when the writer began handing it to the kernel
    (``CLOCK_REALTIME``, the stamps' clock)."""

    key: int
    ts_ns: int


def _begun_ns(writes: Sequence[WriteStart], keys: Sequence[int], key: int) -> int:
    """When the write holding byte ``key`` was begun (``keys``: the writes' keys)."""
    return writes[max(0, bisect_right(keys, key) - 1)].ts_ns


def queued_departure_rate_bps(stamps: Sequence[TxStamp], writes: Sequence[WriteStart],
                              wait_min_ns: int = WAIT_MIN_NS,
                              min_span_ns: int = 2_000_000,
                              min_bytes: int = 2 * TCP_MSS_BYTES,
                              packet_bytes: int = TCP_MSS_BYTES) -> float | None:
    """The shaper's rate over the longest run of consecutive stamps whose packets all waited
    in it while the writer was ahead of them, in bit/s; see the module docstring for the
    tests and the formula. ``writes`` are the upload's writes in stream order (the first
    one's key is the upload's first byte); ``packet_bytes`` the largest packet the sender
    hands its qdisc (its GSO segments x MSS). None when no run spans at least
    ``min_span_ns`` and ``min_bytes``."""
    if wait_min_ns < 0:
        raise ValueError(f"wait_min_ns={wait_min_ns}: must be >= 0")
    if packet_bytes < 1:
        raise ValueError(f"packet_bytes={packet_bytes}: must be >= 1")
    keys = [w.key for w in writes]
    for i in range(1, len(keys)):
        if keys[i] <= keys[i - 1]:
            raise ValueError(f"write {i} starts at key {keys[i]}, not after write {i - 1}'s "
                             f"{keys[i - 1]}: writes must be in stream order")
    ordered = sorted(stamps, key=lambda s: s.key)
    if not ordered:
        return None
    if not writes or ordered[0].key < keys[0]:
        raise ValueError(f"stamp key {ordered[0].key} before the upload's first byte "
                         f"{keys[0] if writes else None}")
    best: tuple[int, int] | None = None  # indices (a, b) of the longest run's ends
    start: int | None = None
    for i, stamp in enumerate(ordered):
        if stamp.wait_ns < wait_min_ns:
            start = None
            continue
        prev = ordered[i - 1]
        if (start is None or stamp.snd_ns <= prev.snd_ns
                or _begun_ns(writes, keys, prev.key + 1) > prev.snd_ns):
            # A new run: a departure out of order cannot be timed against the last one,
            # and where the next bytes were not yet written when the last packet left, the
            # link may have idled in between (the module docstring).
            start = i
            continue
        span = stamp.snd_ns - ordered[start].snd_ns
        if best is None or span > ordered[best[1]].snd_ns - ordered[best[0]].snd_ns:
            best = (start, i)
    if best is None:
        return None
    a, b = best

    def packet_start(i: int) -> int:
        before = ordered[i - 1].key if i > 0 else keys[0] - 1
        return max(before, ordered[i].key - packet_bytes) + 1

    span_ns = ordered[b].snd_ns - ordered[a].snd_ns
    size = packet_start(b) - packet_start(a)
    if span_ns < min_span_ns or size < min_bytes:
        return None
    return 8e9 * size / span_ns


def conservative_rate_bps(samples: Iterable[float], plan_bps: float,
                          eps: float) -> float | None:
    """The rate the next upload is planned on: the minimum of ``samples`` (the last few
    link rates), or ``plan_bps`` when that minimum is within ``eps`` of the plan or above
    it (a link as fast as planned is not cut). None without samples."""
    if plan_bps <= 0.0:
        raise ValueError(f"plan_bps={plan_bps}: must be > 0")
    low = min(samples, default=None)
    if low is None:
        return None
    if low < 0.0:
        raise ValueError(f"rate sample {low}: must be >= 0")
    return plan_bps if low >= (1.0 - eps) * plan_bps else low
