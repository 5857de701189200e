"""The ``[vision]`` section: sizes of the Fashion-MNIST workloads (``fashion_resnet``,
``fashion_vit``) and how much of the test set the PS scores. Pure data, no torch."""

from __future__ import annotations

from dataclasses import dataclass

from agents.core.checks import check as _check

NORMS = ("group", "batch")


@dataclass(frozen=True)
class VisionConfig:
    # Test images the PS scores at each evaluation (the first n of 10,000); fewer = a faster
    # evaluation and a noisier accuracy (at 2,000 the standard error near 90 % is 0.7 points).
    eval_samples: int = 10_000
    # fashion_resnet: channels of the first of three stages (doubled at each of the other two);
    # wider = more parameters (~width^2) and compute. blocks: residual blocks per stage.
    # width 16 / blocks 1: 78 k parameters; 16 / 3 (ResNet-20): 0.27 M; 64 / 2: 2.8 M;
    # 128 / 2: 11.2 M.
    resnet_width: int = 16
    resnet_blocks: int = 1
    # group (GroupNorm, no running statistics: the PS, which never runs a training forward,
    # evaluates exactly the model the workers train) or batch (BatchNorm; the PS then scores
    # with each 1,000-image evaluation batch's own statistics, see fashion_resnet.py).
    resnet_norm: str = "group"
    # fashion_vit: patch side (divides 28), embedding width, attention blocks, heads, and the
    # MLP's hidden width as a multiple of dim. 7 / 64 / 4 / 4 / 2: 0.14 M parameters.
    vit_patch: int = 7
    vit_dim: int = 64
    vit_depth: int = 4
    vit_heads: int = 4
    vit_mlp_ratio: int = 2

    def validate(self, p: str) -> None:
        _check(1 <= self.eval_samples <= 10_000, f"{p}.eval_samples", self.eval_samples,
               "must be in [1, 10000] (the test set has 10,000 images)")
        _check(2 <= self.resnet_width <= 256, f"{p}.resnet_width", self.resnet_width,
               "must be in [2, 256]")
        _check(1 <= self.resnet_blocks <= 16, f"{p}.resnet_blocks", self.resnet_blocks,
               "must be in [1, 16]")
        _check(self.resnet_norm in NORMS, f"{p}.resnet_norm", self.resnet_norm,
               f"must be one of {', '.join(NORMS)}")
        _check(self.vit_patch in (1, 2, 4, 7, 14, 28), f"{p}.vit_patch", self.vit_patch,
               "must divide 28: 1, 2, 4, 7, 14 or 28")
        _check(1 <= self.vit_heads <= 64, f"{p}.vit_heads", self.vit_heads, "must be in [1, 64]")
        _check(8 <= self.vit_dim <= 2048 and self.vit_dim % self.vit_heads == 0,
               f"{p}.vit_dim", self.vit_dim,
               f"must be in [8, 2048] and a multiple of vit_heads ({self.vit_heads})")
        _check(1 <= self.vit_depth <= 48, f"{p}.vit_depth", self.vit_depth, "must be in [1, 48]")
        _check(1 <= self.vit_mlp_ratio <= 8, f"{p}.vit_mlp_ratio", self.vit_mlp_ratio,
               "must be in [1, 8]")
