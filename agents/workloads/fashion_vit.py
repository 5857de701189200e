"""``fashion_vit``: a small vision transformer on Fashion-MNIST, sizes from ``[vision]``.

Dosovitskiy et al., "An Image is Worth 16x16 Words: Transformers for Image Recognition at
Scale", ICLR 2021, at toy scale: the 28x28 image is cut into ``patch x patch`` patches
(7 -> 16 patches), each linearly embedded to ``dim`` (a strided convolution) plus a learned
position embedding; then ``depth`` pre-norm transformer blocks (multi-head self-attention
and a GELU MLP of ``mlp_ratio x dim``, each inside a residual connection, as in
Vaswani et al. 2017 with the pre-norm placement of Xiong et al. 2020); then a final
LayerNorm, the mean over patches (no class token, as in Beyer et al. 2022, "Better plain ViT
baselines") and a linear head.

The model is a flat ``nn.Sequential`` (``PatchEmbed``, ``Block`` x depth, ``Head``) whose
every element maps a tensor to a tensor of the same kind (images -> tokens -> tokens ->
logits), so a pipeline can cut it between any two elements, and an MoE layer can replace a
block's MLP.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from agents.core.config import WorkloadConfig
from agents.core.vision_config import VisionConfig
from agents.workloads.base import register_workload
from agents.workloads.fashion_mnist import CLASSES, COLS, ROWS, FashionMNIST


class PatchEmbed(nn.Module):
    """(n, 1, 28, 28) images -> (n, patches, dim) tokens with position embeddings."""

    def __init__(self, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(1, dim, patch, stride=patch)
        self.pos = nn.Parameter(torch.zeros(1, (ROWS // patch) * (COLS // patch), dim))
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).flatten(2).transpose(1, 2) + self.pos


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(),
                                 nn.Linear(mlp_ratio * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    """(n, patches, dim) tokens -> (n, classes) logits: LayerNorm, mean over patches, linear."""

    def __init__(self, dim: int, classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.norm(x).mean(1))  # type: ignore[no-any-return]


def build_vit(patch: int, dim: int, depth: int, heads: int, mlp_ratio: int) -> nn.Sequential:
    return nn.Sequential(PatchEmbed(patch, dim),
                         *(Block(dim, heads, mlp_ratio) for _ in range(depth)),
                         Head(dim, CLASSES))


@register_workload("fashion_vit")
class FashionViT(FashionMNIST):
    name = "fashion_vit"
    sections = ("vision",)  # sized by [vision] (agents/core/vision_config.py)

    def __init__(self, patch: int = 7, dim: int = 64, depth: int = 4, heads: int = 4,
                 mlp_ratio: int = 2, eval_samples: int = 10_000) -> None:
        super().__init__(eval_samples=eval_samples)
        self.patch, self.dim, self.depth, self.heads = patch, dim, depth, heads
        self.mlp_ratio = mlp_ratio

    @classmethod
    def from_config(cls, cfg: WorkloadConfig,  # type: ignore[override]
                    vision: VisionConfig | None = None) -> FashionViT:
        v = vision or VisionConfig()
        return cls(patch=v.vit_patch, dim=v.vit_dim, depth=v.vit_depth, heads=v.vit_heads,
                   mlp_ratio=v.vit_mlp_ratio, eval_samples=v.eval_samples)

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return build_vit(self.patch, self.dim, self.depth, self.heads, self.mlp_ratio)

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "patch": self.patch, "dim": self.dim,
                "depth": self.depth, "heads": self.heads, "mlp_ratio": self.mlp_ratio}
