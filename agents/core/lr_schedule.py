"""The learning rate at each iteration: constant, step decay or cosine.

DGC (Lin et al., ICLR 2018, Sec. 5 and its Table 2 CIFAR-10 runs) trains with the usual step
decay, the lr divided by 10 at 50 % and 75 % of training (He et al., CVPR 2016's ResNet
recipe); a constant lr leaves both the dense and the compressed run still moving at the end,
so a comparison of their last evaluations carries that noise. ``cosine`` is Loshchilov and
Hutter's SGDR (ICLR 2017) without restarts. Pure: the PS, the pipeline stages and the
one-process reference all call :func:`lr_at` with the same iteration, so every side steps
with the same lr.

With DGC's momentum correction the workers accumulate ``u = m u + g`` and ``v += u`` without
the lr (DGC Algorithm 1's form), and only the PS multiplies by it, so an lr change needs no
worker-side state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from agents.core.checks import check

LR_SCHEDULES = ("constant", "step", "cosine")


def decay_iterations(decay_at: Sequence[float], iterations: int) -> list[int]:
    """The first iteration of each step-decay stage: ``floor(fraction x iterations)``."""
    return [math.floor(f * iterations) for f in decay_at]


def lr_at(lr: float, iteration: int, iterations: int, schedule: str = "constant",
          decay_at: Sequence[float] = (0.5, 0.75), decay_factor: float = 0.1) -> float:
    """The learning rate of optimizer step ``iteration`` (0-based) out of ``iterations``.

    - ``constant``: ``lr``;
    - ``step``: ``lr x decay_factor ** k``, ``k`` = how many of ``decay_iterations(decay_at,
      iterations)`` are ``<= iteration``;
    - ``cosine``: ``lr x (1 + cos(pi x iteration / iterations)) / 2`` (``lr`` at 0, towards
      0 at the end).

    Iterations past the end (a run extended beyond its plan) keep the last stage's lr."""
    if schedule == "constant":
        return lr
    if schedule == "step":
        k = sum(1 for d in decay_iterations(decay_at, iterations) if iteration >= d)
        return lr * decay_factor ** k
    if schedule == "cosine":
        t = min(iteration, iterations) / iterations
        return lr * (1 + math.cos(math.pi * t)) / 2
    raise ValueError(f"unknown lr schedule {schedule!r}: one of {', '.join(LR_SCHEDULES)}")


def check_lr_schedule(p: str, schedule: str, decay_at: Sequence[float],
                      decay_factor: float) -> None:
    """Config checks for ``{p}.lr_schedule``, ``{p}.lr_decay_at``, ``{p}.lr_decay_factor``."""
    check(schedule in LR_SCHEDULES, f"{p}.lr_schedule", schedule,
          f"must be one of {', '.join(LR_SCHEDULES)}")
    check(all(0 < f < 1 for f in decay_at), f"{p}.lr_decay_at", list(decay_at),
          "every fraction of run.iterations must be in (0, 1)")
    check(all(a < b for a, b in zip(decay_at, decay_at[1:], strict=False)),
          f"{p}.lr_decay_at", list(decay_at), "must be strictly increasing")
    check(0 < decay_factor <= 1, f"{p}.lr_decay_factor", decay_factor, "must be in (0, 1]")
    check(schedule != "step" or len(decay_at) >= 1, f"{p}.lr_decay_at", list(decay_at),
          "lr_schedule = \"step\" needs at least one fraction")
