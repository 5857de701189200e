"""agents.net.buffers.ReceivePool, alone and under the PS's MessageReceiver: a tensor given
back is received into again (the same storage), one still held is never handed out, and
the messages received through the pool equal those received into fresh tensors."""

from __future__ import annotations

import socket

import pytest
import torch

from agents.net import codec, wire
from agents.net.buffers import ReceivePool
from agents.net.codec import MsgType

TAG = codec.run_tag("pool-test", b"s3cret")


def test_take_reuses_what_was_given_and_nothing_else() -> None:
    pool = ReceivePool(max_free=2)
    a = pool.take(torch.float32, 1000)
    b = pool.take(torch.float32, 1000)
    assert a.data_ptr() != b.data_ptr() and pool.allocated == 2
    pool.give([a])
    c = pool.take(torch.float32, 1000)
    assert c is a and pool.reused == 1
    # b is still held: a take of its size must not return it.
    d = pool.take(torch.float32, 1000)
    assert d.data_ptr() not in (b.data_ptr(), c.data_ptr())
    # Other sizes and dtypes come from their own lists.
    pool.give([d])
    assert pool.take(torch.float32, 999).data_ptr() != d.data_ptr()
    assert pool.take(torch.float16, 1000).data_ptr() != d.data_ptr()


def test_give_ignores_views_duplicates_and_overflow() -> None:
    pool = ReceivePool(max_free=1)
    base = torch.empty(2000)
    pool.give([base[:1000], base[1000:]])  # views: their base may still be in use
    assert pool.take(torch.float32, 1000).data_ptr() not in (base.data_ptr(),
                                                             base[1000:].data_ptr())
    t, u = torch.empty(10), torch.empty(10)
    pool.give([t, t, u])  # the same tensor once; no more than max_free
    assert pool.take(torch.float32, 10) is t
    assert pool.take(torch.float32, 10) is not u
    with pytest.raises(ValueError, match="max_free"):
        ReceivePool(max_free=0)


def test_receiver_with_pool_receives_into_given_back_tensors() -> None:
    a, b = socket.socketpair()
    mac_tx, mac_rx = codec.FrameMac(b"k" * 32), codec.FrameMac(b"k" * 32)
    gen = torch.Generator().manual_seed(7)
    sent = [torch.randn(50_000, generator=gen) for _ in range(4)]
    pool = ReceivePool()
    rx = wire.MessageReceiver(b, mac=mac_rx, pool=pool)
    b.setblocking(False)
    got: list[torch.Tensor] = []
    ptrs = []
    with a, b:
        for i, t in enumerate(sent):
            for buf in wire.message_buffers([t], msg_type=MsgType.GRAD, run_tag=TAG,
                                            worker=1, iteration=0, chunk=i, mac=mac_tx):
                a.sendall(buf)
            msgs: list[wire.Message] = []
            while not msgs:
                msgs = rx.receive()
            (h, r), = msgs[0]
            assert h.chunk == i and torch.equal(r, t)  # checked (MAC) before it is handed out
            got.append(r.clone())
            ptrs.append(r.data_ptr())
            pool.give([r])  # consumed: the next message lands in the same pages
    assert all(torch.equal(x, y) for x, y in zip(got, sent, strict=True))
    assert len(set(ptrs)) == 1 and pool.allocated == 1 and pool.reused == 3
    assert rx.recv_calls >= 4
