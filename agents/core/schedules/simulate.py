"""Sans-I/O simulator: runs a schedule on per-action costs and predicts its timing.

Model (the same one the stage agent runs in, minus noise):

- each stage runs its actions in order, one at a time; a compute action (F, B, R) takes
  its cost in seconds; OPT takes ``opt_s``;
- a send never blocks the stage (the agent hands it to a sender thread): the message
  leaves on the sender's access link in order, taking ``bytes * 8 / link_bps`` seconds
  once the link is free, plus ``latency_s``, then it is at the receiver (the fabric's
  switch is store-and-forward per packet, so a message crosses the two access links in
  about one transfer time; contention of two senders on one receiver's link is not
  modelled);
- a receive waits until its message has arrived.

Measured quantities, defined once (DESIGN.md 1.5):

- ``step_s`` = wall seconds from the first action to the last, divided by the steps;
- ``bubble`` (bubble/total) = ``1 - sum over stages of compute-busy seconds /
  (p * wall seconds)``; GPipe's ``(p-1)/(m+p-1)`` is this for equal costs and free links;
- ``bubble_ideal`` (Megatron's bubble/ideal) = idle / busy = ``bubble / (1 - bubble)``,
  ``(p-1)/m`` for 1F1B with equal costs;
- ``peak_inflight[s]`` = the most micro-batches whose full activations stage ``s`` held at
  once (forward or recompute done with autograd, backward not yet);
- ``peak_stashed[s]`` = the most whose input (at least) it held: with recomputation a
  forward keeps only its input until the recompute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from agents.core.schedules.actions import COMPUTE_KINDS, Action, Kind, Schedule
from agents.core.schedules.validate import ScheduleError, _message_key


@dataclass(frozen=True)
class Costs:
    """Per-action costs. ``forward_s(stage, chunk)`` etc. may differ per piece; bytes per
    message for the activation leaving and the gradient entering each (stage, chunk)."""

    forward_s: Callable[[int, int], float] = lambda s, c: 1.0
    backward_s: Callable[[int, int], float] = lambda s, c: 1.0
    recompute_s: Callable[[int, int], float] | None = None  # None: equal to the forward
    opt_s: float = 0.0
    act_bytes: Callable[[int, int], float] = lambda s, c: 0.0
    grad_bytes: Callable[[int, int], float] = lambda s, c: 0.0
    link_bps: float = float("inf")
    latency_s: float = 0.0

    @classmethod
    def uniform(cls, forward_s: float = 1.0, backward_s: float = 1.0, *,
                msg_bytes: float = 0.0, link_bps: float = float("inf"),
                latency_s: float = 0.0, opt_s: float = 0.0) -> Costs:
        return cls(forward_s=lambda s, c: forward_s, backward_s=lambda s, c: backward_s,
                   act_bytes=lambda s, c: msg_bytes, grad_bytes=lambda s, c: msg_bytes,
                   link_bps=link_bps, latency_s=latency_s, opt_s=opt_s)


@dataclass(frozen=True)
class Interval:
    stage: int
    action: Action
    start_s: float
    end_s: float


@dataclass
class SimResult:
    wall_s: float
    step_s: float
    busy_s: list[float]
    bubble: float
    bubble_per_stage: list[float]
    bubble_ideal: float
    peak_inflight: list[int]
    peak_stashed: list[int]
    timeline: list[Interval] = field(default_factory=list)


def bubble_total(busy_s: list[float], wall_s: float) -> float:
    """bubble/total = 1 - sum(compute-busy seconds) / (p * wall seconds)."""
    return 1.0 - sum(busy_s) / (len(busy_s) * wall_s) if wall_s > 0 else 0.0


@dataclass
class _Stage:
    """One stage's state as the simulator steps it."""
    ptr: int = 0  # the next action
    clock_s: float = 0.0
    link_free_s: float = 0.0  # when its outgoing link is free
    busy_s: float = 0.0
    held: int = 0  # activations held for a backward
    stashed: int = 0  # forwards without their backward yet
    peak_held: int = 0
    peak_stash: int = 0


class _Simulation:
    def __init__(self, sch: Schedule, c: Costs) -> None:
        self.sch, self.c = sch, c
        self.rec = c.recompute_s or c.forward_s
        self.stages = [_Stage() for _ in range(sch.stages)]
        self.arrival: dict[tuple[int, int, Action], float] = {}
        self.timeline: list[Interval] = []
        self.recomputed = {(s, a.mb, a.chunk) for s, acts in enumerate(sch.actions)
                           for a in acts if a.kind is Kind.RECOMPUTE}

    def step(self, s: int, a: Action) -> bool:
        """Run stage ``s``'s action ``a`` if it can start (False: it waits on a message)."""
        st, c = self.stages[s], self.c
        start = end = st.clock_s
        if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
            key = _message_key(self.sch, s, a)
            if key is None or key not in self.arrival:
                return False
            start = end = max(start, self.arrival[key])
        elif a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
            key = _message_key(self.sch, s, a)
            assert key is not None
            size = (c.act_bytes(s, a.chunk) if a.kind is Kind.SEND_ACT
                    else c.grad_bytes(s, a.chunk))
            depart = max(start, st.link_free_s)
            st.link_free_s = depart + size * 8 / c.link_bps
            self.arrival[key] = st.link_free_s + c.latency_s
            self.timeline.append(Interval(s, a, depart, st.link_free_s))
        else:
            end = start + self.compute(s, a)
            self.timeline.append(Interval(s, a, start, end))
        st.clock_s = end
        st.ptr += 1
        return True

    def compute(self, s: int, a: Action) -> float:
        """A compute action's duration, and what it holds in memory."""
        st, c = self.stages[s], self.c
        cost = {Kind.FORWARD: c.forward_s, Kind.BACKWARD: c.backward_s,
                Kind.RECOMPUTE: self.rec}.get(a.kind)
        dur = cost(s, a.chunk) if cost is not None else c.opt_s
        if a.kind in COMPUTE_KINDS:
            st.busy_s += dur
        if a.kind is Kind.FORWARD:
            st.stashed += 1
            # A forward that will be recomputed keeps only its input.
            st.held += 0 if (s, a.mb, a.chunk) in self.recomputed else 1
        elif a.kind is Kind.RECOMPUTE:
            st.held += 1
        elif a.kind is Kind.BACKWARD:
            st.stashed -= 1
            st.held -= 1
        st.peak_held = max(st.peak_held, st.held)
        st.peak_stash = max(st.peak_stash, st.stashed)
        return dur

    def run(self) -> None:
        acts = self.sch.actions
        left = sum(len(a) for a in acts)
        while left:
            progressed = False
            for s, st in enumerate(self.stages):
                while st.ptr < len(acts[s]) and self.step(s, acts[s][st.ptr]):
                    left -= 1
                    progressed = True
            if not progressed:
                raise ScheduleError("simulate: deadlock (validate the schedule first): " +
                                    "; ".join(f"stage {s} at {acts[s][st.ptr]}"
                                              for s, st in enumerate(self.stages)
                                              if st.ptr < len(acts[s])))


def simulate(sch: Schedule, costs: Costs | None = None) -> SimResult:
    sim = _Simulation(sch, costs or Costs())
    sim.run()
    timeline = sim.timeline
    clock = [st.clock_s for st in sim.stages]
    busy = [st.busy_s for st in sim.stages]
    peak_held = [st.peak_held for st in sim.stages]
    peak_stash = [st.peak_stash for st in sim.stages]
    wall = max(clock) if clock else 0.0
    t0 = min((iv.start_s for iv in timeline if iv.action.kind in COMPUTE_KINDS), default=0.0)
    wall -= t0
    per_stage = [1.0 - b / wall if wall > 0 else 0.0 for b in busy]
    bub = bubble_total(busy, wall)
    return SimResult(wall_s=wall, step_s=wall / sch.steps, busy_s=busy, bubble=bub,
                     bubble_per_stage=per_stage,
                     bubble_ideal=bub / (1 - bub) if bub < 1 else float("inf"),
                     peak_inflight=peak_held, peak_stashed=peak_stash, timeline=timeline)

