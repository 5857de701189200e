"""When the PS's weights went out to each worker: one span per worker per iteration.

The PS's event loop writes the new weights without blocking (:mod:`agents.net.loop`), so
their send runs beside the aggregation of later chunks and has no place in the PS's own
sequence of receive and aggregate. This bookkeeping gives it one: a send of iteration i to
worker w starts when the PS queues i's first weight chunk to w and ends when the kernel has
taken the last byte of i's last chunk (the transport's ``written_bytes`` reaches what was
queued by then). Pure: the PS says what it queued and, after every turn of its loop, hands
over the transports' byte counters; the spans that finished come back as data.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class WeightSend:
    """One finished send: ``bytes`` queued to ``worker`` for ``iteration`` between
    ``start_ns`` and ``end_ns`` (CLOCK_MONOTONIC)."""

    worker: int
    iteration: int
    start_ns: int
    end_ns: int
    bytes: int


@dataclass
class _Open:
    iteration: int
    start_ns: int
    bytes: int = 0
    #: The transport's ``queued_bytes`` after the iteration's last chunk; None before.
    until_bytes: int | None = None


class WeightSends:
    """Open sends per worker (at most one per iteration), closed as the kernel takes them."""

    def __init__(self) -> None:
        self._open: dict[int, list[_Open]] = {}

    def queued(self, worker: int, iteration: int, nbytes: int, queued_bytes: int, last: bool,
               now_ns: int) -> None:
        """``nbytes`` of ``iteration``'s weights were queued to ``worker``, whose transport
        has had ``queued_bytes`` queued in all since it opened; ``last``: the iteration's
        last chunk."""
        sends = self._open.setdefault(worker, [])
        if not sends or sends[-1].iteration != iteration:
            sends.append(_Open(iteration, now_ns))
        send = sends[-1]
        send.bytes += nbytes
        if last:
            send.until_bytes = queued_bytes

    def finished(self, written_bytes: Mapping[int, int], now_ns: int) -> list[WeightSend]:
        """The sends whose last byte the kernel has taken (``written_bytes``: each worker's
        transport's counter now), in order; they are closed."""
        done: list[WeightSend] = []
        for worker, sends in self._open.items():
            written = written_bytes.get(worker)
            while (sends and written is not None and sends[0].until_bytes is not None
                   and written >= sends[0].until_bytes):
                s = sends.pop(0)
                done.append(WeightSend(worker, s.iteration, s.start_ns, now_ns, s.bytes))
        return done

    def forget(self, worker: int) -> None:
        """A worker's connection is gone: its open sends never finish."""
        self._open.pop(worker, None)
