"""Every byte an expert host receives is hostile (agents/moe/exchange.py, mesh.py)."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from agents.moe.exchange import Expect, check_counts, check_done, check_header, step_phases
from agents.moe.mesh import Mesh, file_keys
from agents.net import codec, handshake, link, protocol, wire
from agents.net.codec import DType, FrameError, MsgType
from tests.agents.moe.test_moe_transparency import free_ports

TAG = 0x1234


def header(**kw: object) -> codec.FrameHeader:
    base = dict(msg_type=MsgType.TOKENS, run_tag=TAG, worker=1, iteration=5, chunk=0,
                dtype=DType.FLOAT32, numel=12, payload_len=48)
    base.update(kw)
    return codec.FrameHeader(**base)  # type: ignore[arg-type]


def test_check_header_names_the_field() -> None:
    want = Expect(MsgType.TOKENS, 5, 0, 1, DType.FLOAT32, 12)
    check_header(header(), want, "peer")
    for kw, field in ((dict(msg_type=MsgType.COUNTS), "msg_type"),
                      (dict(iteration=4), "iteration"), (dict(chunk=1), "chunk"),
                      (dict(worker=2), "worker"),
                      (dict(numel=13, payload_len=52), "numel"),
                      (dict(dtype=DType.INT32), "dtype")):
        with pytest.raises(FrameError, match=f"peer: {field}"):
            check_header(header(**kw), want, "peer")


def test_counts_bounded_by_capacity() -> None:
    assert check_counts(torch.tensor([0, 3, 4], dtype=torch.int32), 4, "p", 0) == [0, 3, 4]
    with pytest.raises(FrameError, match="count 5 for local expert 1.*capacity=4"):
        check_counts(torch.tensor([0, 5], dtype=torch.int32), 4, "p", 0)
    with pytest.raises(FrameError, match="count -1"):
        check_counts(torch.tensor([-1], dtype=torch.int32), 4, "p", 0)


def test_step_phases_as_data() -> None:
    labels = [p.label() for p in step_phases(2, combine_after_dispatch=False)]
    assert labels == ["ALL_GATHER", "TOKENS:0", "EXPERT_OUT:0",
                      "TOKENS:1", "EXPERT_OUT:1", "ALL_GATHER", "EXPERT_OUT_GRAD:1",
                      "TOKENS_GRAD:1", "EXPERT_OUT_GRAD:0", "TOKENS_GRAD:0", "REDUCE_SCATTER",
                      "REDUCE_SCATTER", "ALL_GATHER"]
    labels = [p.label() for p in step_phases(1)]
    assert labels[:4] == ["ALL_GATHER", "TOKENS:0", "DISPATCH_DONE:0", "EXPERT_OUT:0"]


def test_dispatch_done_must_match_the_rows_sent() -> None:
    check_done(torch.tensor([7], dtype=torch.int32), 7, "p", 1)
    with pytest.raises(FrameError, match="DISPATCH_DONE layer 1: says it got 6 rows, this "
                                         "host sent 7"):
        check_done(torch.tensor([6], dtype=torch.int32), 7, "p", 1)


def dial(addr: tuple[str, int]) -> socket.socket:
    for _ in range(200):
        try:
            return socket.create_connection(addr, timeout=10)
        except OSError:
            threading.Event().wait(0.05)
    raise TimeoutError(addr)


SECRET = b"moe wire test secret"
RUN = "moe-wire"


def hostile_peer(addr: tuple[str, int], *, tag: int, numel: int = 0,
                 parts: list[torch.Tensor] | None = None,
                 after: threading.Thread | None = None) -> None:
    """Host 1 of 2 by hand: a correct handshake, then a TOKENS message of ``parts``
    (default: one frame of ``numel`` zeros)."""
    if after is not None:
        after.join()
    s = dial(addr)
    try:
        session, _ = handshake.dial(s, protocol.Dialer(RUN, "expert", 1,
                                                       file_keys(SECRET, 1, 2)[0],
                                                       welcome_from=("expert", 0)),
                                    run_tag=tag, name="hostile", timeout_s=10)
        lk = link.Link.dialed(s, session, peer=0, name="hostile", run_tag=tag)
        lk.send_message(parts or [torch.zeros(numel)], msg_type=MsgType.TOKENS, worker=1,
                        iteration=0, chunk=0)
        s.recv(1 << 20)  # until host 0 drops us
    except OSError:
        pass
    finally:
        s.close()


def stranger(addr: tuple[str, int]) -> None:
    """Another run's host: a HELLO with the wrong tag."""
    s = dial(addr)
    wire.send_bytes(s, codec.hello_payload("expert", 1), msg_type=MsgType.HELLO,
                    run_tag=TAG + 1, worker=1)
    s.close()


def test_mesh_refuses_strangers_and_wrong_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    base = free_ports(2)
    addrs = [("127.0.0.1", base), ("127.0.0.1", base + 1)]
    first = threading.Thread(target=stranger, args=(addrs[0],))
    second = threading.Thread(target=hostile_peer, args=(addrs[0],),
                              kwargs=dict(tag=TAG, numel=1000, after=first))
    first.start()
    second.start()
    with Mesh(0, addrs, TAG, run_id=RUN, keys=file_keys(SECRET, 0, 2),
              max_payload_bytes=1 << 20, timeout_s=20) as mesh:
        # open() returned: the stranger was refused, the right tag got in.
        # Host 0 expects 12 elements; the peer sends 1000.
        with pytest.raises(FrameError, match="numel: got 1000, expected 12"):
            mesh.exchange(MsgType.TOKENS, 0, 0, {1: torch.zeros(3)}, {1: 12})
    second.join()
    assert "refused 1 connection(s) from 127.0.0.1" in capsys.readouterr().out


def test_mesh_caps_one_frame() -> None:
    base = free_ports(2)
    addrs = [("127.0.0.1", base), ("127.0.0.1", base + 1)]
    t = threading.Thread(target=hostile_peer, args=(addrs[0],),
                         kwargs=dict(tag=TAG, numel=1 << 20))
    t.start()
    with Mesh(0, addrs, TAG, run_id=RUN, keys=file_keys(SECRET, 0, 2),
              max_payload_bytes=1 << 16, timeout_s=20) as mesh:
        with pytest.raises(FrameError, match="too large"):
            mesh.exchange(MsgType.TOKENS, 0, 0, {1: torch.zeros(3)}, {1: 1 << 20})
    t.join()


I32 = torch.int32


@pytest.mark.parametrize(("parts", "match"), [
    ([torch.tensor([0, 9], dtype=I32), torch.zeros(27)],
     "TOKENS layer 0: count 9 for local expert 1 is outside \\[0, capacity=4\\]"),
    ([torch.tensor([-1, 2], dtype=I32), torch.zeros(3)], "count -1 for local expert 0"),
    ([torch.tensor([1, 2], dtype=I32), torch.zeros(12)], "numel: got 12, expected 9"),
    ([torch.tensor([1, 2], dtype=I32)], "part: 0/1, expected 0/2"),
    ([torch.tensor([1.0, 2.0]), torch.zeros(9)], "dtype: got FLOAT32, expected INT32"),
    ([torch.tensor([1, 2, 0], dtype=I32), torch.zeros(9)], "numel: got 3, expected 2"),
])
def test_a_malformed_dispatch_message_is_refused(parts: list[torch.Tensor], match: str) -> None:
    """The dispatch's counts ride with the rows (Mesh.dispatch): a count outside
    [0, capacity], rows that are not sum(counts) x width, a message without its rows part
    or with counts of the wrong type or length are refused before the rows are read."""
    base = free_ports(2)
    addrs = [("127.0.0.1", base), ("127.0.0.1", base + 1)]
    t = threading.Thread(target=hostile_peer, args=(addrs[0],),
                         kwargs=dict(tag=TAG, parts=parts))
    t.start()
    with Mesh(0, addrs, TAG, run_id=RUN, keys=file_keys(SECRET, 0, 2),
              max_payload_bytes=1 << 20, timeout_s=20) as mesh:
        with pytest.raises(FrameError, match=match):
            mesh.dispatch(0, 0, {1: (torch.tensor([1, 0], dtype=I32), torch.zeros(3))},
                          experts=2, capacity=4, width=3, layer=0)
    t.join()


def test_a_dispatch_carries_counts_and_rows_in_one_message() -> None:
    """Two meshes: each host's counts and rows arrive together, as sent, and the bytes
    on the wire are two frames per peer (dispatch_bytes)."""
    from agents.moe.hosts import dispatch_bytes

    base = free_ports(2)
    addrs = [("127.0.0.1", base), ("127.0.0.1", base + 1)]
    rows = {0: torch.arange(9.0), 1: torch.arange(30.0, 36.0)}
    counts = {0: [2, 1], 1: [0, 2]}
    got: dict[int, object] = {}

    def host(me: int) -> None:
        with Mesh(me, addrs, TAG, run_id=RUN, keys=file_keys(SECRET, me, 2),
                  timeout_s=20) as mesh:
            got[me] = mesh.dispatch(0, 3, {1 - me: (torch.tensor(counts[me], dtype=I32),
                                                    rows[me])},
                                    experts=2, capacity=4, width=3, layer=3)
            got[me + 10] = mesh.sent[1 - me]
    ts = [threading.Thread(target=host, args=(h,)) for h in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    for me in (0, 1):
        c, r = got[me][1 - me]  # type: ignore[index]
        assert c == counts[1 - me] and torch.equal(r, rows[1 - me])
        assert got[me + 10] == dispatch_bytes([sum(counts[me])], 3, 2)
