"""Pipeline schedules as pure data (DESIGN.md 1.3): actions, registered schedules (GPipe,
1F1B, the two-group schedule), a validator, a sans-I/O simulator and a grid printer.

Adding a schedule is one file with ``@register("name")`` in this package; the registry
imports every module of it before a name is looked up.
"""

from agents.core.schedules.actions import Action, Kind, Schedule
from agents.core.schedules.grid import format_grid, grid
from agents.core.schedules.registry import make, names
from agents.core.schedules.simulate import Costs, SimResult, bubble_total, simulate
from agents.core.schedules.validate import ScheduleError, validate

__all__ = ["Action", "Costs", "Kind", "Schedule", "ScheduleError", "SimResult",
           "bubble_total", "format_grid", "grid", "make", "names", "simulate", "validate"]
