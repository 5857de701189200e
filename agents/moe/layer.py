"""The MoE layer: gate, capacity, dispatch, experts, combine, optional residual MoE.

GShard's layer (arXiv:2006.16668) with Switch's top-1 as ``k = 1``. The tokens of one
forward are cut into ``groups`` equal, contiguous groups; each group is routed and
capacity-limited on its own, as a host routes its own batch. That is what makes a
layer spread over H hosts (one group each) and the same layer in one process with
``groups = H`` take the same decisions: same routing, same drops, same rows in every
expert's buffer in the same order (group 0's rows first).

Where the experts run is the ``runner``'s business: :class:`LocalExperts` calls the
layer's own experts; :mod:`agents.moe.hosts` sends each expert's rows over TCP to the
host that owns it and brings the outputs back. Either way the runner receives, per
group, the E per-expert buffers and returns outputs of the same shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from agents.core.moe_metrics import load_imbalance
from agents.moe.aux_loss import load_balancing_loss
from agents.moe.capacity import DROP_POLICIES, assign, expert_capacity
from agents.moe.combine import combine, dispatch, plan_dispatch
from agents.moe.gate import gate_probs, top_k
from agents.moe.residual import ResidualMix

# (layer, per-group list of E per-expert input buffers) -> same shapes, expert outputs
Runner = Callable[["MoELayer", list[list[torch.Tensor]]], list[list[torch.Tensor]]]


class Expert(nn.Module):
    """One expert: a two-layer MLP d -> hidden -> d."""

    def __init__(self, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_model)
        # Set by agents.moe.expert_offload: the forward then runs on a device copy of
        # this expert's parameters, fetched into a budget (the master stays here).
        self.offload: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offload is not None:
            return self.offload(x)
        return self.fc2(torch.relu(self.fc1(x)))


@dataclass(frozen=True)
class MoEStats:
    """One forward's routing, summed over groups. ``kept``/``dropped`` [E] int64 count
    token choices per expert; ``capacity`` is per group and expert."""

    capacity: int
    tokens: int
    kept: torch.Tensor
    dropped: torch.Tensor

    @property
    def imbalance(self) -> float:
        """:func:`agents.core.moe_metrics.load_imbalance` of ``kept``."""
        return load_imbalance(self.kept.tolist())


def local_experts(layer: MoELayer, groups: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Run every expert in this process on the concatenation of the groups' rows (group
    order), then cut the output back per group: one expert call per expert, as a host
    that owns it does with the rows every host sent it."""
    out: list[list[torch.Tensor]] = [[] for _ in groups]
    for e in range(layer.num_experts):
        rows = [g[e] for g in groups]
        y = layer.experts[str(e)](torch.cat(rows, dim=0))
        for gi, part in enumerate(torch.split(y, [r.shape[0] for r in rows])):
            out[gi].append(part)
    return out


class MoELayer(nn.Module):
    """Tokens [T, d] -> [T, d]. After a forward, ``aux_loss`` (mean over groups of the
    load-balancing loss) and ``stats`` (:class:`MoEStats`) describe it."""

    def __init__(self, d_model: int, d_hidden: int, num_experts: int, *, k: int = 1,
                 capacity_factor: float = 1.0, min_capacity: int = 0,
                 drop_policy: str = "position", normalize: bool = False,
                 residual: bool = False, groups: int = 1) -> None:
        super().__init__()
        if drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy: {drop_policy!r} must be one of {DROP_POLICIES}")
        if not 1 <= k <= num_experts:
            raise ValueError(f"k: {k} must be in [1, num_experts={num_experts}]")
        self.num_experts = num_experts
        self.k = k
        self.capacity_factor = capacity_factor
        self.min_capacity = min_capacity
        self.drop_policy = drop_policy
        self.normalize = normalize
        self.groups = groups
        self.w_gate = nn.Parameter(torch.randn(d_model, num_experts) * d_model ** -0.5)
        self.experts = nn.ModuleDict({str(e): Expert(d_model, d_hidden)
                                      for e in range(num_experts)})
        self.mix = ResidualMix(d_model, d_hidden) if residual else None
        self.runner: Runner = local_experts
        self.aux_loss: torch.Tensor = torch.zeros(())
        self.stats: MoEStats | None = None
        self.capacity = 0  # of the forward in progress (a runner checks counts against it)

    def keep_experts(self, owned: Sequence[int]) -> None:
        """Drop every expert not in ``owned`` (a host keeps only its own)."""
        for e in range(self.num_experts):
            if e not in owned and str(e) in self.experts:
                del self.experts[str(e)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        if tokens % self.groups:
            raise ValueError(f"MoELayer: {tokens} tokens do not split into "
                             f"{self.groups} equal groups")
        per_group = tokens // self.groups
        cap = expert_capacity(per_group, self.k, self.num_experts, self.capacity_factor,
                              self.min_capacity)
        self.capacity = cap
        xs = torch.split(x, per_group)
        plans, weights, inputs, aux = [], [], [], []
        kept_n = torch.zeros(self.num_experts, dtype=torch.int64)
        dropped_n = torch.zeros(self.num_experts, dtype=torch.int64)
        for xg in xs:
            probs = gate_probs(xg, self.w_gate)
            expert, weight = top_k(probs, self.k, normalize=self.normalize)
            a = assign(expert, weight, num_experts=self.num_experts, capacity=cap,
                       policy=self.drop_policy)
            plan = plan_dispatch(expert, a.kept, a.slot, self.num_experts)
            plans.append(plan)
            weights.append(weight)
            inputs.append(dispatch(xg, plan))
            aux.append(load_balancing_loss(probs, expert[:, 0]))
            kept_n += plan.counts
            dropped_n += torch.bincount(expert[~a.kept], minlength=self.num_experts)
        outputs = self.runner(self, inputs)
        y = torch.cat([combine(o, w, p, per_group)
                       for o, w, p in zip(outputs, weights, plans, strict=True)])
        if self.mix is not None:
            y = self.mix(x, y)
        self.aux_loss = torch.stack(aux).mean()
        self.stats = MoEStats(capacity=cap, tokens=tokens, kept=kept_n, dropped=dropped_n)
        return y
