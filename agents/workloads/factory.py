"""Builds the workload a config names (one place, so agents and tests agree)."""

from __future__ import annotations

from typing import Any

from agents.core.config import WORKLOAD_NAMES
from agents.workloads.base import Workload
from agents.workloads.digits import DigitsCNN, DigitsMLP
from agents.workloads.digits_deep import DigitsDeep
from agents.workloads.replay import Replay


def make_workload(cfg: Any) -> Workload:
    """``cfg`` is a ``agents.core.config.WorkloadConfig`` (or anything with its fields)."""
    if cfg.name == "digits_mlp":
        return DigitsMLP(hidden=int(cfg.hidden))
    if cfg.name == "digits_cnn":
        return DigitsCNN(channels=int(cfg.channels))
    if cfg.name == "digits_deep":
        return DigitsDeep(hidden=int(cfg.hidden), depth=int(cfg.depth))
    if cfg.name == "replay":
        return Replay(model=str(cfg.model), compute_ms=float(cfg.compute_ms),
                      replay_bytes=int(cfg.replay_bytes))
    raise ValueError(f"workload.name = {cfg.name!r}: must be one of {', '.join(WORKLOAD_NAMES)}")
