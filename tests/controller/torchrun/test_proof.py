"""The bytes proof and sock_diag's parser, pure: the ring formula, per-host payload from
each connection's last counters, loopback and silent hosts named as a bypass, and the
kernel's inet_diag messages decoded (a real dump of this process's own namespace too)."""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest

from controller.torchrun import proof
from controller.torchrun.sockdiag import (
    INET_DIAG_INFO,
    SOCK_DIAG_BY_FAMILY,
    ConnSample,
    ConnSampler,
    dump_request,
    is_local,
    parse_messages,
)


def conn(src: str, dst: str, acked: int, received: int = 0, cookie: int = 1,
         dport: int = 2000) -> ConnSample:
    return ConnSample(cookie, socket.AF_INET, "ESTABLISHED", src, 1000, dst, dport, acked,
                      received, 0, 0, 0, 10, 0.0)


def test_ring_allreduce_bytes_per_host() -> None:
    assert proof.ring_allreduce_bytes(4e6, 4) == pytest.approx(6e6)
    assert proof.ring_allreduce_bytes(4e6, 1) == 0
    # 2 hosts x 2 processes: a ring of 4 that crosses each host's link once.
    assert proof.ring_allreduce_bytes(4e6, 2, 2) == pytest.approx(6e6)


def test_host_bytes_split_link_from_local_and_a_silent_host_is_a_bypass() -> None:
    ips = {"a": "10.0.0.10", "b": "10.0.0.11"}
    conns = [("a", conn("10.0.0.10", "10.0.0.11", 500, 70)),
             ("a", conn("10.0.0.10", "10.0.0.10", 300)),          # to its own address
             ("b", conn("::ffff:10.0.0.11", "::ffff:127.0.0.1", 90)),
             ("b", conn("10.0.0.11", "10.0.0.10", 70, 500)),
             ("b", conn("10.0.0.11", "10.0.0.10", 40, 30, cookie=2, dport=29500))]  # store
    per = proof.host_bytes(conns, ips, store_port=29500)
    assert per["a"] == {"sent": 500, "received": 70, "local": 300, "connections": 1,
                        "store_sent": 0}
    assert per["b"] == {"sent": 110, "received": 530, "local": 90, "connections": 2,
                        "store_sent": 40}
    assert proof.bypass_cause(per, {"a": 900, "b": 300}) is None
    # b's only bytes to another host went to the store (rendezvous): a bypass, named with
    # its ranks.
    per["b"]["sent"] = 40
    cause = proof.bypass_cause(per, {"a": 900, "b": 0}, {"a": [0, 1], "b": [2, 3]})
    assert cause is not None and "hosts b (ranks 2, 3) sent" in cause and "loopback" in cause
    per["b"]["local"] = 0
    assert "shared memory" in str(proof.bypass_cause(per, {"a": 900, "b": 0}))
    s = proof.bytes_summary(per, {"a": (1, 600), "b": (2, 100)}, 1)
    assert s["ring_factor"] == 1.0 and s["allreduce_equivalent_bytes"]["a"] == 500
    assert s["interface_over_payload"]["a"] == 1.2
    assert s["store_sent_bytes"] == {"a": 0, "b": 40}


def test_is_local_covers_loopback_own_address_and_mapped_forms() -> None:
    assert is_local(conn("127.0.0.1", "127.0.0.1", 1), "10.0.0.10")
    assert is_local(conn("::ffff:a00:a", "::ffff:a00:a", 1), "10.0.0.10")
    assert is_local(conn("::1", "::1", 1), "10.0.0.10")
    assert not is_local(conn("10.0.0.10", "10.0.0.11", 1), "10.0.0.10")


def _diag_message(acked: int, received: int, cookie: int) -> bytes:
    info = bytearray(232)
    info[0] = 1  # ESTABLISHED
    struct.pack_into("=QQ", info, 120, acked, received)
    body = struct.pack("=BBBBHH16s16sI8sIIIII", socket.AF_INET, 1, 0, 0, socket.htons(5),
                       socket.htons(6), socket.inet_aton("10.0.0.1") + bytes(12),
                       socket.inet_aton("10.0.0.2") + bytes(12), 0,
                       struct.pack("=Q", cookie), 0, 0, 0, 0, 0)
    attr = struct.pack("=HH", 4 + len(info), INET_DIAG_INFO) + bytes(info)
    payload = body + attr
    return struct.pack("=IHHII", 16 + len(payload), SOCK_DIAG_BY_FAMILY, 2, 1, 0) + payload


def test_inet_diag_messages_decode_to_connections() -> None:
    data = _diag_message(1234, 99, 7) + struct.pack("=IHHIIi", 20, 3, 2, 1, 0, 0)
    got, done = parse_messages(data, final=True)
    assert done and len(got) == 1
    c = got[0]
    assert (c.src, c.sport, c.dst, c.dport) == ("10.0.0.1", 5, "10.0.0.2", 6)
    assert (c.bytes_acked, c.bytes_received, c.cookie, c.final) == (1234, 99, 7, True)
    req = dump_request(socket.AF_INET, 9)
    assert struct.unpack_from("=IHHI", req) == (len(req), SOCK_DIAG_BY_FAMILY, 0x301, 9)


@pytest.mark.skipif(os.geteuid() != 0, reason="opening sock_diag in a namespace needs root")
def test_a_closed_connection_keeps_its_last_counters_from_the_destroy_broadcast() -> None:
    sampler = ConnSampler({"me": (os.getpid(), "192.0.2.1")}, period_s=10.0)
    sampler.start()
    try:
        srv = socket.create_server(("127.0.0.1", 0))
        c = socket.create_connection(srv.getsockname())
        a, _ = srv.accept()
        c.sendall(b"x" * 2_000_000)  # sent and closed between two dumps, 10 s apart
        got = 0
        while got < 2_000_000:
            got += len(a.recv(1 << 20))
        port = c.getsockname()[1]
        for s in (c, a, srv):
            s.close()
        time.sleep(0.5)
    finally:
        sampler.stop()
    mine = [x for _, x in sampler.final_connections() if x.sport == port and x.final]
    assert mine and mine[0].bytes_acked >= 2_000_000


def test_each_sampled_point_gets_its_busy_utilisation(tmp_path) -> None:
    from controller.run import links_frame
    from controller.torchrun.experiment import points_busy

    rows = [{"ts_ns": int(i * 1e8), "direction": "gbh3.up", "dev": "gbh3-eth0",
             "sent_bytes": i * 625_000 if i < 6 else 3_125_000,  # 50 Mbit/s "sent_pkts": 0, "drops": 0,
             "overlimits": 0, "backlog_bytes": 0, "backlog_pkts": 0, "rate_mbps": 100.0}
            for i in range(10)]  # half the rate for 0.5 s, then idle
    links_frame(rows).to_parquet(tmp_path / "links.parquet")
    assert points_busy(tmp_path / "links.parquet") == {"gbh3.up": 0.5}
    links_frame([]).to_parquet(tmp_path / "empty.parquet")
    assert points_busy(tmp_path / "empty.parquet") == {}
