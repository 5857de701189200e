"""gradbed for any DDP script: compression hooks and per-bucket instrumentation.

::

    import gradbed.ddp
    ddp.register_comm_hook(*gradbed.ddp.hook("topk", ratio=0.01))   # or fp16, randomk,
    gradbed.ddp.instrument(ddp)                                     # qsgd, signsgd, powersgd

:func:`hook` builds a hook on gradbed's compressor registry and error feedback
(:mod:`gradbed.ddp.hooks`), torch's PowerSGD (:mod:`gradbed.ddp.powersgd`), or with
``policy="adaptive"`` seed 004's rate-driven ratio (:mod:`gradbed.ddp.adaptive`).
:func:`instrument` writes per-bucket and per-iteration events into a gradbed run's events
(:mod:`gradbed.ddp.instrument`) and does nothing outside one. This package imports torch
and the agents' compressors and policies, never the controller, the topology or Mininet:
it runs inside the ranks. docs/ddp.md has the byte formulas and the benchmark.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from agents.core.ethernet import TCP_GOODPUT_FRACTION
from gradbed.ddp.adaptive import DDP_ADAPTIVE, AdaptiveKeep
from gradbed.ddp.hooks import COLLECTIVE, CompressState, HookConfig, compress_hook
from gradbed.ddp.instrument import LINK_ENV, Instrument, instrument
from gradbed.ddp.powersgd import PowerSGDHookState, powersgd_hook
from gradbed.ddp.record import BucketRecord

__all__ = ["BucketRecord", "CompressState", "HookConfig", "Instrument", "PowerSGDHookState",
           "hook", "instrument", "names"]

POLICIES = (None, "fixed", "adaptive")


def names() -> list[str]:
    """The hooks :func:`hook` builds."""
    return sorted([*COLLECTIVE, "powersgd"])


def hook(name: str, ratio: float = 0.01, error_feedback: bool = True,
         policy: str | None = None, *, group: dist.ProcessGroup | None = None,
         start_iter: int = 2, seed: int = 0, rank: int = 1,
         planned_mbps: float | None = None) -> tuple[Any, Callable[..., Any]]:
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``.

    ``name``: one of :func:`names`. ``ratio``: the kept fraction of top-k and random-k
    (ignored by the others). ``policy``: None or "fixed" (``ratio`` every iteration) or
    "adaptive" (top-k and random-k: the keep follows the slowest rank's measured rate
    against ``planned_mbps``, the access link's rate, default ``GRADBED_LINK_MBPS`` which
    ``gradbed torchrun`` sets). ``rank``: PowerSGD's matrix approximation rank. The first
    ``start_iter`` iterations run DDP's dense all_reduce."""
    if policy not in POLICIES:
        raise ValueError(f"gradbed.ddp.hook: policy must be one of {POLICIES}, got {policy!r}")
    if name == "powersgd":
        if policy == "adaptive":
            raise ValueError("gradbed.ddp.hook: policy='adaptive' needs a ratio-driven "
                             "compressor (topk, randomk), not powersgd")
        return (PowerSGDHookState(group, rank, start_iter, error_feedback, seed),
                powersgd_hook)
    adaptive = None
    if policy == "adaptive":
        if name not in ("topk", "randomk"):
            raise ValueError(f"gradbed.ddp.hook: policy='adaptive' needs topk or randomk, "
                             f"not {name!r}")
        adaptive = AdaptiveKeep(_planned_bps(planned_mbps), group, DDP_ADAPTIVE)
    cfg = HookConfig(name, ratio, error_feedback, start_iter, seed)
    return CompressState(cfg, group, adaptive), compress_hook


def _planned_bps(planned_mbps: float | None) -> float:
    """The planned rate r0: the link's TCP payload ceiling (``R x 1448/1514``)."""
    if planned_mbps is None:
        raw = os.environ.get(LINK_ENV, "")
        if not raw:
            raise ValueError(f"gradbed.ddp.hook: policy='adaptive' needs planned_mbps= (the "
                             f"access link's rate) or {LINK_ENV}, which gradbed torchrun sets")
        try:
            planned_mbps = float(raw)
        except ValueError:
            raise ValueError(f"{LINK_ENV}={raw!r}: not a rate in Mbit/s") from None
    if not planned_mbps > 0:
        raise ValueError(f"gradbed.ddp.hook: planned_mbps must be > 0, got {planned_mbps!r}")
    return planned_mbps * 1e6 * TCP_GOODPUT_FRACTION
