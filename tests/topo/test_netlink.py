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


def test_calibration_stops_once_changes_land_past_the_leads_cap() -> None:
    """A point on another server: each change lands 300 ms late (ssh), far past the lead's
    25 ms cap; two such rounds pin the lead there, and the other six would only cost time.
    A single slow first round (then 12 ms) does not stop it."""
    def calibrate(lags_ns: list[int]) -> tuple[LeadTimer, int]:
        clock, rounds = [0], [0]

        def sleep_s(s: float) -> None:
            clock[0] += round(s * 1e9)

        def apply() -> None:
            clock[0] += lags_ns[min(rounds[0], len(lags_ns) - 1)]
            rounds[0] += 1

        lead = LeadTimer()
        calibrate_lead(lead, apply, clock_ns=lambda: clock[0], sleep_s=sleep_s)
        return lead, rounds[0]

    lead, rounds = calibrate([300_000_000])
    assert (rounds, lead.lead_ns) == (2, lead.max_lead_ns)
    lead, rounds = calibrate([300_000_000, 12_000_000])
    assert rounds == 8 and lead.lead_ns < 13_000_000, lead


def _class_msg(seq: int, ifindex: int, classid: int, sent: int, pkts: int, drops: int,
               overlimits: int, backlog: int, qlen: int, kind: bytes = b"htb\0") -> bytes:
    from topo.netlink import TCA_KIND, TCA_STATS2, TCA_STATS_BASIC, TCA_STATS_QUEUE, _rtattr

    stats = (_rtattr(TCA_STATS_BASIC, struct.pack("QIxxxx", sent, pkts))
             + _rtattr(TCA_STATS_QUEUE, struct.pack("IIIII", qlen, backlog, drops, 0,
                                                    overlimits)))
    body = (struct.pack("BxxxiIII", 0, ifindex, classid, 0xFFFF_FFFF, 0)
            + _rtattr(TCA_KIND, kind) + _rtattr(TCA_STATS2 | 0x8000, stats))
    return struct.pack("IHHII", 16 + len(body), RTM_NEWTCLASS, 2, seq, 0) + body


def test_class_dump_request_and_answer() -> None:
    from topo.netlink import (
        NLMSG_DONE,
        RTM_GETTCLASS,
        ClassCounters,
        NetlinkError,
        class_dump_message,
        parse_class_dump,
    )

    msg = class_dump_message(7, seq=9)
    length, kind, flags, seq, _ = struct.unpack_from("IHHII", msg)
    assert (length, kind, flags, seq) == (36, RTM_GETTCLASS, 0x301, 9)
    assert struct.unpack_from("BxxxiIII", msg, 16) == (0, 7, 0, 0, 0)
    done = struct.pack("IHHII", 20, NLMSG_DONE, 2, 9, 0) + struct.pack("i", 0)
    got: list[ClassCounters] = []
    first = (_class_msg(9, 7, 0x10001, 10**10, 5, 1, 2, 3000, 2)
             + _class_msg(9, 8, 0x10001, 1, 1, 0, 0, 0, 0)      # another device: skipped
             + _class_msg(8, 7, 0x10011, 1, 1, 0, 0, 0, 0))     # an older request: skipped
    assert not parse_class_dump(first, 9, 7, got)
    assert parse_class_dump(_class_msg(9, 7, 0x10011, 77, 1, 0, 0, 0, 0) + done, 9, 7, got)
    assert got == [ClassCounters(0x10001, 0xFFFF_FFFF, "htb", 10**10, 5, 1, 2, 3000, 2),
                   ClassCounters(0x10011, 0xFFFF_FFFF, "htb", 77, 1, 0, 0, 0, 0)]
    err = struct.pack("IHHII", 36, NLMSG_ERROR, 0, 9, 0) + struct.pack("i", -19) + msg[:16]
    with pytest.raises(NetlinkError, match="No such device"):
        parse_class_dump(err, 9, 7, [])
    # Hostile lengths: a message or an attribute longer than what arrived.
    bad = bytearray(_class_msg(9, 7, 0x10001, 1, 1, 0, 0, 0, 0))
    with pytest.raises(NetlinkError, match="overruns"):
        parse_class_dump(bytes(bad[:-4]), 9, 7, [])
    struct.pack_into("H", bad, 36, 200)  # TCA_KIND claims 200 bytes
    with pytest.raises(NetlinkError, match="overruns"):
        parse_class_dump(bytes(bad), 9, 7, [])


@pytest.mark.mininet
def test_class_counters_equal_tc_and_the_sampler_reads_every_point(tmp_path) -> None:
    import re

    import pandas as pd

    from agents.core import config as cfgmod
    from agents.core.class_samples import CLASS_COLUMNS
    from controller.class_sampler import ClassSampler
    from topo.build import Network
    from topo.shapes import shape_spec

    cfg = cfgmod.load("configs/moe.toml", ["net.worker_link_mbps=20", 'topo.role=""'])
    spec = shape_spec(cfg)
    with Network(spec, log=None) as net:
        sampler = ClassSampler(net, 0.002)
        sampler.start()
        net.run("gbh0", ["ping", "-c", "30", "-i", "0.01", "-s", "1400", "-q", "10.0.0.11"])
        time.sleep(0.05)
        sampler.stop_event.set()
        sampler.join(2)
        for point in ("gbh0.up", "gbh1.down", "gbh1.up"):
            place = net.spec.place(point)
            text = net._dev_tc(place.host).tc("-s", "class", "show", "dev", place.dev,
                                              echo=False)
            got = net.point_classes(point)
            for cid, c in got.items():
                block = re.search(rf"class htb {cid} .*?(?=\nclass |\Z)", text, re.S)
                assert block, (cid, text)
                sent = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), "
                                 r"overlimits (\d+)", block.group(0))
                assert sent, block.group(0)
                assert (c.sent_bytes, c.sent_pkts, c.drops, c.overlimits) == tuple(
                    int(x) for x in sent.groups()), (point, cid)
            # 30 echo requests of 1442-byte frames up from gbh0, down into gbh1.
            if point != "gbh1.up":
                assert got["1:1"].sent_pkts >= 30 and got["1:1"].sent_bytes >= 30 * 1442
        # A host's own egress queues pure ACKs apart (ack_first): echo requests are data.
        assert set(net.point_classes("gbh0.up")) == {"1:1", "1:10", "1:11"}
        assert net.point_classes("gbh0.up")["1:11"].sent_bytes >= 30 * 1442
        assert set(net.point_classes("gbh0.down")) == {"1:1"}
        sampler.write(tmp_path / "classes.parquet")
        # The access links' HTB bucket is topo.access_burst_ms (2 ms in configs/moe.toml)
        # at the rate, as the kernel holds it, and it stays 2 ms when the rate changes
        # (a trace replay): 5000 bytes at 20 Mbit/s, 10000 at 40.
        def burst(point: str) -> tuple[float, float]:
            place = net.spec.place(point)
            text = net._dev_tc(place.host).tc("-d", "class", "show", "dev", place.dev,
                                              echo=False)
            m = re.search(r"^class htb 1:1 .* burst (\d+)b\S* .* cburst (\d+)b", text, re.M)
            assert m, text
            return float(m.group(1)), float(m.group(2))
        assert cfg.topo.access_burst_ms == 2
        for point in ("gbh0.up", "gbh1.down"):
            assert burst(point) == pytest.approx((5000, 5000), rel=0.01)
        net.set_point_rate("gbh0.up", 40.0)
        assert burst("gbh0.up") == pytest.approx((10000, 10000), rel=0.01)
    df = pd.read_parquet(tmp_path / "classes.parquet")
    assert list(df.columns) == list(CLASS_COLUMNS)
    assert set(df["point"]) == {p.point.name for p in spec.places()}
    assert sampler.error is None
    spacing_ms = df[df.point == "gbh0.up"]["ts_ns"].diff().dropna() / 1e6
    assert spacing_ms.median() < 4
    up = df[df.point == "gbh0.up"]
    assert up["sent_bytes"].is_monotonic_increasing and up["sent_bytes"].iloc[-1] >= 30 * 1442


def test_qdisc_counters_over_netlink_equal_what_tc_prints() -> None:
    """The link sampler's read (``Network.point_stats``: an ``RTM_GETQDISC`` dump) against
    ``tc -s -j qdisc show`` of the same queue, after a burst that overflowed it: the
    same leaf counters, drops, backlog and HTB's overlimits."""
    import os
    import subprocess
    import sys

    from topo.netlink import RtNetlink
    from topo.spec import LinkSpec
    from topo.tc import Tc

    if os.geteuid() != 0:
        pytest.skip("needs root: a network namespace and a veth")
    host = subprocess.Popen(["unshare", "--net", "sleep", "60"])
    nl = None
    try:
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{host.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            assert time.monotonic() < deadline, "unshare never entered its namespace"
            time.sleep(0.01)
        tc = Tc().in_netns(host.pid, "h")
        tc.run_all([["ip", "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
                    ["ip", "link", "set", "v0", "up"], ["ip", "link", "set", "v1", "up"]])
        # 10 kbit/s: one 1000-byte frame leaves every 0.8 s, so reads close together see
        # the same queue; it holds 5 of the 30 frames sent at once, the rest are dropped.
        tc.run_all(qdisc.shaping_commands("v0", LinkSpec(rate_mbps=0.01, queue_bytes=5000),
                                          {"netem": False, "htb": True, "bfifo": True}))
        # A dropped frame's send says ENOBUFS: expected here.
        send = ("import contextlib, socket\n"
                "s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)\n"
                "s.bind(('v0', 0))\n"
                "for _ in range(30):\n"
                "    with contextlib.suppress(OSError):\n"
                "        s.send(b'\\xff' * 6 + b'\\x02' * 6 + b'\\x08\\x00' + b'x' * 986)\n")
        tc.run([sys.executable, "-c", send])
        nl = RtNetlink(host.pid)

        def read() -> list[qdisc.QdiscStats]:
            assert nl is not None
            return [qdisc.QdiscStats(kind=c.kind, handle=qdisc.tc_handle(c.classid),
                                     parent=qdisc.tc_handle(c.parent), sent_bytes=c.sent_bytes,
                                     sent_pkts=c.sent_pkts, drops=c.drops,
                                     overlimits=c.overlimits, requeues=c.requeues,
                                     backlog_bytes=c.backlog_bytes,
                                     backlog_pkts=c.backlog_pkts)
                    for c in nl.qdisc_counters("v0")]

        # A frame leaves every 0.8 s, and starting tc on a busy machine can take longer:
        # compare only when two netlink reads around tc's agree (the queue did not move).
        for _ in range(10):
            before = read()
            printed = qdisc.bottleneck_counters(tc.run(qdisc.stats_command("v0"), echo=False))
            stats = read()
            if stats == before:
                break
        else:
            pytest.fail("the queue moved during every one of 10 reads")
        got = qdisc.bottleneck_of(stats)
        assert got == printed
        assert got.drops > 0 and got.backlog_pkts > 0 and got.overlimits > 0, got
        assert {(s.kind, s.handle, s.parent) for s in stats} >= {
            ("htb", "1:", "root"), ("bfifo", "20:", "1:1")}
    finally:
        if nl is not None:
            nl.close()
        host.kill()
        host.wait()
