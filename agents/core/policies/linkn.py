"""Link/N rate shaping of seeds/004 (DESIGN.md section 1.1), sans-I/O.

Every active worker's sending rate toward the switch is capped at ``B(t) / N(t)``: B is the
bottleneck rate (it moves when a trace step is replayed), N the number of workers currently
taking part (it moves when one leaves or joins). Without caps, N TCP flows into one drop-tail
bottleneck are unfair and bursty (incast); with them each flow is limited upstream of the
queue. This module only computes caps; the controller enforces them with an HTB class on the
worker's egress (``tc class change``) or ``SO_MAX_PACING_RATE``, as the config says.
"""

from __future__ import annotations

from collections.abc import Iterable

from agents.core.policies.base import CapChange, register_rate_policy


def linkn_caps(bottleneck_mbps: float, active_workers: Iterable[int], *,
               worker_link_mbps: float | None = None, headroom: float = 1.0,
               min_cap_mbps: float = 0.0) -> dict[int, float]:
    """``{worker: cap_mbps}`` for each active worker: ``headroom * B / N``, no more than the
    worker's own link, no less than ``min_cap_mbps``. Inactive workers are absent.

    ``headroom`` < 1 leaves the bottleneck queue some slack (less queueing, less
    utilisation); > 1 lets workers overshoot their share.
    """
    active = frozenset(active_workers)
    if not bottleneck_mbps >= 0.0:
        raise ValueError(f"bottleneck_mbps={bottleneck_mbps}: must be >= 0")
    if not headroom > 0.0:
        raise ValueError(f"headroom={headroom}: must be > 0")
    if worker_link_mbps is not None and not worker_link_mbps > 0.0:
        raise ValueError(f"worker_link_mbps={worker_link_mbps}: must be > 0")
    if not active:
        return {}
    cap = headroom * bottleneck_mbps / len(active)
    if worker_link_mbps is not None:
        cap = min(cap, worker_link_mbps)
    cap = max(cap, min_cap_mbps)
    return {w: cap for w in sorted(active)}


def membership_at(iteration: int, schedule: Iterable[tuple[int, int, int | None]],
                  workers: int | Iterable[int]) -> frozenset[int]:
    """The workers taking part in ``iteration``.

    ``schedule`` holds ``(worker, leave_iter, rejoin_iter or None)``: the worker is absent
    for ``leave_iter <= iteration < rejoin_iter`` (forever when rejoin is None). A worker
    may appear more than once for several absences. ``workers`` is the full set (an int n
    means ``range(n)``).
    """
    everyone = frozenset(range(workers)) if isinstance(workers, int) else frozenset(workers)
    absent: set[int] = set()
    for k, entry in enumerate(schedule):
        worker, leave, rejoin = entry
        if worker not in everyone:
            raise ValueError(f"schedule[{k}]: worker {worker} is not one of {sorted(everyone)}")
        if leave < 0:
            raise ValueError(f"schedule[{k}]: leave_iter={leave} must be >= 0")
        if rejoin is not None and rejoin <= leave:
            raise ValueError(f"schedule[{k}]: rejoin_iter={rejoin} must be after "
                             f"leave_iter={leave}")
        if leave <= iteration and (rejoin is None or iteration < rejoin):
            absent.add(worker)
    return everyone - absent


@register_rate_policy("linkn")
class LinkNShaper:
    """Tracks B(t) and the active set and reports only the caps that changed.

    The caps of departed workers are left as they were (nothing is sent through them); a
    worker that rejoins gets a fresh cap in the changes of :meth:`on_join`.
    """

    name = "linkn"

    def __init__(self, bottleneck_mbps: float, workers: int | Iterable[int], *,
                 worker_link_mbps: float | None = None, headroom: float = 1.0,
                 min_cap_mbps: float = 0.01) -> None:
        # min_cap_mbps: HTB refuses a zero rate, and a trace outage (B = 0) must still map
        # to a valid tc command.
        self.bottleneck_mbps = float(bottleneck_mbps)
        self.worker_link_mbps = worker_link_mbps
        self.headroom = headroom
        self.min_cap_mbps = min_cap_mbps
        self.active: frozenset[int] = (frozenset(range(workers)) if isinstance(workers, int)
                                       else frozenset(workers))
        self._caps: dict[int, float] = {}

    def _compute(self) -> dict[int, float]:
        return linkn_caps(self.bottleneck_mbps, self.active,
                          worker_link_mbps=self.worker_link_mbps, headroom=self.headroom,
                          min_cap_mbps=self.min_cap_mbps)

    def _diff(self) -> list[CapChange]:
        new = self._compute()
        changes = [CapChange(w, cap) for w, cap in new.items() if self._caps.get(w) != cap]
        self._caps.update(new)
        return changes

    def initial(self) -> list[CapChange]:
        """The caps to install before the run starts."""
        self._caps = {}
        return self._diff()

    def caps(self) -> dict[int, float]:
        """Current caps of the active workers."""
        return {w: self._caps[w] for w in sorted(self.active) if w in self._caps}

    def on_bandwidth(self, bottleneck_mbps: float) -> list[CapChange]:
        if not bottleneck_mbps >= 0.0:
            raise ValueError(f"bottleneck_mbps={bottleneck_mbps}: must be >= 0")
        self.bottleneck_mbps = float(bottleneck_mbps)
        return self._diff()

    def on_leave(self, worker: int) -> list[CapChange]:
        if worker not in self.active:
            raise ValueError(f"worker {worker} leaves but is not active "
                             f"(active: {sorted(self.active)})")
        self.active = self.active - {worker}
        return self._diff()

    def on_join(self, worker: int) -> list[CapChange]:
        if worker in self.active:
            raise ValueError(f"worker {worker} joins but is already active")
        self.active = self.active | {worker}
        self._caps.pop(worker, None)  # a rejoining worker always gets its cap re-applied
        return self._diff()


@register_rate_policy("none")
class NoShaper:
    """The unshaped baseline: plain TCP into the bottleneck, no caps ever."""

    name = "none"

    def __init__(self, bottleneck_mbps: float = 0.0, workers: int | Iterable[int] = 0,
                 **_ignored: object) -> None:
        self.active: frozenset[int] = (frozenset(range(workers)) if isinstance(workers, int)
                                       else frozenset(workers))

    def initial(self) -> list[CapChange]:
        return []

    def caps(self) -> dict[int, float]:
        return {}

    def on_bandwidth(self, bottleneck_mbps: float) -> list[CapChange]:
        return []

    def on_leave(self, worker: int) -> list[CapChange]:
        self.active = self.active - {worker}
        return []

    def on_join(self, worker: int) -> list[CapChange]:
        self.active = self.active | {worker}
        return []
