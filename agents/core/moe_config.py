"""The ``[moe]`` config section: mixture of experts on expert hosts (DESIGN.md 1.4).

Every knob says which way it pushes. Validated when loaded; errors name the field. The
training knobs an expert host shares with every other role (``lr``, ``momentum``,
``batch_size``) are ``[workload]``'s, and its port is ``net.port``.
"""

from __future__ import annotations

from dataclasses import dataclass

from agents.core.checks import check as _check

MOE_DATASETS = ("digits", "fashion_mnist")
MOE_DROP_POLICIES = ("position", "probability")
MOE_OFFLOAD_POLICIES = ("belady", "lru")
MOE_OFFLOAD_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class MoEConfig:
    hosts: int = 4                    # expert hosts; each holds experts/hosts experts
    experts: int = 8                  # E experts per MoE layer
    layers: int = 1                   # MoE layers; each does 2 all-to-alls forward, 2 backward
    top_k: int = 2                    # experts per token; more = more all-to-all bytes
    capacity_factor: float = 1.25     # C = ceil(cf x tokens x k / E); lower = more drops, fewer bytes
    min_capacity: int = 0             # C never below this (small batches)
    drop_policy: str = "position"     # position (arrival order) or probability (keep most confident)
    normalize_gates: bool = False     # divide the top-k gate weights by their sum (GShard top-2)
    residual: bool = False            # residual MoE: dense branch mixed in by learned coefficients
    aux_loss_coef: float = 0.01       # weight of the load-balancing loss; higher = more balanced
    d_model: int = 64                 # token width: all-to-all bytes per token = 4 x d_model
    d_hidden: int = 128               # expert MLP width (compute per token, not bytes)
    dataset: str = "digits"           # digits (8 tokens of 8 pixels) or fashion_mnist (28 of 28)
    zero3_min_numel: int = 4096       # shared tensors this large are split (ZeRO-3), smaller ZeRO-2
    crc: bool = True                  # CRC-32 on every payload
    eval_every: int = 10              # host 0 evaluates held-out accuracy every N steps
    # The combine waits until every host holds its dispatch (each host tells every peer,
    # DISPATCH_DONE), so no combine shares a link with a dispatch still under way; false =
    # a host sends its experts' outputs as soon as they are computed (more overlap, and a
    # dispatch slowed by early hosts' combine traffic on its busiest link: docs/moe.md).
    combine_after_dispatch: bool = True
    # Expert offload (agents/moe/expert_offload.py): a host's experts live in host memory
    # and move into a device budget of this many bytes when used; 0 = no offload (every
    # expert always in place). Smaller = more transfers, less device memory.
    offload_budget_bytes: int = 0
    offload_policy: str = "belady"    # eviction: belady (furthest next use) or lru
    offload_device: str = "cpu"       # cuda: real copies to the GPU; cpu: counted clones

    def validate(self, p: str) -> None:
        _check(1 <= self.hosts <= 64, f"{p}.hosts", self.hosts, "must be in [1, 64]")
        _check(1 <= self.experts <= 1024 and self.experts % self.hosts == 0, f"{p}.experts",
               self.experts, f"must be in [1, 1024] and a multiple of hosts={self.hosts}")
        _check(1 <= self.layers <= 16, f"{p}.layers", self.layers, "must be in [1, 16]")
        _check(1 <= self.top_k <= min(2, self.experts), f"{p}.top_k", self.top_k,
               "must be 1 or 2 (and at most experts)")
        _check(0 < self.capacity_factor <= 64, f"{p}.capacity_factor", self.capacity_factor,
               "must be in (0, 64]")
        _check(0 <= self.min_capacity <= 1_000_000, f"{p}.min_capacity", self.min_capacity,
               "must be in [0, 1e6]")
        _check(self.drop_policy in MOE_DROP_POLICIES, f"{p}.drop_policy", self.drop_policy,
               f"must be one of {', '.join(MOE_DROP_POLICIES)}")
        _check(self.aux_loss_coef >= 0, f"{p}.aux_loss_coef", self.aux_loss_coef, "must be >= 0")
        _check(1 <= self.d_model <= 8192, f"{p}.d_model", self.d_model, "must be in [1, 8192]")
        _check(1 <= self.d_hidden <= 65536, f"{p}.d_hidden", self.d_hidden,
               "must be in [1, 65536]")
        _check(self.dataset in MOE_DATASETS, f"{p}.dataset", self.dataset,
               f"must be one of {', '.join(MOE_DATASETS)}")
        _check(self.zero3_min_numel >= 1, f"{p}.zero3_min_numel", self.zero3_min_numel,
               "must be >= 1")
        _check(self.eval_every >= 1, f"{p}.eval_every", self.eval_every, "must be >= 1")
        _check(0 <= self.offload_budget_bytes <= 1 << 50, f"{p}.offload_budget_bytes",
               self.offload_budget_bytes, "must be in [0, 2^50] (0 = no offload)")
        _check(self.offload_policy in MOE_OFFLOAD_POLICIES, f"{p}.offload_policy",
               self.offload_policy, f"must be one of {', '.join(MOE_OFFLOAD_POLICIES)}")
        _check(self.offload_device in MOE_OFFLOAD_DEVICES, f"{p}.offload_device",
               self.offload_device, f"must be one of {', '.join(MOE_OFFLOAD_DEVICES)}")
