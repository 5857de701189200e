"""What a peer may send next on a pipeline connection, as a sans-I/O state machine (h11's
``Connection``): the socket code feeds it each message's header and it either names the
message the schedule allows there or refuses it, naming what came and what was due.

On a pipeline every connection's traffic is fixed by the schedule before a byte moves, so
the machine is a script: the exact messages, in order, then ``BYE``, then nothing.

- **Stage to stage.** A stage's sender thread writes in the order its schedule sends, and
  TCP keeps that order, so the connection to the upstream neighbour carries exactly that
  neighbour's ``SA`` actions (``ACTIVATION``, micro-batch in ``iteration``, the receiving
  chunk in ``chunk``) and the one to the downstream neighbour exactly its ``SG`` actions
  (``GRADIENT_BACK``); the header's ``worker`` is the sending stage (:func:`from_neighbour`).
- **Stage to the pipeline's PS.** Per optimizer action (step ``k``, chunk ``c``), with
  ``d > 1`` replicas, a ``GRAD``; after a step's last optimizer action, from replica 0 at an
  evaluated step, one ``SLICE_WEIGHTS`` per chunk; ``worker`` is ``replica * p + stage``
  (:func:`to_stage_ps`).

A refused message raises :class:`agents.net.protocol.ProtocolError`; nothing here reads,
writes or waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agents.core.schedules import Kind, Schedule
from agents.net.codec import FrameHeader, MsgType
from agents.net.protocol import ProtocolError
from agents.pipeline.common import is_eval_step, ps_node_id


@dataclass(frozen=True)
class Expected:
    """One message a peer owes: its kind, the header's ``iteration`` (micro-batch on stage
    links, step on PS links) and ``chunk`` (the receiving chunk), and its sender (the
    header's ``worker``). A ``BYE`` is matched on kind and sender only."""

    kind: MsgType
    iteration: int
    chunk: int
    sender: int

    def matches(self, h: FrameHeader) -> bool:
        if h.msg_type != self.kind or h.worker != self.sender:
            return False
        return self.kind == MsgType.BYE or (h.iteration, h.chunk) == (self.iteration,
                                                                       self.chunk)

    def describe(self) -> str:
        if self.kind == MsgType.BYE:
            return f"BYE from {self.sender}"
        return f"{self.kind.name} iter={self.iteration} chunk={self.chunk} from {self.sender}"


class Conversation:
    """What one peer may still send on one connection: exactly ``script``, in order, and
    nothing after its last message (the script ends with ``BYE``)."""

    def __init__(self, script: Sequence[Expected], peer: str) -> None:
        self.script = tuple(script)
        self.peer = peer
        self.received = 0  # messages accepted so far

    @property
    def next(self) -> Expected | None:
        """The message the peer must send next; None once the script is done."""
        return self.script[self.received] if self.received < len(self.script) else None

    @property
    def finished(self) -> bool:
        return self.received == len(self.script)

    def owed(self) -> tuple[Expected, ...]:
        return self.script[self.received:]

    def receive(self, h: FrameHeader) -> Expected:
        """Accept ``h`` if it is the message due now and return it; otherwise raise
        ProtocolError naming the peer, what it sent and what was due."""
        want = self.next
        if want is None:
            raise ProtocolError(f"{self.peer}: sent {h.describe()} after the last message "
                                "it owes")
        if not want.matches(h):
            raise ProtocolError(f"{self.peer}: sent {h.describe()}, expected "
                                f"{want.describe()}")
        self.received += 1
        return want


def bye(sender: int) -> Expected:
    return Expected(MsgType.BYE, -1, -1, sender)


def from_neighbour(schedule: Schedule, me: int, neighbour: int, *, upstream: bool
                   ) -> list[Expected]:
    """What stage ``neighbour`` sends stage ``me`` on their connection: its activations
    when it is ``me``'s upstream neighbour, its gradients when it is the downstream one."""
    kind = Kind.SEND_ACT if upstream else Kind.SEND_GRAD
    msg = MsgType.ACTIVATION if upstream else MsgType.GRADIENT_BACK
    out = []
    for a in schedule.actions[neighbour]:
        if a.kind is not kind:
            continue
        dst = (schedule.downstream(neighbour, a.chunk) if upstream
               else schedule.upstream(neighbour, a.chunk))
        if dst is None or dst[0] != me:
            raise ValueError(f"stage {neighbour}'s {a} does not go to stage {me}")
        out.append(Expected(msg, a.mb, dst[1], neighbour))
    return [*out, bye(neighbour)]


def to_stage_ps(schedule: Schedule, stage: int, replica: int, replicas: int, run: Any
                ) -> list[Expected]:
    """What stage ``stage`` of replica ``replica`` sends the pipeline's PS, in order
    (the module docstring says why each)."""
    me = ps_node_id(stage, replica, schedule.stages)
    opts = [(a.mb, a.chunk) for a in schedule.actions[stage] if a.kind is Kind.OPTIMIZER]
    last = {k: c for k, c in opts}  # the last optimizer chunk of every step
    out: list[Expected] = []
    for k, c in opts:
        if replicas > 1:
            out.append(Expected(MsgType.GRAD, k, c, me))
        if c == last[k] and replica == 0 and is_eval_step(run, k):
            out += [Expected(MsgType.SLICE_WEIGHTS, k, ch, me)
                    for ch in range(schedule.chunks)]
    return [*out, bye(me)]


def from_stage_ps(schedule: Schedule, stage: int, replicas: int) -> list[Expected]:
    """What the pipeline's PS sends stage ``stage`` (of any replica): with ``d > 1``, the
    mean gradient (``UPDATE``, from index 0) of every optimizer action, in order; nothing
    otherwise. The PS closes the connection rather than saying BYE."""
    if replicas == 1:
        return []
    return [Expected(MsgType.UPDATE, a.mb, a.chunk, 0) for a in schedule.actions[stage]
            if a.kind is Kind.OPTIMIZER]
