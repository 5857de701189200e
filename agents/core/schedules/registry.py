"""Pipeline schedules registered by name, one file each (``@register("gpipe")``), in the one
registry type every kind uses (:class:`agents.core.registry.Registry`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agents.core.registry import SCHEDULE, Registry
from agents.core.schedules.actions import Schedule

ScheduleFactory = Callable[..., Schedule]
SCHEDULES: Registry[ScheduleFactory] = Registry(SCHEDULE)


def register(name: str) -> Callable[[ScheduleFactory], ScheduleFactory]:
    """Decorator: ``@register("1f1b") def one_f_one_b(stages, micro_batches, steps, ...)``."""
    return SCHEDULES.register(name)


def names() -> list[str]:
    return list(SCHEDULES.names())


def make(name: str, stages: int, micro_batches: int, steps: int = 1,
         recompute: bool = False, **params: Any) -> Schedule:
    """Build the schedule registered as ``name``. Raises ValueError naming the known ones."""
    fn = SCHEDULES.get(name, "pipeline.schedule")
    if stages < 1 or micro_batches < 1 or steps < 1:
        raise ValueError(f"schedule {name}: stages={stages}, micro_batches={micro_batches}, "
                         f"steps={steps}: each must be >= 1")
    return fn(stages, micro_batches, steps, recompute, **params)
