"""Dispatch token choices into per-expert buffers and combine the outputs by the gate.

``dispatch`` lays the kept choices out expert by expert, each expert's rows in slot
order (:mod:`agents.moe.capacity`): the order they cross the network and come back
in. ``combine`` is ``y_t = sum_j kept_tj * weight_tj * expert_out_tj`` (GShard's
combine tensor, without materialising it): a dropped choice contributes zero, so a
token all of whose choices were dropped gets y_t = 0 and lives on through the residual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Dispatch:
    """Where each buffer row came from: ``token`` [n] and ``choice`` [n] (which of the
    token's k choices), rows grouped by expert in slot order; ``counts`` [E] rows per
    expert."""

    token: torch.Tensor
    choice: torch.Tensor
    counts: torch.Tensor

    def split(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Cut a [n, d] tensor into the E experts' buffers."""
        return list(torch.split(rows, [int(c) for c in self.counts.tolist()]))


def plan_dispatch(expert: torch.Tensor, kept: torch.Tensor, slot: torch.Tensor,
                  num_experts: int) -> Dispatch:
    """Order the kept (token, choice) pairs by (expert, slot)."""
    t_idx, j_idx = torch.nonzero(kept, as_tuple=True)
    e = expert[t_idx, j_idx]
    s = slot[t_idx, j_idx]
    # slot < T*k, so expert * (T*k) + slot sorts by expert, then slot.
    key = e * max(1, kept.numel()) + s
    order = torch.argsort(key)
    counts = torch.bincount(e, minlength=num_experts)
    return Dispatch(token=t_idx[order], choice=j_idx[order], counts=counts)


def dispatch(x: torch.Tensor, plan: Dispatch) -> list[torch.Tensor]:
    """Per-expert input buffers (list of E tensors [count_e, d]), differentiable in x."""
    return plan.split(x[plan.token])


def combine(expert_out: list[torch.Tensor], weight: torch.Tensor, plan: Dispatch,
            tokens: int) -> torch.Tensor:
    """``y`` [tokens, d] from the experts' outputs (same layout as :func:`dispatch`)."""
    rows = torch.cat(expert_out, dim=0)
    w = weight[plan.token, plan.choice].unsqueeze(1).to(rows.dtype)
    y = rows.new_zeros((tokens, rows.shape[1]))
    return y.index_add(0, plan.token, rows * w)
