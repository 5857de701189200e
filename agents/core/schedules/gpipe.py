"""GPipe: fill-drain (Huang et al., "GPipe: Efficient Training of Giant Neural Networks
using Pipeline Parallelism", NeurIPS 2019).

Every stage runs the forwards of all ``m`` micro-batches, then their backwards (in order,
as ``torch.distributed.pipelining.ScheduleGPipe`` does), then its optimizer step. Up to
``m`` micro-batches' activations are held per stage. With equal forward and backward costs
and free links the bubble is ``(p - 1) / (m + p - 1)`` of the step (bubble/total).
"""

from __future__ import annotations

from agents.core.schedules.actions import OPT, Action, B, F, Schedule, with_comms
from agents.core.schedules.registry import register


@register("gpipe")
def gpipe(stages: int, micro_batches: int, steps: int = 1,
          recompute: bool = False) -> Schedule:
    compute: list[list[Action]] = [[] for _ in range(stages)]
    for k in range(steps):
        mbs = range(k * micro_batches, (k + 1) * micro_batches)
        for s in range(stages):
            compute[s] += [F(i) for i in mbs] + [B(i) for i in mbs] + [OPT(k)]
    acts = with_comms(stages, 1, compute, recompute)
    return Schedule("gpipe", stages, micro_batches, steps, 1,
                    tuple(tuple(a) for a in acts), recompute)
