"""The compressors' wire-size accounting must match the codec's real framing."""

import torch

from agents.compress.base import FRAME_HEADER_BYTES, k_for, make
from agents.net import codec


def test_payload_header_size_is_the_codec_header():
    assert FRAME_HEADER_BYTES == codec.HEADER_SIZE


def test_topk_wire_bytes_equal_the_bytes_the_codec_frames():
    g = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    p = make("topk").compress(g, "k", 0.01, torch.Generator().manual_seed(1))
    framed = sum(len(codec.frame_for_tensor(t, msg_type=codec.MsgType.GRAD, run_tag=1, worker=0,
                                            iteration=0, chunk=0)[0]) + t.numel() * t.element_size()
                 for t in p.tensors)
    k = k_for(g.numel(), 0.01)
    assert p.wire_bytes() == framed == k * (4 + 4) + len(p.tensors) * codec.HEADER_SIZE
