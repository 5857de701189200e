"""1F1B: PipeDream-flush (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN
Training", ICML 2021), Megatron-LM's non-interleaved schedule (Narayanan et al., SC'21).

Stage ``s`` of ``p`` runs ``min(p - s - 1, m)`` warm-up forwards, then alternates one
forward and one backward, then drains the remaining backwards, and flushes (optimizer step)
at the end of each step. With equal costs its bubble equals GPipe's, ``(p-1)/(m+p-1)`` of
the step (Megatron writes ``(p-1)/m`` relative to the ideal time), but a stage holds at most
``p - s`` micro-batches' activations instead of ``m``.
"""

from __future__ import annotations

from agents.core.schedules.actions import OPT, Action, B, F, Schedule, with_comms
from agents.core.schedules.registry import register


@register("1f1b")
def one_f_one_b(stages: int, micro_batches: int, steps: int = 1,
                recompute: bool = False) -> Schedule:
    m = micro_batches
    compute: list[list[Action]] = [[] for _ in range(stages)]
    for k in range(steps):
        base = k * m
        for s in range(stages):
            warm = min(stages - s - 1, m)
            seq = [F(base + i) for i in range(warm)]
            fwd, bwd = warm, 0
            while fwd < m:
                seq += [F(base + fwd), B(base + bwd)]
                fwd += 1
                bwd += 1
            seq += [B(base + i) for i in range(bwd, m)]
            compute[s] += seq + [OPT(k)]
    acts = with_comms(stages, 1, compute, recompute)
    return Schedule("1f1b", stages, m, steps, 1, tuple(tuple(a) for a in acts), recompute)
