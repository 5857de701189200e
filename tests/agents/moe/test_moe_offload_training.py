"""Expert offload in the training loop (agents/moe/expert_offload.py): expert hosts over
real loopback TCP train to the same weights with and without offload, and the transfers
the run counts equal the pure policy's replay of the use order the hosts logged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from agents.moe.expert_offload import ExpertOffload
from agents.moe.layer import Expert
from agents.moe.offload import simulate
from tests.agents.moe.test_moe_transparency import events, run_hosts

BASE = ["moe.hosts=2", "moe.experts=4", "moe.top_k=2", "moe.capacity_factor=1.0",
        "moe.layers=2", "workload.batch_size=8", "moe.d_model=16", "moe.d_hidden=24",
        "moe.zero3_min_numel=300", "moe.eval_every=1000", "run.iterations=4"]
EXPERT_BYTES = 4 * (16 * 24 + 24 + 24 * 16 + 16)  # fc1 and fc2, weights and biases


def dumps(root: Path, hosts: int, steps: int) -> list[list[dict[str, np.ndarray]]]:
    return [[dict(np.load(root / "dump" / f"h{h}_s{s}.npz")) for s in range(steps)]
            for h in range(hosts)]


@pytest.mark.loopback
@pytest.mark.parametrize("policy", ["belady", "lru"])
def test_offload_trains_equal_and_counts_the_policys_transfers(tmp_path: Path,
                                                                policy: str) -> None:
    steps, hosts = 4, 2
    plain_dir, _ = run_hosts(tmp_path / "plain", BASE, threads=True)
    # 1.5 experts' bytes: each of a host's 4 experts (2 layers x 2) must come in and go.
    budget = EXPERT_BYTES * 3 // 2
    off_dir, cfg = run_hosts(tmp_path / "off", [*BASE, f"moe.offload_budget_bytes={budget}",
                                                f'moe.offload_policy="{policy}"'],
                             threads=True)
    plain = dumps(tmp_path / "plain", hosts, steps)
    off = dumps(tmp_path / "off", hosts, steps)
    for h in range(hosts):
        for s in range(steps):
            assert plain[h][s].keys() == off[h][s].keys()
            for k, v in plain[h][s].items():
                # Bit for bit: the recomputed expert forward is the same arithmetic.
                assert np.array_equal(v, off[h][s][k]), (h, s, k)
    assert not events(plain_dir, 0, "moe_offload")
    for h in range(hosts):
        traces = [[tuple(int(i) for i in u.split(".")) for u in r["expert_uses"]]
                  for r in events(off_dir, h, "moe_step")]
        got = events(off_dir, h, "moe_offload")
        assert len(got) == steps and len(traces) == steps
        sizes = {(lay, e): EXPERT_BYTES for lay in range(2) for e in (2 * h, 2 * h + 1)}
        for s in range(steps):
            # The pure policy over the logged order, each step starting with an empty
            # device (the optimizer changed every master), step by step.
            before = simulate(traces[:s], sizes, budget, policy, invalidate_each_step=True)
            upto = simulate(traces[:s + 1], sizes, budget, policy, invalidate_each_step=True)
            r = got[s]
            assert r["uses"] == len(traces[s]) > 0
            assert r["transfers"] == upto.transfers - before.transfers
            assert r["bytes_moved"] == upto.bytes_moved - before.bytes_moved
            assert r["hits"] == upto.hits - before.hits
            assert r["evictions"] == upto.evictions - before.evictions > 0
            assert r["peak_device_bytes"] <= budget
            assert r["grad_bytes"] == EXPERT_BYTES * len(traces[s]) // 2
            assert r["policy"] == policy and r["budget_bytes"] == budget


CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="no CUDA device on this machine")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_offload_fetches_in_the_training_order_and_frees_evicted_copies(device: str) -> None:
    """The same code on both devices (only ``Offloader.fetch``'s copy differs: a clone on
    the CPU, pinned memory and a side stream on CUDA): the fetch order, the counts, and
    the gradients of the reference run (bit for bit on the CPU; the GPU's kernels
    round differently)."""
    torch.manual_seed(0)
    experts = {(0, e): Expert(6, 10) for e in range(3)}
    ref = {k: Expert(6, 10) for k in experts}
    for k, ex in experts.items():
        ref[k].load_state_dict(ex.state_dict())
        for p in ex.parameters():
            p.grad = torch.zeros_like(p)
    size = 4 * (6 * 10 + 10 + 10 * 6 + 6)
    off = ExpertOffload(experts, size, "lru", device)  # room for one expert
    assert off.device.type == device
    if device == "cuda":
        assert all(off.offloader.host[k].is_pinned() for k in experts)
    off.begin_step()
    xs = {k: torch.randn(5, 6, requires_grad=True) for k in experts}
    xr = {k: x.detach().clone().requires_grad_() for k, x in xs.items()}
    sum((experts[k](xs[k]) ** 2).sum() for k in experts).backward()
    sum((ref[k](xr[k]) ** 2).sum() for k in ref).backward()
    st = off.end_step()
    # Forward 0, 1, 2; autograd runs the backward last-created first: 2, 1, 0.
    assert off.uses == [(0, 0), (0, 1), (0, 2), (0, 2), (0, 1), (0, 0)]
    assert (st.transfers, st.hits, st.evictions) == (5, 1, 4)
    assert st.peak_device_bytes == size and off.offloader.device_bytes == 0
    for k in experts:
        same = torch.equal if device == "cpu" else (
            lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-5))
        assert xs[k].grad is not None and same(xs[k].grad, xr[k].grad)
        for p, q in zip(experts[k].parameters(), ref[k].parameters(), strict=True):
            assert p.grad is not None and not p.grad.is_cuda and same(p.grad, q.grad)


@pytest.mark.parametrize("override, field", [
    ('moe.offload_policy="fifo"', "moe.offload_policy"),
    ("moe.offload_budget_bytes=-1", "moe.offload_budget_bytes"),
    ('moe.offload_device="tpu"', "moe.offload_device"),
    ("topo.class_sample_ms=0.1", "topo.class_sample_ms"),
])
def test_bad_offload_and_sampling_settings_name_their_field(override: str, field: str) -> None:
    from agents.core import config as cfgmod
    from agents.core.checks import ConfigError

    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        cfgmod.load("configs/moe.toml", [override])
