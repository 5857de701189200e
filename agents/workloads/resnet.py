"""ResNet-18 and ResNet-50 in plain PyTorch (torchvision is not installed here).

He, Zhang, Ren & Sun, "Deep Residual Learning for Image Recognition", CVPR 2016. The
architecture, parameter names and parameter counts match ``torchvision.models.resnet18`` /
``resnet50`` (v1.5: the stride-2 of a bottleneck sits on its 3x3 conv), so state dicts are
interchangeable: ResNet-18 has 11,689,512 parameters and ResNet-50 25,557,032 (1000
classes). They serve as the gradient workloads (``ef_step`` benchmark, replay profiles).

:func:`layer_sizes` gives the per-parameter gradient sizes in **backprop order** (the reverse
of registration: ``fc`` first, ``conv1`` last), the order in which autograd finishes them
and in which a worker that overlaps communication with backward would send them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convs (ResNet-18/34)."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1,
                 downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = _conv3x3(cin, width, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(width, width)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided, v1.5), 1x1 expand by 4 (ResNet-50/101/152)."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1,
                 downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = _conv1x1(cin, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv1x1(width, width * self.expansion)
        self.bn3 = nn.BatchNorm2d(width * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: list[int],
                 num_classes: int = 1000) -> None:
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _make_layer(self, block: type[BasicBlock] | type[Bottleneck], width: int,
                    blocks: int, stride: int = 1) -> nn.Sequential:
        downsample: nn.Module | None = None
        if stride != 1 or self.inplanes != width * block.expansion:
            downsample = nn.Sequential(_conv1x1(self.inplanes, width * block.expansion, stride),
                                       nn.BatchNorm2d(width * block.expansion))
        mods: list[nn.Module] = [block(self.inplanes, width, stride, downsample)]
        self.inplanes = width * block.expansion
        mods += [block(self.inplanes, width) for _ in range(1, blocks)]
        return nn.Sequential(*mods)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 1000) -> ResNet:
    """ResNet-18: 11,689,512 parameters with 1000 classes."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes)


def resnet50(num_classes: int = 1000) -> ResNet:
    """ResNet-50 (v1.5): 25,557,032 parameters with 1000 classes."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes)


def layer_sizes(model: nn.Module) -> list[tuple[str, int]]:
    """``(parameter name, numel)`` for every trainable parameter in backprop order: the
    reverse of registration order (``fc.bias``, ``fc.weight``, ..., ``conv1.weight``), the
    order in which a worker sends per-layer gradients as backward produces them."""
    return [(name, p.numel()) for name, p in reversed(list(model.named_parameters()))
            if p.requires_grad]
