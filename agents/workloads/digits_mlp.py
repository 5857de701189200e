"""``digits_mlp``: an MLP 64 -> hidden -> hidden -> 10 with ReLU on the UCI digits.

At ``hidden=512`` it has 300,042 parameters (1.2 MB of float32 gradient per worker per
iteration), large enough that a 10-100 Mbit/s bottleneck, not the CPU, sets the pace. The
data, batches and evaluation are the shared ``agents.workloads.digits.Digits``.
"""

from __future__ import annotations

import torch
from torch import nn

from agents.core.config import WorkloadConfig
from agents.workloads.base import register_workload
from agents.workloads.digits import Digits


@register_workload("digits_mlp")
class DigitsMLP(Digits):
    name = "digits_mlp"

    def __init__(self, hidden: int = 512) -> None:
        self.hidden = hidden

    @classmethod
    def from_config(cls, cfg: WorkloadConfig) -> DigitsMLP:
        return cls(hidden=int(cfg.hidden))

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(64, self.hidden), nn.ReLU(),
                             nn.Linear(self.hidden, self.hidden), nn.ReLU(),
                             nn.Linear(self.hidden, 10))

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "hidden": self.hidden}
