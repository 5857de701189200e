"""Downlink link/N pacing of the PS's worker sockets (``shaping.method = "pacing"``).

The controller's ``pace`` commands set each worker's share B_down/N; with
``shaping.downlink = "backlog"`` the PS's event loop re-splits the sum of those shares
every ``REBALANCE_S`` among the active connections in proportion to their undelivered
bytes (:func:`agents.core.policies.backlog.backlog_shares`), so a connection that fell
behind catches up instead of holding the iteration back (docs/architecture.md). This
module owns the rates; the sockets are the PS's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agents.core.events import EventLog
from agents.core.policies.backlog import backlog_shares
from agents.net.loop import Transport
from agents.net.pacing import clear_max_pacing_rate, set_max_pacing_rate

# How often the downlink pacing is re-split by backlog (shaping.downlink = "backlog").
REBALANCE_S = 0.02
# A socket's rate is only touched when the split moves it by more than this fraction.
RATE_SLACK = 0.02


class DownlinkPacer:
    """Each worker's downlink pacing rate: what the controller asked for (``pacing_bps``)
    and what each socket is paced at now (``applied_bps``). ``rebalanced`` counts the
    socket changes the backlog split made since the PS last reset it."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.pacing_bps: dict[int, float] = {}  # link/N on the downlink, per worker
        self.applied_bps: dict[int, float] = {}  # what each socket is paced at now
        self.rebalanced = 0

    def apply_commands(self, commands: list[dict[str, Any]], conns: Mapping[int, Transport],
                       iteration: int) -> None:
        """Controller commands: ``pace`` caps the PS's socket to one worker."""
        for cmd in commands:
            if cmd.get("type") != "pace":
                continue
            w, rate = int(cmd["worker"]), float(cmd.get("rate_bps") or 0)
            if rate > 0:
                self.pacing_bps[w] = rate
            else:
                self.pacing_bps.pop(w, None)
            self.pace(w, conns.get(w), iteration)

    def pace(self, w: int, conn: Transport | None, iteration: int) -> None:
        """Pace worker ``w``'s socket at its asked-for rate (or clear it)."""
        if conn is None:
            return
        rate = self.pacing_bps.get(w)
        try:
            if rate:
                set_max_pacing_rate(conn.sock, rate)
                self.applied_bps[w] = rate
            else:
                clear_max_pacing_rate(conn.sock)
                self.applied_bps.pop(w, None)
        except OSError as e:
            self.log.emit("frame_error", iter=iteration, peer=conn.peer,
                          error=f"pacing failed: {e}")
            return
        self.log.emit("paced", iter=iteration, worker=w, rate_bps=rate or 0)

    def rebalance(self, conns: Mapping[int, Transport], active: set[int]) -> dict[int, float]:
        """Re-split the controller's B_down (the sum of the paced workers' B_down/N) among
        the active paced connections in proportion to their undelivered bytes. Sockets
        are only touched when their rate moves by more than ``RATE_SLACK``. Returns the
        split (empty with fewer than two paced connections)."""
        paced = dict(self.pacing_bps)
        live = {w: c for w, c in dict(conns).items()
                if w in paced and w in active and not c.closed}
        if len(live) < 2:
            return {}
        rates = backlog_shares(sum(paced[w] for w in live),
                               {w: c.backlog_bytes() for w, c in live.items()})
        for w, rate in rates.items():
            old = self.applied_bps.get(w)
            if old is not None and abs(rate - old) <= RATE_SLACK * old:
                continue
            try:
                set_max_pacing_rate(live[w].sock, rate)
            except OSError:
                continue  # closed under us: the event loop reports it
            self.applied_bps[w] = rate
            self.rebalanced += 1
        return rates
