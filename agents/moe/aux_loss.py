"""The load-balancing auxiliary loss ``E * sum_e(mean gate_e * mean mask_e)``.

GShard (arXiv:2006.16668, Algorithm 1) and Switch Transformer (arXiv:2101.03961, eq. 4):
``mean gate_e`` is the gate probability of expert e averaged over the group's tokens,
``mean mask_e`` the fraction of tokens whose *first* choice is e, before capacity.
The mask is not differentiable, so the gradient pushes gate probability away from
experts that already receive many tokens. It equals 1 under perfectly uniform routing
and grows to E when every token goes to one expert.
"""

from __future__ import annotations

import torch


def load_balancing_loss(probs: torch.Tensor, first_choice: torch.Tensor) -> torch.Tensor:
    """``probs`` [T, E] gate probabilities, ``first_choice`` [T] each token's top expert."""
    num_experts = probs.shape[1]
    mask = torch.nn.functional.one_hot(first_choice, num_experts).to(probs.dtype)
    return num_experts * torch.sum(probs.mean(0) * mask.mean(0))
