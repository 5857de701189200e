"""Residual MoE: a dense MLP branch mixed with the MoE output by learned coefficients.

DeepSpeed-MoE (Rajbhandari et al., 2022, arXiv:2201.05596, section 4.1, "Residual-MoE";
``deepspeed.moe.layer.MoE(use_residual=True)``): every token also goes through a dense
MLP, and ``y = c_0 * moe(x) + c_1 * mlp(x)`` with ``c = softmax(x W_c + b_c)`` over the
two branches, so each token learns how much to trust its expert against the dense path.
The dense branch and ``W_c`` are shared parameters.
"""

from __future__ import annotations

import torch
from torch import nn


class ResidualMix(nn.Module):
    """The dense branch and the two-way softmax coefficients of residual MoE."""

    def __init__(self, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d_model, d_hidden), nn.ReLU(),
                                 nn.Linear(d_hidden, d_model))
        self.coef = nn.Linear(d_model, 2)

    def forward(self, x: torch.Tensor, moe_out: torch.Tensor) -> torch.Tensor:
        return mix(moe_out, self.mlp(x), self.coef(x))


def mix(moe_out: torch.Tensor, dense_out: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The mixing rule alone: ``softmax(logits)[0] * moe + softmax(logits)[1] * dense``."""
    c = torch.softmax(logits, dim=-1)
    return moe_out * c[..., 0:1] + dense_out * c[..., 1:2]
