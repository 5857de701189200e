"""Shared types of the rate and ratio policies (DESIGN.md section 1.1, seeds/004).

Policies are sans-I/O, like h11's protocol core: they take reports (kernel rate samples,
bandwidth steps, membership changes) and return decisions (keep ratios, rate caps). They
read no clock, open no socket and run no command; the worker applies a keep ratio to its
next chunks and the controller turns caps into ``tc class change`` or
``SO_MAX_PACING_RATE``. That is what lets every policy be unit-tested with synthetic
reports and a fake clock.

Two families share this module:

- a :class:`RatioPolicy` decides, per worker and per chunk, the fraction of the remaining
  gradient to send (``fixed``, ``adaptive``, ``oracle``; see ``make_ratio_policy``);
- a :class:`RatePolicy` decides per-worker sending caps from B(t) and the active set
  (``linkn``, ``none``; see ``make_rate_policy``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from agents.core.registry import RATE_POLICY, RATIO_POLICY, Registry

# Registries filled by each policy module's decorator (one file per policy); built by name.
RATIO_POLICIES: Registry[Any] = Registry(RATIO_POLICY)
RATE_POLICIES: Registry[Any] = Registry(RATE_POLICY)

_T = TypeVar("_T")


def register_ratio_policy(name: str) -> Callable[[_T], _T]:
    """Class decorator: make a ratio policy constructible by ``name``. The class also
    gives ``from_config(cfg, ctx)`` (how the worker builds it from an experiment config)
    and the class attributes ``decides_in_flight`` and ``follows_bandwidth``."""
    return RATIO_POLICIES.register(name)


def register_rate_policy(name: str) -> Callable[[_T], _T]:
    """Class decorator: make a rate (cap) policy constructible by ``name``; its
    constructor takes ``bottleneck_mbps``, ``workers``, ``worker_link_mbps`` and
    ``headroom`` (see :class:`RatePolicy`)."""
    return RATE_POLICIES.register(name)


@dataclass(frozen=True)
class RatioContext:
    """What a worker knows when it builds its ratio policy, beyond the config.

    ``gradient_bytes`` is the dense float32 gradient; ``planned_bps`` this worker's planned
    TCP payload rate (its share of the nominal bottleneck); ``workers`` the active N;
    ``trace_start_ns`` when the controller's trace replay started (trace time 0);
    ``worker`` this worker's rank (``compress.worker_ratios`` is indexed by it).
    """

    gradient_bytes: int
    planned_bps: float
    workers: int
    trace_start_ns: int = 0
    worker: int = 0


def check_sent(size_bytes: int, sent_bytes: int) -> int:
    """Validate a policy's ``sent_bytes`` against the iteration's size; returns remaining."""
    if size_bytes <= 0:
        raise RuntimeError("keep_for_next_chunk before start()")
    if not (0 <= sent_bytes <= size_bytes):
        raise ValueError(f"sent_bytes={sent_bytes}: must be in [0, {size_bytes}]")
    return size_bytes - sent_bytes


@dataclass(frozen=True)
class RateReport:
    """One kernel rate sample of one worker's transfer (from ``TCP_INFO``).

    ``delivery_rate_bps`` is the kernel's ``tcpi_delivery_rate`` in bit/s; ``rate_bps`` is
    the rate from ``tcpi_bytes_acked`` deltas when the sampler has one (the preferred
    signal: it averages over the sampling interval instead of one ACK's worth).
    """

    worker: int
    ts_ns: int
    bytes_acked: int
    delivery_rate_bps: float
    rate_bps: float | None = None
    iteration: int = -1
    rtt_us: int | None = None
    cwnd_pkts: int | None = None
    total_retrans: int | None = None

    @property
    def best_rate_bps(self) -> float:
        """The bytes_acked-delta rate if known, else the kernel's delivery rate."""
        return self.rate_bps if self.rate_bps is not None else self.delivery_rate_bps


@dataclass(frozen=True)
class Decision:
    """One keep-ratio decision, logged as the ``decision`` event.

    ``keep`` is the fraction of the *remaining* chunks to send (the ratio handed to top-k);
    ``overall_keep`` is the fraction of the whole gradient this iteration that ends up sent,
    counting the ``sent_bytes`` already gone at full size. The unsent rest goes to the
    error-feedback residual (DESIGN.md 1.2): delayed, never lost.
    """

    r0_bps: float | None
    rt_bps: float | None
    sent_bytes: int
    remaining_bytes: int
    keep: float
    reason: str
    overall_keep: float = 1.0
    ts_ns: int | None = None

    def as_event(self) -> dict[str, object]:
        """The ``decision`` event's fields (agents/core/events.py schema)."""
        return {"r0_bps": self.r0_bps, "rt_bps": self.rt_bps, "sent_bytes": self.sent_bytes,
                "remaining_bytes": self.remaining_bytes, "keep": self.keep,
                "overall_keep": self.overall_keep, "reason": self.reason}


@runtime_checkable
class RatioPolicy(Protocol):
    """Per worker, per iteration: ``start`` once, ``observe`` each kernel rate sample, and
    ``keep_for_next_chunk`` before each chunk is compressed."""

    name: str

    def start(self, size_bytes: int, r0_bps: float | None = None, ts_ns: int = 0) -> None:
        """A new iteration with ``size_bytes`` of gradient; ``r0_bps`` is the rate as the
        transfer starts (None: take the first observed sample)."""
        ...

    def observe(self, rate_bps: float, ts_ns: int) -> None:
        """One rate sample r(t) of this worker's transfer."""
        ...

    def keep_for_next_chunk(self, sent_bytes: int) -> Decision:
        """The keep ratio for the chunks not yet sent, given ``sent_bytes`` already sent."""
        ...


@dataclass(frozen=True)
class CapChange:
    """Cap ``worker``'s sending rate at ``rate_mbps`` (None: remove the cap)."""

    worker: int
    rate_mbps: float | None


@runtime_checkable
class RatePolicy(Protocol):
    """Per-worker sending caps from the bottleneck rate and the set of active workers.
    Each method returns only the caps that changed."""

    name: str

    def initial(self) -> list[CapChange]:
        """The caps to install before the run starts."""
        ...

    def on_bandwidth(self, bottleneck_mbps: float) -> list[CapChange]: ...

    def on_leave(self, worker: int) -> list[CapChange]: ...

    def on_join(self, worker: int) -> list[CapChange]: ...

    def caps(self) -> dict[int, float]: ...
