"""The one builder of a sender's compressor, error feedback and generator: the same spec gives
the same bytes everywhere, feedback keeps ``original = sent + residual``, and the config's
``[compress]`` / ``[feedback]`` reach the compressor."""

from __future__ import annotations

import pytest
import torch

from agents.compress.builder import CompressionSpec, Sender, build_compressor, sender_generator
from agents.compress.sparse import SparseCompressor
from agents.core import config as cfgmod
from agents.core.registry import COMPRESSOR


def test_two_senders_of_one_rank_send_the_same_bytes_and_other_ranks_differ() -> None:
    g = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    spec = CompressionSpec("randomk")
    a, b, other = Sender(spec, 3, 1), Sender(spec, 3, 1), Sender(spec, 3, 2)
    pa, pb, po = (s.compress(g, "c0", 0.1)[0] for s in (a, b, other))
    assert all(torch.equal(x, y) for x, y in zip(pa.tensors, pb.tensors, strict=True))
    assert not torch.equal(pa.tensors[1], po.tensors[1])
    assert torch.equal(sender_generator(3, 1).get_state(), Sender(spec, 3, 1).rng.get_state())
    assert not torch.equal(sender_generator(3, 1).get_state(), sender_generator(4, 1).get_state())


def test_feedback_keeps_what_was_not_sent_and_none_keeps_nothing() -> None:
    g = torch.randn(500, generator=torch.Generator().manual_seed(2))
    with_fb = Sender(CompressionSpec("topk"), 0, 0)
    payload, stats = with_fb.compress(g, "c0", 0.1)
    assert with_fb.feedback is not None
    residual = with_fb.feedback.residual("c0")
    assert residual is not None
    sent = with_fb.compressor.decompress(payload)
    torch.testing.assert_close(sent + residual, g)
    assert stats["wire_bytes"] == payload.wire_bytes()
    bare = Sender(CompressionSpec("topk", error_feedback=False), 0, 0)
    payload, stats = bare.compress(g, "c0", 0.1)
    assert bare.feedback is None and stats["residual_norm"] == 0.0
    torch.testing.assert_close(bare.compressor.decompress(payload), sent)


def test_the_config_reaches_the_compressor() -> None:
    cfg = cfgmod.from_dict({"compress": {"name": "topk", "index_encoding": "delta"},
                            "workload": {"momentum": 0.9},
                            "feedback": {"momentum_correction": True, "per_layer": True}})
    spec = CompressionSpec.from_config(cfg)
    assert spec.params == {"index_encoding": "delta"} and spec.momentum == 0.9
    comp = build_compressor(spec)
    assert isinstance(comp, SparseCompressor)
    assert comp.index_encoding == "delta" and comp.per_layer and not comp.dense_1d
    assert CompressionSpec.from_config(cfgmod.from_dict({})).momentum == 0.0


def test_layerwise_selection_needs_a_sparse_compressor() -> None:
    with pytest.raises(ValueError, match="'fp16' is not a sparse compressor"):
        build_compressor(CompressionSpec("fp16", per_layer=True))


@pytest.mark.parametrize("name", COMPRESSOR.declared())
def test_every_registered_compressor_carries_a_pipeline_message(name: str) -> None:
    """The pipeline accepts any registered compressor for activations and gradients: each
    must round-trip a message of an activation's shape through its parts, as a stage does."""
    t = torch.randn(16, 128, generator=torch.Generator().manual_seed(3))
    sender = Sender(CompressionSpec(name), 0, 1)
    payload, _ = sender.compress(t, "c0", 0.1)
    back = sender.compressor.from_parts(list(payload.tensors), t.numel(), tuple(t.shape),
                                        torch.float32)
    dense = sender.compressor.decompress(back).reshape(t.shape)
    assert dense.shape == t.shape and torch.isfinite(dense).all()
    assert sender.feedback is not None
    residual = sender.feedback.residual("c0")
    assert residual is not None
    torch.testing.assert_close(dense + residual.reshape(t.shape), t, rtol=1e-4, atol=1e-4)
