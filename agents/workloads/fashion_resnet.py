"""``fashion_resnet``: a ResNet-style CNN on Fashion-MNIST, width and depth from ``[vision]``.

He, Zhang, Ren & Sun, "Deep Residual Learning for Image Recognition", CVPR 2016, in its
CIFAR form (section 4.2): a 3x3 stem, then three stages of ``blocks`` basic residual blocks
(two 3x3 convolutions each) at ``width``, ``2 width`` and ``4 width`` channels, the second
and third starting with stride 2 (28 -> 14 -> 7 pixels here) and a 1x1 projection shortcut,
then global average pooling and a linear layer to the 10 classes. ``width = 16, blocks = 3``
is the paper's ResNet-20 (0.27 M parameters here).

Normalisation (``vision.resnet_norm``): GroupNorm (Wu & He, ECCV 2018; 8 groups, fewer for
narrow layers) by default, because it has no running statistics: the PS steps the weights but
never runs a training forward, so BatchNorm's running mean and variance would stay at their
initial values there. With ``batch`` the model uses BatchNorm, the workers normalise with
their own batch's statistics as usual, and the PS evaluates in training mode without
reading the running statistics: each 1,000-image evaluation batch is normalised by its
own statistics.

The model is an ``nn.Sequential`` of stem, blocks and head, so it can be cut between blocks.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from agents.core.config import WorkloadConfig
from agents.core.vision_config import VisionConfig
from agents.workloads.base import register_workload
from agents.workloads.fashion_mnist import CLASSES, FashionMNIST


def norm_layer(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    return nn.GroupNorm(min(8, channels), channels)


class BasicBlock(nn.Module):
    """conv3x3-norm-relu-conv3x3-norm, plus the shortcut (a strided 1x1 projection with its
    own norm when the shape changes), then relu."""

    def __init__(self, cin: int, cout: int, stride: int, norm: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.norm1 = norm_layer(norm, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.norm2 = norm_layer(norm, cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                          norm_layer(norm, cout))

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


def build_resnet(width: int, blocks: int, norm: str = "group") -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(1, width, 3, padding=1, bias=False),
                               norm_layer(norm, width), nn.ReLU()]
    cin = width
    for stage in range(3):
        cout = width << stage
        for b in range(blocks):
            layers.append(BasicBlock(cin, cout, 2 if stage > 0 and b == 0 else 1, norm))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, CLASSES)]
    model = nn.Sequential(*layers)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    for m in model.modules():
        # Zero the last norm of each block (Goyal et al. 2017): every block starts as the
        # identity, which lets a deep stack train at the learning rate of a shallow one.
        if isinstance(m, BasicBlock):
            nn.init.zeros_(m.norm2.weight)  # type: ignore[arg-type]
    return model


@register_workload("fashion_resnet")
class FashionResNet(FashionMNIST):
    name = "fashion_resnet"
    sections = ("vision",)  # sized by [vision] (agents/core/vision_config.py)

    def __init__(self, width: int = 16, blocks: int = 1, norm: str = "group",
                 eval_samples: int = 10_000) -> None:
        super().__init__(eval_samples=eval_samples)
        self.width, self.blocks, self.norm = width, blocks, norm
        # BatchNorm: score with each evaluation batch's own statistics (module docstring).
        # That updates the PS's running buffers, which nothing reads or sends.
        self.eval_batch_statistics = norm == "batch"

    @classmethod
    def from_config(cls, cfg: WorkloadConfig,  # type: ignore[override]
                    vision: VisionConfig | None = None) -> FashionResNet:
        v = vision or VisionConfig()
        return cls(width=v.resnet_width, blocks=v.resnet_blocks, norm=v.resnet_norm,
                   eval_samples=v.eval_samples)

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return build_resnet(self.width, self.blocks, self.norm)

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "width": self.width, "blocks": self.blocks,
                "norm": self.norm}
