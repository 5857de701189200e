"""The MoE layer's pure parts against slow, obvious references (agents/moe)."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch

from agents.moe.aux_loss import load_balancing_loss
from agents.moe.capacity import assign, counts_per_expert, expert_capacity
from agents.moe.combine import combine, dispatch, plan_dispatch
from agents.moe.gate import gate_probs, top_k
from agents.moe.layer import MoELayer
from agents.moe.residual import mix


def ref_capacity(tokens: int, k: int, experts: int, cf: float, min_cap: int) -> int:
    num = Fraction(str(cf)) * tokens * k
    return max(-(-num.numerator * 1 // (num.denominator * experts)), min_cap)


def ref_assign(expert: list[list[int]], weight: list[list[float]], n_exp: int, cap: int,
               policy: str) -> tuple[list[list[bool]], list[list[int]]]:
    """Loops over experts and arrivals, one at a time."""
    T, k = len(expert), len(expert[0])
    arrivals = [(j * T + t, t, j) for j in range(k) for t in range(T)]
    kept = [[False] * k for _ in range(T)]
    slot = [[-1] * k for _ in range(T)]
    for e in range(n_exp):
        mine = [r for r in arrivals if expert[r[1]][r[2]] == e]
        if policy == "position":
            chosen = mine[:cap]
        else:
            chosen = sorted(mine, key=lambda r: (-weight[r[1]][r[2]], r[0]))[:cap]
        for _, t, j in chosen:
            kept[t][j] = True
        n = 0
        for _, t, j in mine:  # arrival order
            if kept[t][j]:
                slot[t][j] = n
                n += 1
    return kept, slot


def test_capacity_formula() -> None:
    assert expert_capacity(10, 1, 1, 1.1) == 11  # not 12: 1.1 means 11/10
    assert expert_capacity(8, 1, 4, 1.25) == 3   # ceil(2.5)
    assert expert_capacity(10, 2, 4, 0.5) == 3   # ceil(2.5)
    assert expert_capacity(16, 2, 4, 1.0) == 8
    assert expert_capacity(16, 1, 4, 0.25, min_capacity=4) == 4
    for tokens, k, e, cf, m in itertools.product([1, 7, 64], [1, 2], [2, 4, 8],
                                                 [0.3, 0.75, 1.0, 1.1, 2.0], [0, 5]):
        assert expert_capacity(tokens, k, e, cf, m) == ref_capacity(tokens, k, e, cf, m)
    with pytest.raises(ValueError):
        expert_capacity(8, 1, 4, 0.0)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("policy", ["position", "probability"])
@pytest.mark.parametrize("cf", [0.5, 0.8, 1.0, 1.5])
def test_assign_matches_reference(k: int, policy: str, cf: float) -> None:
    g = torch.Generator().manual_seed(hash((k, policy, cf)) % 2**31)
    for trial in range(20):
        T, E, d = 5 + trial * 3, [2, 4, 8][trial % 3], 6
        x = torch.randn(T, d, generator=g)
        # A skewed gate, so capacity binds on some experts and not others.
        w = torch.randn(d, E, generator=g) * 2 + torch.linspace(0, 1.5, E)
        probs = gate_probs(x, w)
        expert, weight = top_k(probs, k)
        cap = expert_capacity(T, k, E, cf)
        a = assign(expert, weight, num_experts=E, capacity=cap, policy=policy)
        kept, slot = ref_assign(expert.tolist(), weight.tolist(), E, cap, policy)
        assert a.kept.tolist() == kept
        assert a.slot.tolist() == slot
        kept_n, dropped_n = counts_per_expert(expert, a.kept, E)
        assert int(kept_n.max()) <= cap
        assert int(kept_n.sum() + dropped_n.sum()) == T * k


def test_policies_differ_where_they_should() -> None:
    # Three tokens to expert 0, capacity 2: position keeps tokens 0 and 1,
    # probability keeps the two most confident (tokens 1 and 2).
    expert = torch.tensor([[0], [0], [0]])
    weight = torch.tensor([[0.4], [0.9], [0.8]])
    pos = assign(expert, weight, num_experts=2, capacity=2, policy="position")
    prob = assign(expert, weight, num_experts=2, capacity=2, policy="probability")
    assert pos.kept[:, 0].tolist() == [True, True, False]
    assert prob.kept[:, 0].tolist() == [False, True, True]
    assert prob.slot[:, 0].tolist() == [-1, 0, 1]  # slots follow arrival order
    # k = 2: every first choice arrives before any second choice.
    expert2 = torch.tensor([[1, 0], [0, 1]])
    a = assign(expert2, torch.ones(2, 2), num_experts=2, capacity=1, policy="position")
    assert a.kept.tolist() == [[True, False], [True, False]]


def test_aux_loss_reference() -> None:
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(50, 4, generator=g), -1)
    first = probs.argmax(1)
    ref = 4 * sum(float(probs[:, e].mean()) * float((first == e).float().mean())
                  for e in range(4))
    assert math.isclose(float(load_balancing_loss(probs, first)), ref, rel_tol=1e-6)
    uniform = torch.full((8, 4), 0.25)
    assert math.isclose(float(load_balancing_loss(uniform, torch.arange(8) % 4)), 1.0,
                        rel_tol=1e-6)


def test_dispatch_combine_reference() -> None:
    g = torch.Generator().manual_seed(5)
    T, E, d, k = 12, 3, 4, 2
    x = torch.randn(T, d, generator=g)
    probs = gate_probs(x, torch.randn(d, E, generator=g))
    expert, weight = top_k(probs, k)
    a = assign(expert, weight, num_experts=E, capacity=5, policy="position")
    plan = plan_dispatch(expert, a.kept, a.slot, E)
    bufs = dispatch(x, plan)
    for e in range(E):  # row s of expert e's buffer is the token with slot s
        for t, j in itertools.product(range(T), range(k)):
            if a.kept[t, j] and expert[t, j] == e:
                assert torch.equal(bufs[e][a.slot[t, j]], x[t])
    scale = torch.tensor([2.0, -1.0, 0.5])
    y = combine([b * scale[e] for e, b in enumerate(bufs)], weight, plan, T)
    for t in range(T):
        ref = sum((weight[t, j] * scale[expert[t, j]] * x[t] for j in range(k)
                   if a.kept[t, j]), torch.zeros(d))
        assert torch.allclose(y[t], ref, atol=1e-6)


@pytest.mark.parametrize("k,policy,cf,groups", [(1, "position", 0.75, 1),
                                                (2, "probability", 1.25, 2),
                                                (2, "position", 0.5, 4)])
def test_layer_matches_token_by_token(k: int, policy: str, cf: float, groups: int) -> None:
    torch.manual_seed(0)
    layer = MoELayer(8, 16, 4, k=k, capacity_factor=cf, drop_policy=policy, groups=groups)
    x = torch.randn(24, 8)
    y = layer(x)
    per = 24 // groups
    stats_kept = torch.zeros(4, dtype=torch.int64)
    for gi in range(groups):
        xg = x[gi * per:(gi + 1) * per]
        probs = gate_probs(xg, layer.w_gate)
        expert, weight = top_k(probs, k)
        cap = expert_capacity(per, k, 4, cf)
        kept, _ = ref_assign(expert.tolist(), weight.tolist(), 4, cap, policy)
        for t in range(per):
            ref = torch.zeros(8)
            for j in range(k):
                if kept[t][j]:
                    e = int(expert[t, j])
                    ref = ref + weight[t, j] * layer.experts[str(e)](xg[t:t + 1])[0]
                    stats_kept[e] += 1
            assert torch.allclose(y[gi * per + t], ref, atol=1e-5)
    assert layer.stats is not None and torch.equal(layer.stats.kept, stats_kept)
    assert int(layer.stats.kept.sum() + layer.stats.dropped.sum()) == 24 * k
    y.sum().backward()
    assert layer.w_gate.grad is not None and float(layer.w_gate.grad.abs().sum()) > 0


def test_residual_moe_mixes_by_softmax_over_two() -> None:
    torch.manual_seed(1)
    layer = MoELayer(8, 16, 4, k=1, capacity_factor=0.25, residual=True)
    x = torch.randn(16, 8)
    y = layer(x)
    assert layer.mix is not None
    c = torch.softmax(layer.mix.coef(x), -1)
    layer.mix, plain = None, layer.mix
    moe = layer(x)
    assert torch.allclose(y, c[:, :1] * moe + c[:, 1:] * plain.mlp(x), atol=1e-6)
    assert torch.allclose(mix(torch.ones(3, 2), torch.zeros(3, 2), torch.zeros(3, 2)),
                          torch.full((3, 2), 0.5))
    layer.mix = plain
    layer(x).sum().backward()
    assert float(plain.coef.weight.grad.abs().sum()) > 0  # the coefficients are learned
