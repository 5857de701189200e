"""The seed's two-group schedule (DESIGN.md 1.3, seeds/001), with PipeDream-2BW weights.

The model's layers are cut into ``2p`` slices; sub-model A is slices ``0..p-1``, sub-model
B slices ``p..2p-1``, and worker ``j`` holds ``A_j`` (chunk 0) and ``B_j`` (chunk 1), so a
micro-batch goes round the workers twice: ``A_0 .. A_{p-1} B_0 .. B_{p-1}``, then its
gradient comes back the same way. Each worker cycles through four slots in the seed's
order: forward A, backward A (of an earlier micro-batch: A's backward lags, since its
gradient has to come back through all of B first), forward B, backward B. A slot whose
micro-batch is not ready yet is skipped for this turn, so a cycle is as long as the work
that is ready; the order below is what that rule gives with unit costs (each worker's list
is derived from a unit-time run of the rule, so it is deadlock-free by construction, and
:func:`~agents.core.schedules.validate.validate` checks it again).

Weights (PipeDream-2BW, Narayanan et al. ICML 2021):

- B is synchronous: worker ``j`` runs ``OPT(k, 1)`` right after its last backward of step
  ``k``, before any forward of step ``k+1`` through ``B_j``; B's weights are those of
  plain SGD on the unsplit model.
- A's update lags one step: step ``k+1``'s forwards through ``A_j`` start while step
  ``k``'s last A backwards are still to come, so they cannot see step ``k``'s gradient.
  Every forward of step ``s`` through A uses version ``V_s`` with ``V_0 = V_1 = W_0`` and
  ``V_{s+1} = V_s - lr * g_A(s-1)`` (``g_A(s)`` computed at ``V_s``): 2BW's
  ``W(t+1) = W(t) - lr * grad f(W(t-1))``. ``OPT(k, 0)`` (after step ``k``'s last A
  backward) prepares ``V_{k+2}``; at most two versions are alive (the one step ``k+1``'s
  forwards use and the one step ``k``'s lagging backwards need). After the last step the
  pending gradient is applied once more (the flush at the end of training).

Caps keep memory bounded: a worker holds at most ``cap_a`` micro-batches in flight through
A (forward done, backward not) and ``cap_b`` through B, like 1F1B's ``p - s``.
"""

from __future__ import annotations

from agents.core.schedules.actions import OPT, Action, B, F, Kind, Schedule, with_comms
from agents.core.schedules.registry import register

_KINDS = ((Kind.FORWARD, 0), (Kind.BACKWARD, 0), (Kind.FORWARD, 1), (Kind.BACKWARD, 1))


class _SlotRule:
    """A unit-time run of the four-slot rule: each worker, when free, takes the first ready
    slot after the last one it ran."""

    def __init__(self, p: int, m: int, steps: int, cap_a: int, cap_b: int) -> None:
        self.p, self.m, self.cap_a, self.cap_b = p, m, cap_a, cap_b
        self.total = m * steps
        self.done: dict[tuple[Kind, int, int, int], int] = {}  # (kind, mb, chunk, j) -> end
        self.nxt = {(slot, j): 0 for slot in range(4) for j in range(p)}  # next mb per slot
        self.opt_done: dict[tuple[int, int, int], int] = {}  # (step, chunk, worker) -> time
        self.order: list[list[Action]] = [[] for _ in range(p)]
        self.slot_ptr = [0] * p

    def fin(self, kind: Kind, mb: int, chunk: int, j: int, t: int) -> bool:
        return self.done.get((kind, mb, chunk, j), t + 1) <= t

    def ready(self, slot: int, j: int, t: int) -> int | None:
        """The micro-batch worker ``j``'s ``slot`` may run at ``t``, if any."""
        p, fin, mb = self.p, self.fin, self.nxt[(slot, j)]
        if mb >= self.total:
            return None
        k = mb // self.m
        if slot == 0:  # forward A
            if mb - self.nxt[(1, j)] >= self.cap_a:
                return None
            if k >= 2 and self.opt_done.get((k - 2, 0, j), t + 1) > t:
                return None
            ok = j == 0 or fin(Kind.FORWARD, mb, 0, j - 1, t)
        elif slot == 1:  # backward A
            ok = fin(Kind.FORWARD, mb, 0, j, t) and (
                fin(Kind.BACKWARD, mb, 1, 0, t) if j == p - 1
                else fin(Kind.BACKWARD, mb, 0, j + 1, t))
        elif slot == 2:  # forward B
            if mb - self.nxt[(3, j)] >= self.cap_b:
                return None
            if k >= 1 and self.opt_done.get((k - 1, 1, j), t + 1) > t:
                return None
            ok = fin(Kind.FORWARD, mb, 0, p - 1, t) if j == 0 else fin(Kind.FORWARD, mb, 1,
                                                                        j - 1, t)
        else:  # backward B
            ok = fin(Kind.FORWARD, mb, 1, j, t) and (
                j == p - 1 or fin(Kind.BACKWARD, mb, 1, j + 1, t))
        return mb if ok else None

    def take(self, j: int, t: int) -> bool:
        """Worker ``j`` runs its first ready slot at ``t`` (False: none is ready)."""
        for d in range(4):
            slot = (self.slot_ptr[j] + d) % 4
            mb = self.ready(slot, j, t)
            if mb is None:
                continue
            kind, chunk = _KINDS[slot]
            self.order[j].append(F(mb, chunk) if kind is Kind.FORWARD else B(mb, chunk))
            self.done[(kind, mb, chunk, j)] = t + 1
            self.nxt[(slot, j)] = mb + 1
            self.slot_ptr[j] = (slot + 1) % 4
            if kind is Kind.BACKWARD and (mb + 1) % self.m == 0:
                self.order[j].append(OPT(mb // self.m, chunk))
                self.opt_done[(mb // self.m, chunk, j)] = t + 1
            return True
        return False


def _unit_order(p: int, m: int, steps: int, cap_a: int, cap_b: int) -> list[list[Action]]:
    """Each worker's compute order from a unit-time run of the four-slot rule."""
    rule = _SlotRule(p, m, steps, cap_a, cap_b)
    t = 0
    remaining = 4 * rule.total * p
    while remaining:
        took = [j for j in range(p) if rule.take(j, t)]
        if not took:  # pragma: no cover - the rule above cannot stall; guard anyway
            raise RuntimeError(f"two_group p={p} m={m}: the slot rule stalled at t={t}")
        remaining -= len(took)
        t += 1
    return rule.order


@register("two_group")
def two_group(stages: int, micro_batches: int, steps: int = 1, recompute: bool = False,
              cap_a: int | None = None, cap_b: int | None = None) -> Schedule:
    p = stages
    compute = _unit_order(p, micro_batches, steps, cap_a or 2 * p, cap_b or p)
    acts = with_comms(p, 2, compute, recompute)
    return Schedule("two_group", p, micro_batches, steps, 2,
                    tuple(tuple(a) for a in acts), recompute, stale_chunks=(0,))
