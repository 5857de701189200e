"""``tc class change`` over rtnetlink (topo/netlink.py) and the replay's lead timer.

Pure parts: the request is the one iproute2 sends (bytes captured with strace from
``tc class change ... htb rate 20000000bit ceil 20000000bit ...``), and the ACK parser finds
the kernel's answer. Root part (marked ``mininet``): in a real star, the class the kernel
holds after a netlink change is exactly the one the ``tc`` binary installs, in the root
namespace and inside a host, and the change takes milliseconds, not a process start.
"""

from __future__ import annotations

import struct
import time

import pytest

from topo import qdisc
from topo.netlink import (
    NLMSG_ERROR,
    RTM_NEWTCLASS,
    HtbClass,
    htb_change_message,
    parse_ack,
    tick_in_usec,
    xmit_ticks,
)
from traces.replay import LeadTimer, calibrate_lead

PSCHED = "000003e8 00000040 000f4240 3b9aca00\n"  # /proc/net/psched on these kernels


def test_ticks_follow_iproute2() -> None:
    assert tick_in_usec(PSCHED) == pytest.approx(15.625)
    # 25000 bytes at 2.5 MB/s is 10 ms = 10000 us = 156250 ticks.
    assert xmit_ticks(2_500_000, 25_000, 15.625) == 156_250


def test_request_matches_what_tc_sends() -> None:
    cls = qdisc.htb_class(20.0)  # 20 Mbit/s, burst 25000, quantum 67050
    assert cls == HtbClass(rate_bytes_per_s=2_500_000, burst_bytes=25_000,
                           quantum_bytes=qdisc.HTB_QUANTUM_BYTES)
    msg = htb_change_message(7, cls, tick_in_usec(PSCHED), seq=42)
    length, kind, flags, seq, _ = struct.unpack_from("IHHII", msg)
    assert (length, kind, flags, seq) == (len(msg), RTM_NEWTCLASS, 0x5, 42)
    family, ifindex, handle, parent, info = struct.unpack_from("BxxxiIII", msg, 16)
    assert (family, ifindex, handle, parent, info) == (0, 7, 0x10001, 0x10000, 0)
    # TCA_KIND "htb", then TCA_OPTIONS { TCA_HTB_PARMS (48 bytes) }.
    assert msg[36:44] == struct.pack("HH", 8, 1) + b"htb\0"
    assert msg[44:52] == struct.pack("HH", 52, 2) + struct.pack("HH", 48, 1)
    # The rate spec as iproute2 encodes it (strace of the tc binary): cell_log 3,
    # linklayer ethernet, cell_align -1, rate 2500000 B/s; ceil the same.
    spec = b"\x03\x01\x00\x00\xff\xff\x00\x00\xa0\x25\x26\x00"
    assert msg[52:64] == spec and msg[64:76] == spec
    buffer, cbuffer, quantum, level, prio = struct.unpack_from("IIIII", msg, 76)
    assert (buffer, cbuffer, quantum, level, prio) == (156_250, 156_250, 67_050, 0, 0)
    assert len(msg) == 96


def test_ack_parser_finds_the_answer_to_its_own_request() -> None:
    def ack(seq: int, error: int) -> bytes:
        inner = struct.pack("IHHII", 16, RTM_NEWTCLASS, 5, seq, 0)
        body = struct.pack("i", error) + inner
        return struct.pack("IHHII", 16 + len(body), NLMSG_ERROR, 0, seq, 0) + body

    assert parse_ack(ack(3, 0), 3) == 0
    assert parse_ack(ack(3, -22), 3) == -22
    assert parse_ack(ack(2, 0), 3) is None  # a late answer to an older request
    assert parse_ack(ack(2, 0) + ack(3, -1), 3) == -1


def test_lead_timer_converges_on_a_steady_lag_and_stays_bounded() -> None:
    lead = LeadTimer(max_lead_ns=25_000_000, gain=0.5)
    due = 0
    for _ in range(10):  # every change lands 12 ms after it is issued
        due += 100_000_000
        issued = due - lead.lead_ns
        lead.observe(due, issued + 12_000_000)
    assert lead.lead_ns == pytest.approx(12_000_000, abs=50_000)
    lead.observe(0, 10**9)  # one huge stall does not push the lead past its bound
    assert lead.lead_ns == 25_000_000
    for _ in range(20):  # early landings bring it back down, never below zero
        lead.observe(10**8, 0)
    assert lead.lead_ns == 0


@pytest.mark.mininet
def test_netlink_change_installs_what_tc_installs() -> None:
    from topo.build import StarNetwork
    from topo.shapes.star import StarSpec
    from topo.spec import LinkSpec

    spec = StarSpec(workers=1, worker_link=LinkSpec(rate_mbps=None),
                    bottleneck_up=LinkSpec(rate_mbps=100, queue_bytes=1_000_000),
                    bottleneck_down=LinkSpec(rate_mbps=50, queue_bytes=500_000), offload=False)
    with StarNetwork(spec, log=None) as net:
        for direction in ("up", "down"):
            place = net.spec.place(direction)
            host, dev = place.host, place.dev
            tc = net._dev_tc(host)
            for rate in (20.0, 3.5, 250.0):
                t0 = time.perf_counter()
                net.set_bottleneck_rate(direction, rate)
                took_s = time.perf_counter() - t0
                via_netlink = tc.tc("-d", "class", "show", "dev", dev, echo=False)
                net.set_bottleneck_rate(direction, 1.0)
                tc.run(qdisc.change_rate_commands(dev, rate)[0], echo=False)
                via_tc = tc.tc("-d", "class", "show", "dev", dev, echo=False)
                assert via_netlink == via_tc, (direction, rate)
                assert took_s < 0.5


def test_calibration_primes_the_lead_with_no_op_changes() -> None:
    clock = [0]
    applied: list[int] = []

    def sleep_s(s: float) -> None:
        clock[0] += round(s * 1e9)

    def apply() -> None:  # every change lands 12 ms after the thread wakes
        clock[0] += 12_000_000
        applied.append(clock[0])

    lead = LeadTimer()
    calibrate_lead(lead, apply, clock_ns=lambda: clock[0], sleep_s=sleep_s)
    assert len(applied) == 8
    assert lead.lead_ns == pytest.approx(12_000_000, rel=0.005)
