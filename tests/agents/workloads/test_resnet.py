"""ResNet definitions: torchvision's parameter counts, a working forward/backward, and the
per-layer sizes cross-checked against the ASTRA-sim ResNet-50 trace in /work/shared/traces."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agents.workloads.resnet import layer_sizes, resnet18, resnet50

TRACE = Path("/work/shared/traces/gradients/Resnet50_DataParallel.txt")


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_param_counts_match_torchvision() -> None:
    assert n_params(resnet18()) == 11_689_512
    assert n_params(resnet50()) == 25_557_032
    assert n_params(resnet18(num_classes=10)) == 11_689_512 - 990 * 512 - 990


def test_forward_backward_and_layer_order() -> None:
    torch.manual_seed(0)
    m = resnet18(num_classes=10)
    out = m(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)
    out.sum().backward()
    sizes = layer_sizes(m)
    assert sizes[0] == ("fc.bias", 10) and sizes[1] == ("fc.weight", 5120)
    assert sizes[-1] == ("conv1.weight", 64 * 3 * 7 * 7)
    assert sum(n for _, n in sizes) == n_params(m)
    assert all(p.grad is not None for p in m.parameters())


@pytest.mark.skipif(not TRACE.exists(), reason=f"{TRACE} absent (shared traces not mounted)")
def test_resnet50_matches_astra_sim_trace() -> None:
    # Trace format (FORMAT.md): line 1 the parallelism type, line 2 the layer count, then one
    # layer per line whose 11th field is the weight-gradient all-reduce size in bytes.
    lines = TRACE.read_text().split("\n")
    assert lines[0].strip() == "DATA"
    rows = [ln.split() for ln in lines[2:] if ln.strip()]
    assert len(rows) == int(lines[1]) == 54
    trace_bytes = [int(r[10]) for r in rows]
    assert sum(trace_bytes) == 102_011_648
    # The trace has the 53 conv weights (its "conv4" is the projection shortcut,
    # downsample.0) and fc.weight, as fp32. It omits fc.bias (1,000) and every BatchNorm
    # weight and bias (2 x 26,560 channels = 53,120): 25,502,912 + 54,120 = 25,557,032.
    ours = {name: n for name, n in layer_sizes(resnet50())}
    weights = [n for name, n in ours.items()
               if name == "fc.weight" or (name.endswith(".weight") and
                                          ("conv" in name or "downsample.0" in name))]
    assert sorted(weights) == sorted(b // 4 for b in trace_bytes)
    assert sum(weights) == 25_502_912
    omitted = {name: n for name, n in ours.items() if ".bn" in name or name.startswith("bn")
               or "downsample.1" in name or name == "fc.bias"}
    assert sum(omitted.values()) == 54_120 == sum(ours.values()) - sum(weights)


def test_replay_draws_its_gradient_before_the_first_iteration() -> None:
    """``prepare`` (called by the worker before it connects) draws the same gradient the
    first ``fill_grad`` would, so iteration 0's compute is ``compute_ms`` alone."""
    import time

    from agents.workloads.base import FlatModel
    from agents.workloads.replay import Replay

    grads = []
    for early in (False, True):
        w = Replay(compute_ms=20.0, replay_bytes=4_000_000)
        m = FlatModel(w.build_model(0))
        if early:
            w.prepare(m.module, worker=3, seed=0)
            drawn = w._grad[3]
        t0 = time.perf_counter()
        w.fill_grad(m.module, worker=3, seed=0)
        assert time.perf_counter() - t0 >= 0.02  # the compute time is still slept
        if early:
            assert w._grad[3] is drawn  # nothing drawn again in the iteration
        grads.append(m.flat_grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    assert grads[0].abs().sum() > 0
    # The PS prepares its copy of the workload as worker -1: it needs no gradient.
    w.prepare(m.module, worker=-1, seed=0)
    assert -1 not in w._grad
