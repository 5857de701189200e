"""Builds the workload a config names (one place, so agents and tests agree)."""

from __future__ import annotations

from typing import Any

from agents.core.config import WORKLOAD_NAMES
from agents.core.vision_config import VisionConfig
from agents.workloads.base import Workload
from agents.workloads.digits import DigitsCNN, DigitsMLP
from agents.workloads.replay import Replay


def make_workload(cfg: Any, vision: VisionConfig | None = None) -> Workload:
    """``cfg`` is a ``agents.core.config.WorkloadConfig`` (or anything with its fields);
    ``vision`` sizes the Fashion-MNIST workloads (default: ``VisionConfig()``)."""
    v = vision or VisionConfig()
    if cfg.name == "fashion_resnet":
        from agents.workloads.fashion_resnet import FashionResNet

        return FashionResNet(width=v.resnet_width, blocks=v.resnet_blocks, norm=v.resnet_norm,
                             eval_samples=v.eval_samples)
    if cfg.name == "fashion_vit":
        from agents.workloads.fashion_vit import FashionViT

        return FashionViT(patch=v.vit_patch, dim=v.vit_dim, depth=v.vit_depth,
                          heads=v.vit_heads, mlp_ratio=v.vit_mlp_ratio,
                          eval_samples=v.eval_samples)
    if cfg.name == "digits_mlp":
        return DigitsMLP(hidden=int(cfg.hidden))
    if cfg.name == "digits_cnn":
        return DigitsCNN(channels=int(cfg.channels))
    if cfg.name == "replay":
        return Replay(model=str(cfg.model), compute_ms=float(cfg.compute_ms),
                      replay_bytes=int(cfg.replay_bytes))
    raise ValueError(f"workload.name = {cfg.name!r}: must be one of {', '.join(WORKLOAD_NAMES)}")
