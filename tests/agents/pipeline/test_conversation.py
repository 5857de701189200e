"""What a pipeline peer may send next (agents/pipeline/conversation.py), without sockets:
for every registered schedule, both ends of every link agree on what crosses it, the
legal sequence is accepted in order, and at every point every other message is refused,
naming what came and what was due, without consuming the due message."""

from __future__ import annotations

import itertools

import pytest

from agents.core.schedules import Kind, Schedule, make, names, validate
from agents.net.codec import DType, FrameHeader, MsgType
from agents.net.protocol import ProtocolError
from agents.pipeline.conversation import (
    Conversation,
    Expected,
    from_neighbour,
    from_stage_ps,
    to_stage_ps,
)

KINDS = (MsgType.ACTIVATION, MsgType.GRADIENT_BACK, MsgType.GRAD, MsgType.UPDATE,
         MsgType.SLICE_WEIGHTS, MsgType.BYE, MsgType.WEIGHTS)


class Run:
    iterations, eval_every = 3, 2


def schedules() -> list[Schedule]:
    out = []
    for name, p, m in itertools.product(names(), (2, 3, 4), (2, 4)):
        try:
            out.append(validate(make(name, p, m, steps=3)))
        except ValueError:
            continue  # a shape this schedule does not support
    return out


SCHEDULES = schedules()


def header(kind: MsgType, iteration: int, chunk: int, worker: int) -> FrameHeader:
    return FrameHeader(msg_type=kind, run_tag=0, worker=worker, iteration=iteration,
                       chunk=chunk, dtype=DType.FLOAT32, numel=1, payload_len=4)


def as_header(e: Expected) -> FrameHeader:
    return header(e.kind, max(e.iteration, 0), max(e.chunk, 0), e.sender)


def legal(want: Expected, h: FrameHeader) -> bool:
    """The rule, written out apart from the code under test: kind and sender always; the
    iteration and chunk too, except for a BYE."""
    if (h.msg_type, h.worker) != (want.kind, want.sender):
        return False
    return want.kind == MsgType.BYE or (h.iteration, h.chunk) == (want.iteration, want.chunk)


def near_misses(want: Expected) -> list[FrameHeader]:
    """Every message that differs from ``want`` in one field or more, close to it."""
    its = {want.iteration - 1, want.iteration, want.iteration + 1, 0}
    out = []
    for kind, it, ch, sender in itertools.product(KINDS, its, (0, 1), {want.sender,
                                                                       want.sender + 1, 0}):
        h = header(kind, max(it, 0), ch, sender)
        if not legal(want, h):
            out.append(h)
    return out


def walk(script: list[Expected]) -> None:
    """Feed ``script``; before each message, every near miss is refused and leaves the
    conversation where it was; after the last, anything is refused."""
    talk = Conversation(script, "peer X")
    for i, want in enumerate(script):
        for h in near_misses(want):
            with pytest.raises(ProtocolError) as e:
                talk.receive(h)
            msg = str(e.value)
            assert msg.startswith("peer X: sent " + h.describe()), msg
            assert f"expected {want.describe()}" in msg, msg
            assert talk.received == i and talk.next == want
        assert talk.receive(as_header(want)) == want
    assert talk.finished and talk.next is None
    for h in near_misses(script[-1]) + [as_header(script[-1])]:
        with pytest.raises(ProtocolError, match="after the last message it owes"):
            talk.receive(h)


def links(sch: Schedule) -> list[tuple[int, int]]:
    """Every (stage, its downstream neighbour) pair of the schedule."""
    out = set()
    for s in range(sch.stages):
        for c in range(sch.chunks):
            d = sch.downstream(s, c)
            if d is not None:
                out.add((s, d[0]))
    return sorted(out)


@pytest.mark.parametrize("sch", SCHEDULES, ids=lambda s: f"{s.name}-p{s.stages}-m{s.micro_batches}")
def test_both_ends_of_every_stage_link_agree(sch: Schedule) -> None:
    """What a stage's schedule receives on a link is exactly what its neighbour's sends
    on it: the activations downstream and the gradients upstream."""
    for up, down in links(sch):
        acts = from_neighbour(sch, down, up, upstream=True)
        grads = from_neighbour(sch, up, down, upstream=False)
        assert {(e.iteration, e.chunk) for e in acts[:-1]} == {
            (a.mb, a.chunk) for a in sch.actions[down] if a.kind is Kind.RECV_ACT}
        assert {(e.iteration, e.chunk) for e in grads[:-1]} == {
            (a.mb, a.chunk) for a in sch.actions[up] if a.kind is Kind.RECV_GRAD}
        assert len(acts) - 1 == sum(a.kind is Kind.RECV_ACT for a in sch.actions[down])
        assert acts[-1] == Expected(MsgType.BYE, -1, -1, up)


@pytest.mark.parametrize("sch", SCHEDULES[::3],
                         ids=lambda s: f"{s.name}-p{s.stages}-m{s.micro_batches}")
def test_every_illegal_next_message_is_refused_on_stage_links(sch: Schedule) -> None:
    for up, down in links(sch):
        walk(from_neighbour(sch, down, up, upstream=True))
        walk(from_neighbour(sch, up, down, upstream=False))


@pytest.mark.parametrize("replicas", [1, 2])
def test_every_illegal_next_message_is_refused_on_ps_links(replicas: int) -> None:
    sch = validate(make("1f1b", 2, 2, steps=3))
    for stage, replica in itertools.product(range(2), range(replicas)):
        script = to_stage_ps(sch, stage, replica, replicas, Run)
        grads = [e for e in script if e.kind == MsgType.GRAD]
        weights = [e for e in script if e.kind == MsgType.SLICE_WEIGHTS]
        opts = [a for a in sch.actions[stage] if a.kind is Kind.OPTIMIZER]
        assert len(grads) == (len(opts) if replicas > 1 else 0)
        # Replica 0 sends its weights after steps 1 (eval_every 2) and 2 (the last).
        assert [(e.iteration, e.chunk) for e in weights] == (
            [(1, 0), (2, 0)] if replica == 0 else [])
        assert {e.sender for e in script} == {replica * 2 + stage}
        walk(script)
        back = from_stage_ps(sch, stage, replicas)
        assert [(e.iteration, e.chunk) for e in back] == [(e.iteration, e.chunk)
                                                          for e in grads]
        if back:
            walk(back)
        else:
            with pytest.raises(ProtocolError, match="sent UPDATE .* after the last message"):
                Conversation(back, "ps").receive(header(MsgType.UPDATE, 0, 0, 0))


def test_a_script_whose_sends_do_not_reach_the_stage_is_an_error() -> None:
    sch = validate(make("gpipe", 3, 2, steps=1))
    with pytest.raises(ValueError, match="does not go to stage 2"):
        from_neighbour(sch, 2, 0, upstream=True)  # stage 0 feeds stage 1, not 2
