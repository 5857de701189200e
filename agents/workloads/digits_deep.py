"""A deeper MLP on the UCI digits, for pipeline parallelism: enough layers to cut into
``2p`` slices (the two-group schedule at p = 4 needs 8 pieces).

``digits_deep``: ``64 -> hidden``, then ``depth`` blocks of ``Linear(hidden, hidden) +
ReLU`` each wrapped as one layer of the ``nn.Sequential`` (so a balance counts blocks),
then ``hidden -> 10``, He-initialised. At ``hidden=256, depth=8`` it has 545,546 parameters. Same data,
split and evaluation as ``digits_mlp`` (:mod:`agents.workloads.digits`).
"""

from __future__ import annotations

import torch
from torch import nn

from agents.core.config import WorkloadConfig
from agents.workloads.base import register_workload
from agents.workloads.digits import Digits


@register_workload("digits_deep")
class DigitsDeep(Digits):
    name = "digits_deep"

    def __init__(self, hidden: int = 256, depth: int = 8) -> None:
        self.hidden = hidden
        self.depth = depth

    @classmethod
    def from_config(cls, cfg: WorkloadConfig) -> DigitsDeep:
        return cls(hidden=int(cfg.hidden), depth=int(cfg.depth))

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        h = self.hidden
        blocks = [nn.Sequential(nn.Linear(h, h), nn.ReLU()) for _ in range(self.depth)]
        model = nn.Sequential(nn.Sequential(nn.Linear(64, h), nn.ReLU()), *blocks,
                              nn.Linear(h, 10))
        # He initialisation (He et al., ICCV 2015): with PyTorch's default the signal of a
        # deep ReLU stack shrinks layer by layer and 8 blocks did not learn in 8 steps.
        for mod in model.modules():
            if isinstance(mod, nn.Linear):
                nn.init.kaiming_normal_(mod.weight, nonlinearity="relu")
                nn.init.zeros_(mod.bias)
        return model

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "hidden": self.hidden, "depth": self.depth}
