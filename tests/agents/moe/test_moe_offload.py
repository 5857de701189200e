"""Belady and LRU offload (agents/moe/offload.py) against slow references and the optimum."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from agents.moe.offload import Offloader, simulate


def ref_run(steps: list[list[str]], sizes: dict[str, int], budget: int, policy: str,
            order: list[str] | None = None) -> tuple[int, int]:
    """Obvious version: lists, and for Belady a linear scan of the predicted future."""
    resident: list[str] = []  # least recently used first
    transfers = moved = 0
    recorded: list[str] = list(order) if order is not None else []
    for s, uses in enumerate(steps):
        predicted = recorded if (order is not None or s > 0) else None
        for i, name in enumerate(uses):
            if s == 0 and order is None:
                recorded.append(name)
            if name in resident:
                resident.remove(name)
                resident.append(name)
                continue
            while sum(sizes[n] for n in resident) + sizes[name] > budget:
                if policy == "lru" or predicted is None:
                    victim = resident[0]
                else:
                    future = predicted[i + 1:] + predicted  # rest of this step, then next
                    dist = {n: future.index(n) if n in future else float("inf")
                            for n in resident}
                    best = max(dist.values())
                    victim = next(n for n in resident if dist[n] == best)
                resident.remove(victim)
            resident.append(name)
            transfers += 1
            moved += sizes[name]
    return transfers, moved


def optimum(trace: list[str], budget: int) -> int:
    """Fewest transfers for unit sizes, by exhaustive search over what to evict."""
    @functools.cache
    def best(i: int, resident: frozenset[str]) -> int:
        if i == len(trace):
            return 0
        name = trace[i]
        if name in resident:
            return best(i + 1, resident)
        if len(resident) < budget:
            return 1 + best(i + 1, resident | {name})
        return 1 + min(best(i + 1, (resident - {v}) | {name}) for v in resident)
    return best(0, frozenset())


def random_steps(rng: random.Random, n_params: int, length: int, n_steps: int,
                 drift: float) -> list[list[str]]:
    base = [f"p{rng.randrange(n_params)}" for _ in range(length)]
    steps = []
    for _ in range(n_steps):  # later steps may deviate a little from the recorded one
        steps.append([f"p{rng.randrange(n_params)}" if rng.random() < drift else n
                      for n in base])
    return steps


@pytest.mark.parametrize("policy", ["belady", "lru"])
def test_matches_slow_reference(policy: str) -> None:
    rng = random.Random(11)
    for _ in range(60):
        n = rng.randint(3, 9)
        sizes = {f"p{i}": rng.randint(1, 5) for i in range(n)}
        steps = random_steps(rng, n, rng.randint(4, 20), 4, drift=rng.choice([0.0, 0.2]))
        budget = rng.randint(5, 15)
        st = simulate(steps, sizes, budget, policy)
        assert (st.transfers, st.bytes_moved) == ref_run(steps, sizes, budget, policy)
        assert st.transfers + st.hits == sum(len(s) for s in steps)


def test_belady_never_worse_than_lru_and_optimal_with_unit_sizes() -> None:
    rng = random.Random(7)
    for _ in range(80):
        n = rng.randint(3, 7)
        sizes = {f"p{i}": 1 for i in range(n)}
        steps = random_steps(rng, n, rng.randint(3, 8), 3, drift=0.0)
        budget = rng.randint(1, n)
        b = simulate(steps, sizes, budget, "belady")
        lru = simulate(steps, sizes, budget, "lru")
        assert b.transfers <= lru.transfers and b.bytes_moved <= lru.bytes_moved
        # Knowing the order from the start (nothing left to record), Belady is optimal.
        known = simulate(steps, sizes, budget, "belady", order=steps[0])
        assert known.transfers == optimum([u for s in steps for u in s], budget)


def test_lru_strictly_worse_on_a_cycle() -> None:
    # A cycle one longer than the budget: LRU always evicts what comes next.
    steps = [["a", "b", "c", "d"]] * 5
    sizes = dict.fromkeys("abcd", 100)
    lru = simulate(steps, sizes, 300, "lru")
    bel = simulate(steps, sizes, 300, "belady")
    assert lru.transfers == 20 and lru.bytes_moved == 2000
    # Step 0 runs as LRU (4 misses); then one miss in three uses at most: 6 more.
    assert bel.transfers == 10 and bel.bytes_moved == 1000
    assert bel.transfers < lru.transfers


def test_offloader_moves_real_tensors_within_budget() -> None:
    torch.manual_seed(0)
    host = {f"p{i}": torch.randn(100 * (i + 1)) for i in range(6)}
    sizes = {n: t.numel() * 4 for n, t in host.items()}
    steps = random_steps(random.Random(3), 6, 15, 4, drift=0.1)
    budget = 6000
    off = Offloader(host, budget, "belady")
    for uses in steps:
        off.begin_step()
        for name in uses:
            t = off.fetch(name)
            assert torch.equal(t, host[name]) and t.data_ptr() != host[name].data_ptr()
            assert off.device_bytes <= budget
    ref = simulate(steps, sizes, budget, "belady")
    assert (off.stats.transfers, off.stats.bytes_moved) == (ref.transfers, ref.bytes_moved)
    off.update_host("p0", torch.zeros(100))
    off.begin_step()
    assert float(off.fetch("p0").abs().sum()) == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_offloader_on_cuda() -> None:
    host = {f"p{i}": torch.randn(1 << 18) for i in range(8)}
    off = Offloader(host, 3 * (1 << 20), "belady", device="cuda")
    for _ in range(3):
        off.begin_step()
        for i in [0, 1, 2, 3, 4, 5, 6, 7, 3, 2]:
            t = off.fetch(f"p{i}")
            assert t.is_cuda and torch.equal(t.cpu(), host[f"p{i}"])
    assert off.device_bytes <= 3 * (1 << 20)
