"""Print a schedule as a stage x time grid (as ``torch.distributed.pipelining`` does).

Each column is one unit of time of a unit-cost simulation (forward = backward =
recompute = 1, free links): a cell holds the compute action a stage runs then, ``.`` when
it idles. Sends, receives and optimizer steps take no time there and are not shown.
"""

from __future__ import annotations

from agents.core.schedules.actions import COMPUTE_KINDS, Schedule
from agents.core.schedules.simulate import Costs, simulate


def grid(sch: Schedule) -> list[list[str]]:
    res = simulate(sch, Costs())
    width = int(round(res.wall_s))
    rows = [["."] * width for _ in range(sch.stages)]
    for iv in res.timeline:
        if iv.action.kind in COMPUTE_KINDS:
            for t in range(int(round(iv.start_s)), int(round(iv.end_s))):
                rows[iv.stage][t] = str(iv.action)
    return rows


def format_grid(sch: Schedule) -> str:
    rows = grid(sch)
    cell = max([len(c) for r in rows for c in r] + [3])
    head = f"{sch.name} p={sch.stages} m={sch.micro_batches} steps={sch.steps}" + (
        " recompute" if sch.recompute else "")
    lines = [head, "t      " + " ".join(f"{t:<{cell}}" for t in range(len(rows[0])))]
    for s, r in enumerate(rows):
        lines.append(f"stage{s:<2}" + " ".join(f"{c:<{cell}}" for c in r))
    return "\n".join(lines)
