"""DGC's momentum correction and momentum factor masking (Lin et al. 2018) in error feedback,
against a slow, obvious per-element reference, plus the invariants: without compression and
without masking it is exactly SGD with momentum, and the config wires the PS's momentum off."""

from __future__ import annotations

import pytest
import torch

from agents.compress import ErrorFeedback, make
from agents.core import config as cfgmod


def dgc_reference(grads: list[list[float]], k: int, m: float,
                  masking: bool) -> list[list[float]]:
    """DGC Algorithm 1 (momentum correction, factor masking), one element at a time."""
    n = len(grads[0])
    u = [0.0] * n
    v = [0.0] * n
    out = []
    for g in grads:
        for i in range(n):
            u[i] = m * u[i] + g[i]
            v[i] = v[i] + u[i]
        top = sorted(range(n), key=lambda i: -abs(v[i]))[:k]
        sent = [0.0] * n
        for i in top:
            sent[i] = v[i]
            v[i] = 0.0
            if masking:
                u[i] = 0.0
        out.append(sent)
    return out


@pytest.mark.parametrize("masking", [True, False])
@pytest.mark.parametrize("name", ["topk", "dgc"])
def test_matches_reference(name: str, masking: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(200, generator=gen, dtype=torch.float64) for _ in range(12)]
    ef = ErrorFeedback(make(name), momentum=0.9, masking=masking)
    rng = torch.Generator().manual_seed(0)
    ref = dgc_reference([g.tolist() for g in grads], k=10, m=0.9, masking=masking)
    for step, g in enumerate(grads):
        payload, _ = ef.step(g, "c0", 0.05, rng)
        got = ef.inner.decompress(payload)
        assert got.tolist() == pytest.approx(ref[step], abs=1e-12), f"step {step}"


def test_without_masking_and_compression_it_is_momentum_sgd() -> None:
    torch.manual_seed(0)
    w_ref = torch.randn(50, dtype=torch.float64)
    w = w_ref.clone()
    opt_param = torch.nn.Parameter(w_ref.clone())
    opt = torch.optim.SGD([opt_param], lr=0.1, momentum=0.9)
    ef = ErrorFeedback(make("none"), momentum=0.9, masking=False)
    rng = torch.Generator().manual_seed(0)
    for _ in range(20):
        g = torch.randn(50, dtype=torch.float64)
        opt_param.grad = g.clone()
        opt.step()
        payload, _ = ef.step(g, "c0", 1.0, rng)
        w -= 0.1 * ef.inner.decompress(payload)  # the PS: plain SGD
    torch.testing.assert_close(w, opt_param.detach(), rtol=0, atol=1e-12)


def test_masking_on_dense_fallback_zeroes_the_velocity() -> None:
    ef = ErrorFeedback(make("topk"), momentum=0.9, masking=True)
    rng = torch.Generator().manual_seed(0)
    ef.step(torch.ones(10), "c0", 1.0, rng)  # keep 1: the dense fallback sends everything
    u = ef.velocity("c0")
    assert u is not None and not bool(u.any())
    r = ef.residual("c0")
    assert r is not None and not bool(r.any())


def test_masking_needs_a_sparse_compressor_else_velocity_is_kept() -> None:
    ef = ErrorFeedback(make("qsgd"), momentum=0.5, masking=True)
    rng = torch.Generator().manual_seed(0)
    g = torch.randn(64, generator=torch.Generator().manual_seed(1))
    ef.step(g, "c0", 1.0, rng)
    ef.step(g, "c0", 1.0, rng)
    u = ef.velocity("c0")
    assert u is not None
    torch.testing.assert_close(u, 1.5 * g)


def test_clipping_applies_to_the_gradient_before_momentum() -> None:
    ef = ErrorFeedback(make("topk"), momentum=0.9, masking=False)
    rng = torch.Generator().manual_seed(0)
    g = torch.full((100,), 1.0)  # ||g|| = 10
    _, stats = ef.step(g, "c0", 0.01, rng, clip_norm=5.0)
    assert stats["clipped"] and stats["norm_before"] == pytest.approx(10.0)
    u = ef.velocity("c0")
    assert u is not None
    torch.testing.assert_close(u, g / 2)


def test_bad_momentum_rejected() -> None:
    with pytest.raises(ValueError, match="momentum must be in"):
        ErrorFeedback(make("topk"), momentum=1.0)


def test_config_needs_error_feedback_and_momentum() -> None:
    base = {"compress": {"name": "topk", "ratio": 0.01},
            "workload": {"momentum": 0.9}, "feedback": {"momentum_correction": True}}
    cfg = cfgmod.from_dict(base)
    assert cfg.feedback.momentum_correction and cfg.feedback.masking
    with pytest.raises(cfgmod.ConfigError, match="needs compress.error_feedback"):
        cfgmod.from_dict({**base, "compress": {"name": "topk", "error_feedback": False}})
    with pytest.raises(cfgmod.ConfigError, match="needs workload.momentum > 0"):
        cfgmod.from_dict({**base, "workload": {"momentum": 0.0}})


def test_sparsity_warmup_schedule_is_dgcs() -> None:
    """DGC section 3.4: sparsity 75 %, 93.75 %, 98.4375 %, 99.6 %, then the configured 99.9 %,
    in four equal stages of the warm-up."""
    from agents.core.feedback_config import warmup_keep
    w = 400  # four stages of 100 iterations
    keeps = [warmup_keep(i, 0.001, w) for i in (0, 99, 100, 199, 200, 299, 300, 399, 400, 10**6)]
    assert keeps == [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625,
                     0.00390625, 0.00390625, 0.001, 0.001]
    sparsity = [round(100 * (1 - warmup_keep(i, 0.001, w)), 4) for i in (0, 100, 200, 300, 400)]
    assert sparsity == [75.0, 93.75, 98.4375, 99.6094, 99.9]
    # Never sparser than configured; off when W = 0; uneven stage lengths still cover W.
    assert warmup_keep(250, 0.05, w) == 0.05 and warmup_keep(50, 0.5, w) == 0.5
    assert warmup_keep(0, 0.001, 0) == 0.001
    assert [warmup_keep(i, 0.001, 6) for i in range(7)] == [
        0.25, 0.25, 0.0625, 0.015625, 0.015625, 0.00390625, 0.001]
    with pytest.raises(ValueError, match="iteration"):
        warmup_keep(-1, 0.001, w)


def test_warmup_config_is_checked() -> None:
    cfg = cfgmod.from_dict({"feedback": {"warmup_iterations": 1876}})
    assert cfg.feedback.warmup_iterations == 1876
    with pytest.raises(cfgmod.ConfigError, match="feedback.warmup_iterations"):
        cfgmod.from_dict({"feedback": {"warmup_iterations": -1}})
