"""One sender loop per link (agents/pipeline/links.py ``LinkSender``), on a real socket:
messages leave in the order they were queued, each sealed under the link's MAC and
signed by the sender; a failed write is reported once, naming the link."""

from __future__ import annotations

import socket
import threading

import torch

from agents.net import codec, link, wire
from agents.net.codec import FrameMac
from agents.pipeline.links import LinkSender, Outgoing

KEY = b"k" * 32


def test_messages_leave_in_order_and_are_counted() -> None:
    a, b = socket.socketpair()
    lk = link.Link(1, a, "to stage 1 (test)", send_mac=FrameMac(KEY),
                   recv_mac=FrameMac(b"r" * 32), run_tag=7)
    sent: list[tuple[int, int]] = []
    failures: list[str] = []
    sender = LinkSender(lk, worker=3, sent=lambda m, n, t0: sent.append((m.iteration, n)),
                        fail=failures.append, name="send-test")
    tensors = [torch.full((1000 * (i + 1),), float(i)) for i in range(3)]
    for i, t in enumerate(tensors):
        sender.put(Outgoing(codec.MsgType.ACTIVATION, i, 1, (t,)))
    reader = wire.FrameReader(b, mac=FrameMac(KEY), peer="test")
    got = [reader.read_message() for _ in tensors]
    sender.close(10)
    assert [(parts[0][0].iteration, parts[0][0].worker, parts[0][0].chunk) for parts in got] \
        == [(0, 3, 1), (1, 3, 1), (2, 3, 1)]
    for parts, t in zip(got, tensors, strict=True):
        assert torch.equal(parts[0][1], t)
    assert [i for i, _ in sent] == [0, 1, 2] and failures == []
    assert sender.bytes_sent == sum(n for _, n in sent) == sum(
        t.numel() * 4 + codec.HEADER_SIZE for t in tensors)
    assert not sender.thread.is_alive()
    a.close()
    b.close()


def test_a_failed_write_is_reported_once_naming_the_link() -> None:
    a, b = socket.socketpair()
    b.close()
    lk = link.Link(1, a, "to stage 1 (test)", send_mac=FrameMac(KEY),
                   recv_mac=FrameMac(b"r" * 32), run_tag=7)
    failed = threading.Event()
    failures: list[str] = []

    def fail(why: str) -> None:
        failures.append(why)
        failed.set()

    sender = LinkSender(lk, worker=0, sent=lambda *_: None, fail=fail, name="send-test")
    for i in range(3):
        sender.put(Outgoing(codec.MsgType.GRADIENT_BACK, i, 0, (torch.zeros(1 << 16),)))
    assert failed.wait(10)
    sender.close(10)
    assert len(failures) == 1 and failures[0].startswith("to stage 1 (test): send failed")
    a.close()
