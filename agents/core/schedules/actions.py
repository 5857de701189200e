"""Pipeline-schedule actions and the schedule type: pure data (DESIGN.md 1.3).

A schedule is, per stage, an ordered list of :class:`Action`. Each action is a small named
tuple ``(kind, mb, chunk)`` that round-trips through a short string, in the spirit of
``torch.distributed.pipelining``'s ``"2F0"`` notation (here the stage is the list's index):

===========  =====================================================  ==========
kind         meaning                                                string
===========  =====================================================  ==========
``F``        forward of micro-batch ``mb`` through chunk ``chunk``  ``F3``
``B``        backward of the same                                   ``B3``
``R``        recompute the forward (activation recomputation)       ``R3``
``SA``       send the forward's output activation downstream        ``SA3``
``RA``       receive the forward's input activation from upstream   ``RA3``
``SG``       send the gradient of the chunk's input upstream        ``SG3``
``RG``       receive the gradient of the chunk's output             ``RG3``
``OPT``      optimizer step of step ``mb`` (here ``mb`` is a step)  ``OPT0``
===========  =====================================================  ==========

A non-zero chunk is written after a dot: ``F3.1`` is micro-batch 3's forward through chunk
1 (sub-model B of the two-group schedule). Micro-batch ids are global: step ``k``'s
micro-batches are ``k*m .. k*m+m-1``, so one list can hold several steps.

Positions: the model is cut into ``chunks * stages`` consecutive pieces. Chunk ``c`` of stage
``s`` is piece (pipeline position) ``c * stages + s``: with one chunk that is the usual line
of stages; with two chunks the data goes round the stages twice (A_0..A_{p-1}, B_0..B_{p-1}),
as the two-group schedule's slices do. Position 0 reads the data; the last position computes
the loss, so its backward needs no received gradient.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple


class Kind(StrEnum):
    FORWARD = "F"
    BACKWARD = "B"
    RECOMPUTE = "R"
    SEND_ACT = "SA"
    RECV_ACT = "RA"
    SEND_GRAD = "SG"
    RECV_GRAD = "RG"
    OPTIMIZER = "OPT"


COMPUTE_KINDS = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.RECOMPUTE})
_PATTERN = re.compile(r"^(OPT|SA|RA|SG|RG|F|B|R)(\d+)(?:\.(\d+))?$")


class Action(NamedTuple):
    kind: Kind
    mb: int  # global micro-batch id; for OPT, the step
    chunk: int = 0

    def __str__(self) -> str:
        tail = f".{self.chunk}" if self.chunk else ""
        return f"{self.kind.value}{self.mb}{tail}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``"F3"``, ``"SG12.1"``, ``"OPT0"``. Raises ValueError."""
        m = _PATTERN.match(text.strip())
        if m is None:
            raise ValueError(f"action {text!r}: expected KIND MB[.CHUNK] with KIND one of "
                             f"{', '.join(k.value for k in Kind)}, e.g. 'F3' or 'B3.1'")
        return cls(Kind(m.group(1)), int(m.group(2)), int(m.group(3) or 0))


def F(mb: int, chunk: int = 0) -> Action:
    return Action(Kind.FORWARD, mb, chunk)


def B(mb: int, chunk: int = 0) -> Action:
    return Action(Kind.BACKWARD, mb, chunk)


def R(mb: int, chunk: int = 0) -> Action:
    return Action(Kind.RECOMPUTE, mb, chunk)


def SA(mb: int, chunk: int = 0) -> Action:
    return Action(Kind.SEND_ACT, mb, chunk)


def RA(mb: int, chunk: int = 0) -> Action:
    return Action(Kind.RECV_ACT, mb, chunk)


def SG(mb: int, chunk: int = 0) -> Action:
    return Action(Kind.SEND_GRAD, mb, chunk)


def RG(mb: int, chunk: int = 0) -> Action:
    return Action(Kind.RECV_GRAD, mb, chunk)


def OPT(step: int, chunk: int = 0) -> Action:
    return Action(Kind.OPTIMIZER, step, chunk)


@dataclass(frozen=True)
class Schedule:
    """Per stage, the ordered actions of ``steps`` training steps of ``micro_batches`` each.

    ``stale_chunks``: chunks whose weights are updated one step late (PipeDream-2BW): step
    ``k``'s forwards through such a chunk may start before step ``k-1``'s optimizer step and
    use the version from before it (the validator checks ``OPT(k-2)`` precedes them
    instead of ``OPT(k-1)``). Empty for the synchronous schedules.
    """

    name: str
    stages: int
    micro_batches: int
    steps: int
    chunks: int
    actions: tuple[tuple[Action, ...], ...]
    recompute: bool = False
    stale_chunks: tuple[int, ...] = ()

    @property
    def positions(self) -> int:
        return self.chunks * self.stages

    def position(self, stage: int, chunk: int) -> int:
        return chunk * self.stages + stage

    def place(self, position: int) -> tuple[int, int]:
        """(stage, chunk) holding pipeline position ``position``."""
        return position % self.stages, position // self.stages

    def downstream(self, stage: int, chunk: int) -> tuple[int, int] | None:
        pos = self.position(stage, chunk) + 1
        return None if pos >= self.positions else self.place(pos)

    def upstream(self, stage: int, chunk: int) -> tuple[int, int] | None:
        pos = self.position(stage, chunk) - 1
        return None if pos < 0 else self.place(pos)

    def step_of(self, mb: int) -> int:
        return mb // self.micro_batches

    def to_strings(self) -> list[list[str]]:
        return [[str(a) for a in acts] for acts in self.actions]

    def with_actions(self, actions: list[list[Action]]) -> Schedule:
        """The same schedule with other action lists (tests build broken ones this way)."""
        return Schedule(self.name, self.stages, self.micro_batches, self.steps, self.chunks,
                        tuple(tuple(a) for a in actions), self.recompute, self.stale_chunks)


def with_comms(stages: int, chunks: int, compute: list[list[Action]],
               recompute: bool) -> list[list[Action]]:
    """Add the sends and receives (and recomputes) around per-stage compute orders.

    Given each stage's order of F/B/OPT actions, put ``RA`` right before a forward that is
    not at position 0, ``SA`` right after a forward that is not last, ``RG`` before a
    backward that is not last and ``SG`` after a backward that is not at position 0. With
    ``recompute``, a forward keeps only its input and ``R`` re-runs it just before the
    ``RG`` that waits for the downstream gradient (so the recomputation overlaps the wait),
    except where the backward directly follows its forward (nothing to save there).
    """
    last = stages * chunks - 1
    out: list[list[Action]] = []
    for s, acts in enumerate(compute):
        seq: list[Action] = []
        for i, a in enumerate(acts):
            pos = a.chunk * stages + s
            if a.kind is Kind.FORWARD:
                if pos > 0:
                    seq.append(RA(a.mb, a.chunk))
                seq.append(a)
                if pos < last:
                    seq.append(SA(a.mb, a.chunk))
            elif a.kind is Kind.BACKWARD:
                prev = acts[i - 1] if i else None
                if recompute and prev != F(a.mb, a.chunk):
                    seq.append(R(a.mb, a.chunk))
                if pos < last:
                    seq.append(RG(a.mb, a.chunk))
                seq.append(a)
                if pos > 0:
                    seq.append(SG(a.mb, a.chunk))
            else:
                seq.append(a)
        out.append(seq)
    return out
