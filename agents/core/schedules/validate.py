"""Schedule validator: rejects a schedule that cannot run correctly, before any process runs.

Checks, each raising :class:`ScheduleError` naming the stage, the action's index and the
action:

1. *skipped or repeated micro-batch*: every stage runs exactly one forward and one backward
   of every micro-batch ``0 .. steps*m-1`` through each of its chunks, and one ``OPT`` per
   step and chunk;
2. *order on a stage*: a backward after its forward, a recompute between them, a send
   after the compute that produced it, ``OPT(k)`` after step ``k``'s backwards and before
   the forwards of step ``k+1`` (``k+2`` for a chunk in ``stale_chunks``);
3. *a tensor used before it arrives*: a forward not at position 0 needs its ``RA`` earlier
   on the stage, a backward not at the last position its ``RG``; every ``RA``/``RG`` has
   exactly one matching send at the neighbour, and no send goes unreceived;
4. *cross-stage deadlock*: the stages are run together (a send never blocks: the stage
   agent's sender threads and TCP buffers hold it; a receive waits for its message); if
   every unfinished stage waits on a receive whose send has not run, the cycle of waits is
   reported.
"""

from __future__ import annotations

from collections import Counter

from agents.core.schedules.actions import Action, Kind, Schedule


class ScheduleError(ValueError):
    """A schedule breaks one of the rules of :mod:`agents.core.schedules.validate`."""


def _where(s: int, i: int, a: Action) -> str:
    return f"stage {s} action {i} ({a})"


def _check_counts(sch: Schedule) -> None:
    total = sch.steps * sch.micro_batches
    for s, acts in enumerate(sch.actions):
        counts = Counter(acts)
        for c in range(sch.chunks):
            for kind in (Kind.FORWARD, Kind.BACKWARD):
                for mb in range(total):
                    n = counts.get(Action(kind, mb, c), 0)
                    if n == 0:
                        raise ScheduleError(f"stage {s}: micro-batch {mb} skipped: no "
                                            f"{Action(kind, mb, c)}")
                    if n > 1:
                        raise ScheduleError(f"stage {s}: micro-batch {mb} repeated: "
                                            f"{Action(kind, mb, c)} appears {n} times")
            for k in range(sch.steps):
                n = counts.get(Action(Kind.OPTIMIZER, k, c), 0)
                if n != 1:
                    raise ScheduleError(f"stage {s}: {Action(Kind.OPTIMIZER, k, c)} appears "
                                        f"{n} times, expected once")
        for a, n in counts.items():
            if a.kind is Kind.OPTIMIZER:
                bad = not (0 <= a.mb < sch.steps)
            else:
                bad = not (0 <= a.mb < total)
            if bad or not 0 <= a.chunk < sch.chunks:
                raise ScheduleError(f"stage {s}: {a} names a micro-batch, step or chunk "
                                    f"outside the schedule (mb < {total}, "
                                    f"steps {sch.steps}, chunks {sch.chunks})")
            if n > 1 and a.kind is not Kind.OPTIMIZER:
                raise ScheduleError(f"stage {s}: micro-batch {a.mb} repeated: {a} appears "
                                    f"{n} times")


def _check_order(sch: Schedule) -> None:
    last = sch.positions - 1
    for s, acts in enumerate(sch.actions):
        seen: set[Action] = set()
        for i, a in enumerate(acts):
            pos = sch.position(s, a.chunk)
            k = sch.step_of(a.mb)
            need: list[tuple[Action, str]] = []
            if a.kind is Kind.FORWARD:
                if pos > 0:
                    need.append((Action(Kind.RECV_ACT, a.mb, a.chunk),
                                 "uses its input activation before it arrives"))
                lag = 2 if a.chunk in sch.stale_chunks else 1
                if k - lag >= 0:
                    need.append((Action(Kind.OPTIMIZER, k - lag, a.chunk),
                                 f"runs before step {k - lag}'s optimizer step"))
            elif a.kind is Kind.BACKWARD:
                need.append((Action(Kind.FORWARD, a.mb, a.chunk), "runs before its forward"))
                if pos < last:
                    need.append((Action(Kind.RECV_GRAD, a.mb, a.chunk),
                                 "uses its output gradient before it arrives"))
            elif a.kind is Kind.RECOMPUTE:
                need.append((Action(Kind.FORWARD, a.mb, a.chunk),
                             "recomputes a forward that has not run"))
                if Action(Kind.BACKWARD, a.mb, a.chunk) in seen:
                    raise ScheduleError(f"{_where(s, i, a)}: recompute after its backward")
            elif a.kind is Kind.SEND_ACT:
                need.append((Action(Kind.FORWARD, a.mb, a.chunk),
                             "sends an activation before computing it"))
                if pos == last:
                    raise ScheduleError(f"{_where(s, i, a)}: the last position has no "
                                        "downstream to send to")
            elif a.kind is Kind.SEND_GRAD:
                need.append((Action(Kind.BACKWARD, a.mb, a.chunk),
                             "sends a gradient before computing it"))
                if pos == 0:
                    raise ScheduleError(f"{_where(s, i, a)}: position 0 has no upstream")
            elif a.kind is Kind.OPTIMIZER:
                lo, hi = a.mb * sch.micro_batches, (a.mb + 1) * sch.micro_batches
                for mb in range(lo, hi):
                    need.append((Action(Kind.BACKWARD, mb, a.chunk),
                                 f"steps before micro-batch {mb}'s backward"))
            for dep, why in need:
                if dep not in seen:
                    raise ScheduleError(f"{_where(s, i, a)} {why} (no {dep} before it)")
            seen.add(a)


def _message_key(sch: Schedule, s: int, a: Action) -> tuple[int, int, Action] | None:
    """(sender stage, receiver stage, receive action) for a send or receive action."""
    if a.kind is Kind.SEND_ACT:
        dn = sch.downstream(s, a.chunk)
        assert dn is not None
        return s, dn[0], Action(Kind.RECV_ACT, a.mb, dn[1])
    if a.kind is Kind.RECV_ACT:
        up = sch.upstream(s, a.chunk)
        if up is None:
            return None
        return up[0], s, a
    if a.kind is Kind.SEND_GRAD:
        up = sch.upstream(s, a.chunk)
        assert up is not None
        return s, up[0], Action(Kind.RECV_GRAD, a.mb, up[1])
    if a.kind is Kind.RECV_GRAD:
        dn = sch.downstream(s, a.chunk)
        if dn is None:
            return None
        return dn[0], s, a
    return None


def _check_messages(sch: Schedule) -> None:
    sends: Counter[tuple[int, int, Action]] = Counter()
    recvs: Counter[tuple[int, int, Action]] = Counter()
    for s, acts in enumerate(sch.actions):
        for i, a in enumerate(acts):
            if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD) and _message_key(sch, s, a) is None:
                raise ScheduleError(f"{_where(s, i, a)}: nothing upstream/downstream sends it")
            key = _message_key(sch, s, a)
            if key is None:
                continue
            (sends if a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD) else recvs)[key] += 1
    for key, n in recvs.items():
        if sends.get(key, 0) != n:
            src, dst, r = key
            raise ScheduleError(f"stage {dst}: {r} is received {n} time(s) but stage {src} "
                                f"sends it {sends.get(key, 0)} time(s): a tensor used before "
                                "it arrives")
    for key, n in sends.items():
        if recvs.get(key, 0) != n:
            src, dst, r = key
            raise ScheduleError(f"stage {src}: sends {r.kind.name.lower()} {r} to stage {dst}"
                                f" {n} time(s), which receives it {recvs.get(key, 0)} time(s)")


def _check_deadlock(sch: Schedule) -> None:
    ptr = [0] * sch.stages
    sent: set[tuple[int, int, Action]] = set()
    progressed = True
    while progressed:
        progressed = False
        for s, acts in enumerate(sch.actions):
            while ptr[s] < len(acts):
                a = acts[ptr[s]]
                key = _message_key(sch, s, a)
                if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD) and key not in sent:
                    break
                if a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
                    assert key is not None
                    sent.add(key)
                ptr[s] += 1
                progressed = True
    stuck = [(s, ptr[s], sch.actions[s][ptr[s]]) for s in range(sch.stages)
             if ptr[s] < len(sch.actions[s])]
    if stuck:
        waits = "; ".join(f"{_where(s, i, a)} waits for stage "
                          f"{_message_key(sch, s, a)[0]}"  # type: ignore[index]
                          for s, i, a in stuck)
        raise ScheduleError(f"deadlock across stages: {waits}")


def validate(sch: Schedule) -> Schedule:
    """Check every rule; returns the schedule unchanged so calls can chain."""
    if len(sch.actions) != sch.stages:
        raise ScheduleError(f"{sch.name}: {len(sch.actions)} action lists for "
                            f"{sch.stages} stages")
    _check_counts(sch)
    _check_order(sch)
    _check_messages(sch)
    _check_deadlock(sch)
    return sch
