"""The MoE exchanges as plain data and the checks every received frame must pass.

Sans-I/O (h11's style): nothing here touches a socket. :mod:`agents.moe.mesh` moves the
bytes and asks this module whether what arrived is what the schedule allows.

One training step of H expert hosts with L MoE layers is, per host, this sequence of
exchanges with every other host (``step_phases`` gives it as data):

1. ``ALL_GATHER`` of the ZeRO-3 class's parameter shards (before the forward uses them;
   chunk ``CHUNK_ZERO3``);
2. per layer, forward: ``TOKENS`` (the dispatch, one message of two parts: how many
   rows this host sends to each of the receiver's experts, int32, then exactly those
   rows, expert by expert in slot order), ``DISPATCH_DONE`` (with ``moe.combine_after_dispatch``:
   this host holds every row of the dispatch; int32, the rows it got from the receiver,
   who checks them against the rows it sent; sent right after the dispatch, read before
   the combine, so no host sends a combine frame before every host holds its dispatch),
   ``EXPERT_OUT`` (the experts' outputs, back in the same order);
3. ``ALL_GATHER`` of the ZeRO-3 shards again (the full copy was freed after the forward;
   chunk ``CHUNK_ZERO3_BWD``), then per layer, backward in reverse: ``EXPERT_OUT_GRAD`` (gradients of the outputs, to the
   experts), ``TOKENS_GRAD`` (gradients of the dispatched rows, back to their owners);
4. ``REDUCE_SCATTER`` of each shared class's gradients, then ``ALL_GATHER`` of the
   ZeRO-2 class's updated parameters.

Every frame is hostile until checked: its kind, step, layer (the frame's ``chunk``),
sender (the frame's ``worker`` must be the host at the other end of that connection),
dtype and element count must be the ones the schedule and the counts allow; a count
must lie in [0, capacity] (a host never sends an expert more rows than its capacity);
the payload then arrives into a tensor of exactly that size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agents.net.codec import DType, FrameError, FrameHeader, MsgType

# Chunk ids of the collectives of the shared parameter classes (layers use 0..L-1).
CHUNK_ZERO3 = 0xFFFF0003
CHUNK_ZERO3_BWD = 0xFFFF0004  # the ZeRO-3 re-gather before the backward
CHUNK_ZERO2 = 0xFFFF0002


@dataclass(frozen=True)
class Phase:
    """One exchange of a step: its frame kind and layer (-1 for the ZeRO collectives)."""

    kind: MsgType
    layer: int
    chunk: int

    def label(self) -> str:
        return f"{self.kind.name}:{self.layer}" if self.layer >= 0 else self.kind.name


def step_phases(layers: int, *, zero3: bool = True, zero2: bool = True,
                combine_after_dispatch: bool = True) -> list[Phase]:
    """The order of a step's exchanges (see the module docstring)."""
    out: list[Phase] = []
    if zero3:
        out.append(Phase(MsgType.ALL_GATHER, -1, CHUNK_ZERO3))
    for lay in range(layers):
        out.append(Phase(MsgType.TOKENS, lay, lay))
        if combine_after_dispatch:
            out.append(Phase(MsgType.DISPATCH_DONE, lay, lay))
        out.append(Phase(MsgType.EXPERT_OUT, lay, lay))
    if zero3:
        out.append(Phase(MsgType.ALL_GATHER, -1, CHUNK_ZERO3_BWD))
    for lay in reversed(range(layers)):
        out += [Phase(MsgType.EXPERT_OUT_GRAD, lay, lay), Phase(MsgType.TOKENS_GRAD, lay, lay)]
    if zero3:
        out.append(Phase(MsgType.REDUCE_SCATTER, -1, CHUNK_ZERO3))
    if zero2:
        out += [Phase(MsgType.REDUCE_SCATTER, -1, CHUNK_ZERO2),
                Phase(MsgType.ALL_GATHER, -1, CHUNK_ZERO2)]
    return out


@dataclass(frozen=True)
class Expect:
    """What the next frame from one peer must be."""

    kind: MsgType
    iteration: int
    chunk: int
    sender: int
    dtype: DType
    numel: int


def check_header(h: FrameHeader, want: Expect, peer: str, *, part: int = 0,
                 nparts: int = 1) -> None:
    """Raise FrameError naming the peer and the first field that differs from ``want``,
    or unless the frame is part ``part`` of a message of ``nparts``."""
    for name, got, exp in (("msg_type", h.msg_type, want.kind),
                           ("iteration", h.iteration, want.iteration),
                           ("chunk", h.chunk, want.chunk),
                           ("worker", h.worker, want.sender),
                           ("dtype", h.dtype, want.dtype),
                           ("numel", h.numel, want.numel)):
        if got != exp:
            shown_got = got.name if isinstance(got, MsgType | DType) else got
            shown_exp = exp.name if isinstance(exp, MsgType | DType) else exp
            raise FrameError(f"{peer}: {name}: got {shown_got}, expected {shown_exp} "
                             f"({want.kind.name} step {want.iteration} chunk {want.chunk})")
    if h.nparts != nparts or h.part != part:
        raise FrameError(f"{peer}: part: {h.part}/{h.nparts}, expected {part}/{nparts} "
                         f"({want.kind.name} step {want.iteration} chunk {want.chunk})")


def check_counts(counts: torch.Tensor, capacity: int, peer: str, layer: int) -> list[int]:
    """A dispatch's counts from ``peer`` (its message's first part): each in
    [0, capacity]. Returns them as ints."""
    values = [int(c) for c in counts.tolist()]
    for e, c in enumerate(values):
        if not 0 <= c <= capacity:
            raise FrameError(f"{peer}: TOKENS layer {layer}: count {c} for local expert {e} "
                             f"is outside [0, capacity={capacity}]")
    return values


def check_done(done: torch.Tensor, rows_sent: int, peer: str, layer: int) -> None:
    """A ``DISPATCH_DONE`` from ``peer``: the rows it says it got from this host must be
    the rows this host sent it."""
    got = int(done.reshape(-1)[0])
    if got != rows_sent:
        raise FrameError(f"{peer}: DISPATCH_DONE layer {layer}: says it got {got} rows, "
                         f"this host sent {rows_sent}")
