"""Who may start a handshake at a listening socket, and how refusals are reported: the
sans-I/O half of :func:`agents.net.handshake.accept_forever`.

A peer that has not proved its key costs the answering end a descriptor, a thread and up
to 64 KiB until its handshake ends. Without a bound per source, one keyless host that
opens a thousand slow connections holds every slot and the real agents are refused
before they start; without aggregation, each refused connection writes an event and the
flood fills the disk instead. So:

- :class:`Admission` admits a new connection only while its source has fewer than
  ``per_source`` unauthenticated connections, has opened fewer than
  ``connects_per_source_per_s`` in the current second, and a slot of the ``total`` is
  free. Each *expected* source (the address of a host that runs an agent this end waits
  for) has one slot of its own, outside the shared pool, so an expected agent always
  gets in while strangers flood, from one host or from many.
- :class:`RefusalLog` turns refusals into at most one report per (source, reason) per
  ``interval_s``, with a count: the first at once, the rest summed until the interval
  has passed. A flood then grows the log by a few lines a second, whatever its rate.

Both take the clock as an argument and do no I/O, so they are tested without sockets.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

from agents.core.guard_config import GuardConfig


@dataclass(frozen=True)
class AdmissionLimits:
    """Bounds on unauthenticated connections at one listening socket; the defaults and
    what each knob does are ``[guard]``'s (:class:`agents.core.guard_config.GuardConfig`)."""

    per_source: int                 # unauthenticated connections at once per source
    total: int                      # unauthenticated connections at once, all sources
    connects_per_source_per_s: int  # new connections per source per second
    report_interval_s: float        # at most one refusal event per (source, reason)

    @classmethod
    def from_guard(cls, guard: GuardConfig) -> AdmissionLimits:
        return cls(guard.max_handshakes_per_source, guard.max_handshakes,
                   guard.max_connects_per_source_per_s, guard.refusal_report_interval_s)


@dataclass(frozen=True)
class Ticket:
    """An admitted connection's slot; hand it back to :meth:`Admission.release`."""

    source: str
    reserved: bool  # it holds its source's own slot, not one of the shared pool


class Admission:
    """Admission of unauthenticated connections (see the module docstring). Not
    thread-safe: the caller holds a lock around it."""

    #: Per-source connect counters are forgotten once this many sources are known and
    #: their second has passed, so a crowd of sources costs bounded memory.
    PRUNE_AT = 4096

    def __init__(self, limits: AdmissionLimits, expected: Collection[str] = ()) -> None:
        self.limits = limits
        self.expected = frozenset(expected)
        self.in_use: dict[str, int] = {}
        self.reserved_in_use: set[str] = set()
        # Strangers share what the expected sources' own slots leave.
        self.shared_slots = max(0, limits.total - len(self.expected))
        self.shared_in_use = 0
        self._window: dict[str, tuple[float, int]] = {}  # source -> (second began, connects)

    def expect(self, source: str) -> None:
        """Keep a slot of its own for ``source`` too (an agent started after this began:
        the control socket learns each agent's process as it starts). The shared pool
        gives the slot up, so ``total`` still bounds everything."""
        if source in self.expected:
            return
        self.expected = self.expected | {source}
        self.shared_slots = max(0, self.shared_slots - 1)

    def admit(self, source: str, now_s: float) -> Ticket | str:
        """A ticket when ``source`` may start a handshake now, else why not."""
        began, count = self._window.get(source, (now_s, 0))
        if now_s - began >= 1.0:
            began, count = now_s, 0
        count += 1
        if len(self._window) >= self.PRUNE_AT and source not in self._window:
            self._window = {s: w for s, w in self._window.items() if now_s - w[0] < 1.0}
        self._window[source] = (began, count)
        lim = self.limits
        if count > lim.connects_per_source_per_s:
            return f"more than {lim.connects_per_source_per_s} connections a second"
        held = self.in_use.get(source, 0)
        if held >= lim.per_source:
            return f"{lim.per_source} unauthenticated connections already"
        if source in self.expected and source not in self.reserved_in_use:
            self.reserved_in_use.add(source)
            ticket = Ticket(source, reserved=True)
        elif self.shared_in_use < self.shared_slots:
            self.shared_in_use += 1
            ticket = Ticket(source, reserved=False)
        else:
            return f"{lim.total} unauthenticated connections at once"
        self.in_use[source] = held + 1
        return ticket

    def release(self, ticket: Ticket) -> None:
        """The ticket's handshake ended (passed or failed): its slot is free again."""
        if ticket.reserved:
            self.reserved_in_use.discard(ticket.source)
        else:
            self.shared_in_use -= 1
        left = self.in_use.get(ticket.source, 0) - 1
        if left > 0:
            self.in_use[ticket.source] = left
        else:
            self.in_use.pop(ticket.source, None)

    @property
    def unauthenticated(self) -> int:
        """Connections admitted whose handshake has not ended."""
        return sum(self.in_use.values())


@dataclass(frozen=True)
class RefusalReport:
    """``count`` refusals of ``source`` for ``reason`` since the last report of that pair;
    ``example``: the last one's full message."""

    source: str
    reason: str
    count: int
    example: str


class RefusalLog:
    """Aggregates refusals into at most one :class:`RefusalReport` per (source, reason)
    per ``interval_s``. Not thread-safe: the caller holds a lock around it."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last: dict[tuple[str, str], float] = {}  # when the pair was last reported
        self._pending: dict[tuple[str, str], tuple[int, str]] = {}

    def note(self, source: str, reason: str, example: str, now_s: float
             ) -> list[RefusalReport]:
        """Count one refusal; returns what is due now (this one at once when its pair was
        not reported within the interval, and any other pair whose interval passed)."""
        key = (source, reason)
        count, _ = self._pending.get(key, (0, ""))
        self._pending[key] = (count + 1, example)
        return self.due(now_s)

    def due(self, now_s: float, *, everything: bool = False) -> list[RefusalReport]:
        """Reports whose interval has passed (all of them with ``everything``: at close)."""
        out = []
        for key, (count, example) in list(self._pending.items()):
            if everything or now_s - self._last.get(key, -math.inf) >= self.interval_s:
                out.append(RefusalReport(key[0], key[1], count, example))
                del self._pending[key]
                self._last[key] = now_s
        if len(self._last) > Admission.PRUNE_AT:
            self._last = {k: t for k, t in self._last.items()
                          if now_s - t < self.interval_s or k in self._pending}
        return out
