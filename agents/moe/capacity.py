"""Expert capacity and which token choices it drops (GShard, Switch, V-MoE).

Capacity: every expert takes at most ``C = ceil(capacity_factor * tokens * k / E)``
token choices from one group of ``tokens`` tokens (a host's batch is one group), raised
to ``min_capacity`` when that is larger. ``capacity_factor`` is read as the decimal the
user wrote (1.1 means 11/10 exactly), so ``1.1 * 10 / 1`` gives 11, not 12.

Choices over capacity are dropped: their token skips the expert (the residual path
carries it) and the drop is recorded in the ``kept`` mask. Two drop policies:

- ``position`` (GShard, Switch): choices arrive rank-major, all first choices in token
  order, then all second choices in token order; an expert keeps the first C arrivals.
- ``probability`` (Batch Prioritized Routing, Riquelme et al., 2021, "Scaling Vision
  with Sparse Mixture of Experts", arXiv:2106.05974): an expert keeps the C choices with
  the highest gate probability; ties go to the earlier arrival.

Either way a kept choice's ``slot`` is its index among the kept choices of its expert
in arrival order: the row it occupies in that expert's buffer, and the order in which
it crosses the network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch

DROP_POLICIES = ("position", "probability")


def expert_capacity(tokens: int, k: int, experts: int, capacity_factor: float,
                    min_capacity: int = 0) -> int:
    """``C = max(ceil(capacity_factor * tokens * k / experts), min_capacity)``."""
    if tokens < 0 or k < 1 or experts < 1 or capacity_factor <= 0 or min_capacity < 0:
        raise ValueError(f"expert_capacity: tokens={tokens}, k={k}, experts={experts}, "
                         f"capacity_factor={capacity_factor}, min_capacity={min_capacity}")
    exact = Fraction(repr(float(capacity_factor))) * tokens * k / experts
    return max(math.ceil(exact), min_capacity)


@dataclass(frozen=True)
class Assignment:
    """Which of each token's k choices an expert keeps.

    ``kept`` [T, k] bool (False = dropped for capacity); ``slot`` [T, k] int64, the
    row in the expert's buffer, -1 where dropped; ``capacity`` the C that was applied.
    """

    kept: torch.Tensor
    slot: torch.Tensor
    capacity: int


def assign(expert: torch.Tensor, weight: torch.Tensor, *, num_experts: int, capacity: int,
           policy: str) -> Assignment:
    """Apply capacity ``capacity`` to the choices ``expert`` [T, k] with gate ``weight``."""
    if policy not in DROP_POLICIES:
        raise ValueError(f"drop policy: {policy!r} must be one of {', '.join(DROP_POLICIES)}")
    tokens, k = expert.shape
    # Rank-major arrival order: index a = j * T + t.
    e_arr = expert.t().reshape(-1)
    onehot = torch.nn.functional.one_hot(e_arr, num_experts).to(torch.int64)  # [kT, E]
    if policy == "position":
        rank = (onehot.cumsum(0) - 1).gather(1, e_arr[:, None]).squeeze(1)
        kept_arr = rank < capacity
    else:
        w_arr = weight.detach().t().reshape(-1)
        # Stable sort: equal probabilities stay in arrival order.
        order = torch.sort(-w_arr, stable=True).indices
        rank_sorted = (onehot[order].cumsum(0) - 1).gather(1, e_arr[order][:, None]).squeeze(1)
        kept_arr = torch.empty_like(kept_sorted := rank_sorted < capacity)
        kept_arr[order] = kept_sorted
    kept_onehot = onehot * kept_arr[:, None].to(torch.int64)
    slot_arr = (kept_onehot.cumsum(0) - 1).gather(1, e_arr[:, None]).squeeze(1)
    slot_arr = torch.where(kept_arr, slot_arr, torch.full_like(slot_arr, -1))
    return Assignment(kept=kept_arr.reshape(k, tokens).t().contiguous(),
                      slot=slot_arr.reshape(k, tokens).t().contiguous(), capacity=capacity)


def counts_per_expert(expert: torch.Tensor, kept: torch.Tensor, num_experts: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kept per expert, dropped per expert)``, each [E] int64."""
    kept_n = torch.bincount(expert[kept], minlength=num_experts)
    dropped_n = torch.bincount(expert[~kept], minlength=num_experts)
    return kept_n, dropped_n
