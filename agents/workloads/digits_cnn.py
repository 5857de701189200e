"""``digits_cnn``: a small LeNet-style convolutional net on the UCI digits.

Two 3x3 convolutions (``channels`` and ``2 x channels``, ReLU), a 2x2 max-pool and a linear
layer to the 10 classes: its gradient is mostly the second convolution's weights, shared
across every position of the image, where the MLP's is mostly one dense matrix. At
``channels=16`` it has 9,930 parameters (40 KB of gradient), at 64 it has 94,986.
"""

from __future__ import annotations

import torch
from torch import nn

from agents.core.config import WorkloadConfig
from agents.workloads.base import register_workload
from agents.workloads.digits import Digits


@register_workload("digits_cnn")
class DigitsCNN(Digits):
    name = "digits_cnn"

    def __init__(self, channels: int = 16) -> None:
        self.channels = channels

    @classmethod
    def from_config(cls, cfg: WorkloadConfig) -> DigitsCNN:
        return cls(channels=int(cfg.channels))

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        c = self.channels
        return nn.Sequential(nn.Unflatten(1, (1, 8, 8)),
                             nn.Conv2d(1, c, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(2 * c * 4 * 4, 10))

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "channels": self.channels}
