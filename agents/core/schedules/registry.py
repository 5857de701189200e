"""Schedules registered by name (one file per schedule)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agents.core.schedules.actions import Schedule

ScheduleFactory = Callable[..., Schedule]
_REGISTRY: dict[str, ScheduleFactory] = {}


def register(name: str) -> Callable[[ScheduleFactory], ScheduleFactory]:
    def deco(fn: ScheduleFactory) -> ScheduleFactory:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"schedule name {name!r} registered twice")
        _REGISTRY[name] = fn
        return fn
    return deco


def names() -> list[str]:
    return sorted(_REGISTRY)


def make(name: str, stages: int, micro_batches: int, steps: int = 1,
         recompute: bool = False, **params: Any) -> Schedule:
    """Build the schedule registered as ``name``. Raises ValueError naming the known ones."""
    fn = _REGISTRY.get(name)
    if fn is None:
        raise ValueError(f"schedule {name!r}: unknown; known: {', '.join(names())}")
    if stages < 1 or micro_batches < 1 or steps < 1:
        raise ValueError(f"schedule {name}: stages={stages}, micro_batches={micro_batches}, "
                         f"steps={steps}: each must be >= 1")
    return fn(stages, micro_batches, steps, recompute, **params)
