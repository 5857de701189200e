"""Compression stays on the gradient's device: no ``.cpu()`` inside compress or
error feedback, payloads on the input's device, and the staging to the socket a no-op on the
CPU. The CUDA path (pinned buffers, copy stream) runs only where a GPU is present."""

from __future__ import annotations

import pytest
import torch

from agents.compress import ErrorFeedback, make
from agents.compress.base import device_generator
from agents.compress.staging import PayloadStager

HOT = ["none", "fp16", "topk", "dgc", "threshold", "randomk", "qsgd", "signsgd", "powersgd"]


@pytest.fixture
def no_cpu_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``Tensor.cpu`` raise: any call in the hot path fails the test."""
    def refuse(self: torch.Tensor, *a: object, **k: object) -> torch.Tensor:
        raise AssertionError("Tensor.cpu() called in the compression hot path")

    monkeypatch.setattr(torch.Tensor, "cpu", refuse)


@pytest.mark.parametrize("name", HOT)
def test_compress_and_feedback_never_call_cpu(name: str, no_cpu_calls: None) -> None:
    g = torch.randn(70_000, generator=torch.Generator().manual_seed(0))
    ef = ErrorFeedback(make(name), momentum=0.9 if name in ("topk", "dgc") else 0.0)
    rng = torch.Generator().manual_seed(1)
    for _ in range(2):
        payload, _ = ef.step(g, "c0", 0.01, rng)
    assert all(t.device == g.device for t in payload.tensors)


def test_the_cpu_stager_is_a_no_op() -> None:
    stager = PayloadStager(torch.device("cpu"))
    assert not stager.asynchronous
    payload = make("topk").compress(torch.randn(1000), "c0", 0.1,
                                    torch.Generator().manual_seed(0))
    staged = stager.stage(0, payload)
    assert staged.event is None
    assert all(a is b for a, b in zip(staged.host_tensors(), payload.tensors, strict=True))


def test_device_generator_on_the_cpu_is_the_generator_itself() -> None:
    rng = torch.Generator().manual_seed(5)
    assert device_generator(rng, torch.device("cpu")) is rng


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("name", ["topk", "dgc", "qsgd", "powersgd"])
def test_cuda_payload_stays_on_device_and_stages_to_pinned_memory(name: str) -> None:
    dev = torch.device("cuda")
    g = torch.randn(200_000, device=dev)
    ef = ErrorFeedback(make(name), momentum=0.9 if name in ("topk", "dgc") else 0.0)
    payload, _ = ef.step(g, "c0", 0.01, torch.Generator().manual_seed(0))
    assert all(t.device.type == "cuda" for t in payload.tensors)
    stager = PayloadStager(dev)
    host = stager.stage(0, payload).host_tensors()
    for h, d in zip(host, payload.tensors, strict=True):
        assert h.device.type == "cpu" and h.is_pinned()
        torch.testing.assert_close(h, d.cpu())
    residual = ef.residual("c0")
    assert residual is not None and residual.device.type == "cuda"
