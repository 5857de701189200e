"""The MoE gate: ``probs = softmax(x W_g)`` and each token's top-k experts.

GShard (Lepikhin et al., 2020, arXiv:2006.16668) and Switch Transformer (Fedus et al.,
2021, arXiv:2101.03961). ``W_g`` is a shared (replicated) parameter: every host routes
its own tokens with the same gate.
"""

from __future__ import annotations

import torch


def gate_probs(x: torch.Tensor, w_gate: torch.Tensor) -> torch.Tensor:
    """``softmax(x W_g)`` over the experts: ``x`` [T, d], ``w_gate`` [d, E] -> [T, E]."""
    if x.dim() != 2 or w_gate.dim() != 2 or x.shape[1] != w_gate.shape[0]:
        raise ValueError(f"gate_probs: x {tuple(x.shape)} and w_gate {tuple(w_gate.shape)} "
                         "must be [T, d] and [d, E]")
    return torch.softmax(x @ w_gate, dim=-1)


def top_k(probs: torch.Tensor, k: int, *, normalize: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``k`` most probable experts, best first.

    Returns ``(expert [T, k] int64, weight [T, k])``; ``weight`` is the gate probability
    of that choice (differentiable), or with ``normalize`` the probabilities divided by
    their sum over the k choices (GShard's top-2 combine weights). Column j is the
    token's (j+1)-th choice; the capacity rules give earlier choices priority.
    """
    n_experts = probs.shape[-1]
    if not 1 <= k <= n_experts:
        raise ValueError(f"k: {k} must be in [1, experts={n_experts}]")
    weight, expert = torch.topk(probs, k, dim=-1)
    if normalize:
        weight = weight / weight.sum(dim=-1, keepdim=True).clamp_min(1e-9)
    return expert, weight
