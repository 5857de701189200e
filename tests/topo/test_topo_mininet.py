"""Real Mininet: a shaped star delivers its rate, fails loudly, and leaves nothing behind.

Physical invariant in the style of Mininet's test_hifi.py: iperf3 goodput through the
HTB bottleneck lands within 1 % of the TCP ceiling, rate x 1448/1514.
"""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from topo import qdisc
from topo.build import StarNetwork
from topo.cleanup import cleanup, is_gradbed_link
from topo.lock import NetLock
from topo.probe import probe
from topo.qdisc import CapabilityError
from topo.shapes.star import StarSpec
from topo.spec import TCP_GOODPUT_FRACTION, LinkSpec
from topo.tc import TcError

pytestmark = pytest.mark.mininet

CEILING = TCP_GOODPUT_FRACTION


def star(**kw) -> StarSpec:
    base = {"workers": 2, "worker_link": LinkSpec(rate_mbps=1000.0),
            "bottleneck_up": LinkSpec(rate_mbps=10.0),
            "bottleneck_down": LinkSpec(rate_mbps=100.0)}
    base.update(kw)
    return StarSpec(**base)


def gradbed_links() -> list[str]:
    out = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True,
                         check=True).stdout
    return [ln.split()[0].split("@")[0] for ln in out.splitlines()
            if is_gradbed_link(ln.split()[0].split("@")[0])]


def host_shells() -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if re.search(r"mininet:(ps|w\d+|gbsw\d+)$", ln)]


def assert_nothing_left() -> None:
    """Checked holding the machine-wide network lock: another test's live network (on a
    shared machine) is not this one's leftover."""
    with NetLock(timeout_s=600):
        assert gradbed_links() == []
        assert host_shells() == []


def iperf_goodput_bps(net: StarNetwork, seconds: int = 3) -> float:
    """Receiver goodput from iperf3's end summary, the first second omitted. Over 3 s the
    ends of the interval (a scheduler tick or two of a loaded machine, ~10 ms) weigh
    0.3 %, within the 1 % the goodput is held to."""
    server = net.popen("ps", ["iperf3", "-s", "-1", "-B", net.ip("ps")],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert net.wait_listening("ps", 5201)
    res = net.run("w0", ["iperf3", "-c", net.ip("ps"), "-t", str(seconds), "-O", "1", "-J"],
                  timeout_s=seconds + 30)
    server.wait(timeout=10)
    return float(json.loads(res.stdout)["end"]["sum_received"]["bits_per_second"])


def test_shaped_bottleneck_goodput_within_1pct_at_10_and_100_mbit():
    lines: list[str] = []
    with StarNetwork(star(), log=lines.append) as net:
        assert net.bottleneck_dev("up") == "gbsw0-eth1"
        assert net.bottleneck_dev("down") == "ps-eth0"
        ratios = {}
        for rate in (10.0, 100.0):
            net.set_bottleneck_rate("up", rate)
            ratios[rate] = iperf_goodput_bps(net) / (rate * 1e6 * CEILING)
        stats = net.bottleneck_stats("up")
        assert stats.sent_bytes > 0 and stats.overlimits > 0  # the shaper really throttled
    assert all(abs(r - 1) <= 0.01 for r in ratios.values()), ratios
    assert any(ln.startswith("$ tc class change dev gbsw0-eth1") for ln in lines)
    assert_nothing_left()


def test_worker_cap_changes_rate_in_place_keeping_handle_and_counters():
    with StarNetwork(star()) as net:
        net.run("w0", ["ping", "-c", "3", "-i", "0.05", "-q", net.ip("ps")])
        before = net.qdisc_stats("w0", "w0-eth0")
        net.set_worker_cap("w0", 2.5)
        after = net.qdisc_stats("w0", "w0-eth0")
        classes = net.run("w0", ["tc", "class", "show", "dev", "w0-eth0"]).stdout
        assert [(s.kind, s.handle) for s in after] == [(s.kind, s.handle) for s in before]
        leaf_before = [s for s in before if s.kind == "bfifo"][0]
        leaf_after = [s for s in after if s.kind == "bfifo"][0]
        assert leaf_before.sent_pkts >= 3  # echo requests went through the leaf...
        assert leaf_after.sent_pkts >= leaf_before.sent_pkts  # ...and were not reset
        assert "rate 2500Kbit ceil 2500Kbit" in classes
        assert net.rate_mbps("w0-eth0") == 2.5
        with pytest.raises(ValueError, match="worker='ps'"):
            net.set_worker_cap("ps", 1.0)


SENDER = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 5001))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
start = float(sys.argv[2])
for i in range(int(sys.argv[3])):
    time.sleep(max(0.0, start + 0.3 * i - time.time()))
    s.sendall(b"x" * 100_000)
time.sleep(1.0)
"""
SINK = """
import socket, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5001)); s.listen(64)
def drain(c):
    b = bytearray(1 << 20)
    while c.recv_into(b):
        pass
while True:
    c, _ = s.accept(); threading.Thread(target=drain, args=(c,), daemon=True).start()
"""


def synchronized_bursts(net: StarNetwork, workers: int, rounds: int) -> tuple[int, str]:
    """Every worker sends 100 KB at the same instants; returns (bottleneck drops, w0's
    egress pcap text)."""
    import sys

    sink = net.popen("ps", [sys.executable, "-c", SINK])
    pcap = "/tmp/gradbed-test-w0-egress.pcap"
    dump = net.popen("w0", ["tcpdump", "-i", "w0-eth0", "-w", pcap, "-s", "96", "-n",
                            "tcp and dst port 5001"], stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    before = net.bottleneck_stats("up")
    start = time.time() + 1.0
    senders = [net.popen(f"w{i}", [sys.executable, "-c", SENDER, net.ip("ps"), str(start),
                                   str(rounds)]) for i in range(workers)]
    for p in senders:
        assert p.wait(timeout=60) == 0
    drops = net.bottleneck_stats("up").drops - before.drops
    dump.terminate()
    dump.wait(timeout=10)
    sink.kill()
    text = subprocess.run(["tcpdump", "-r", pcap, "-n", "-ttt"], capture_output=True,
                          text=True).stdout
    return drops, text


def test_link_n_caps_release_small_bursts_and_keep_a_shallow_queue_lossless():
    # 16 workers, 100 KB each at the same instant into a 100 KB bottleneck queue. Capped at
    # B/N the caps must release at most their burst (two frames) plus one sender packet
    # (sender_gso_segs: 2 frames here, never a 64 KB GSO super-packet), and the bottleneck
    # must drop nothing.
    n = 16
    spec = star(workers=n, bottleneck_up=LinkSpec(rate_mbps=100.0, queue_bytes=100_000))
    with StarNetwork(spec) as net:
        for i in range(n):
            net.set_worker_cap(f"w{i}", 100.0 / n)
        drops, text = synchronized_bursts(net, n, rounds=4)
    gaps = [float(ln.split()[0].split(":")[-1]) for ln in text.splitlines() if ln.strip()]
    runs, cur = [], 0
    for g in gaps:  # back-to-back frames (< 0.5 ms apart at 6.25 Mbit/s means a burst)
        if g > 0.0005 and cur:
            runs.append(cur)
            cur = 0
        cur += 1
    runs.append(cur)
    assert len(gaps) > 200, text[:500]
    assert max(runs) <= 2 + spec.sender_gso_segs("w0"), runs
    assert drops == 0


def test_teardown_after_exception_inside_and_cleanup_is_idempotent():
    with pytest.raises(RuntimeError, match="boom"):
        with StarNetwork(star(workers=1)):
            assert "gbsw0" in gradbed_links()
            raise RuntimeError("boom")
    assert_nothing_left()
    with NetLock():  # never pull another run's network away
        assert cleanup() == []
        assert cleanup() == []


def test_teardown_when_build_fails_halfway(monkeypatch):
    real = qdisc.shaping_commands

    def broken(dev, link, caps, **kw):
        cmds = real(dev, link, caps, **kw)
        if dev == "ps-eth0":  # after the switch side of the bottleneck was installed
            cmds[1] = [*cmds[1][:-2], "quantum", "not-a-number"]
        return cmds

    monkeypatch.setattr(qdisc, "shaping_commands", broken)
    with pytest.raises(TcError) as info:
        with StarNetwork(star(workers=1)):
            pytest.fail("build should have failed")
    assert info.value.returncode != 0 and "ps-eth0" in str(info.value)
    assert "host ps" in str(info.value) and info.value.stderr
    assert_nothing_left()


def test_delay_without_any_mechanism_is_a_clear_error_and_builds_nothing():
    # A kernel with neither netem nor NFQUEUE (the caps say so; this one has NFQUEUE).
    caps = {**probe(), "netem": False, "nfqueue": False}
    spec = star(bottleneck_up=LinkSpec(rate_mbps=10.0, delay_ms=5.0))
    with pytest.raises(CapabilityError, match="netem or NFQUEUE") as info:
        with StarNetwork(spec, caps=caps):
            pytest.fail("must not build")
    assert "topo.bottleneck_up" in str(info.value) and "delay_ms" in str(info.value)
    assert_nothing_left()


def test_congestion_control_is_set_per_host_and_validated():
    with StarNetwork(star(workers=1)) as net:
        net.set_congestion_control("cubic")
        out = net.run("w0", ["sysctl", "-n", "net.ipv4.tcp_congestion_control"]).stdout
        assert out.strip() == "cubic"
        with pytest.raises(ValueError, match="'dctcp' is not available.*allowed"):
            net.set_congestion_control("dctcp")


def class_counters(classes: str, classid: str) -> tuple[int, int]:
    """(bytes, packets) sent by HTB class ``classid`` in ``tc -s class show`` output."""
    m = re.search(rf"class htb {classid} .*?Sent (\d+) bytes (\d+) pkt", classes, re.S)
    assert m, classes
    return int(m.group(1)), int(m.group(2))


def wait_for_acks(net: StarNetwork, timeout_s: float, n_pkts: int = 200) -> bool:
    """Whether w0's ACK class (1:10) sends ``n_pkts`` packets within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        classes = net.run("w0", ["tc", "-s", "class", "show", "dev", "w0-eth0"]).stdout
        if class_counters(classes, "1:10")[1] >= n_pkts:
            return True
        time.sleep(0.1)
    return False


def test_acks_first_classifies_pure_acks_and_keeps_the_cap():
    """A worker capped at 2 Mbit/s uploads while it downloads at 10 Mbit/s. With
    ack_first its pure ACKs take class 1:10, its data 1:11, and the two together stay
    within the cap on 1:1 (the ACKs borrow from it, they do not add to it)."""
    spec = star(ack_first=True, bottleneck_up=LinkSpec(rate_mbps=100.0),
                bottleneck_down=LinkSpec(rate_mbps=10.0))
    with StarNetwork(spec) as net:
        net.set_worker_cap("w0", 2.0)
        ps_ip, w0_ip = net.ip("ps"), net.ip("w0")
        net.popen("ps", ["iperf3", "-s", "-1", "-p", "5201", "-B", ps_ip],
                  stdout=subprocess.DEVNULL)
        net.popen("w0", ["iperf3", "-s", "-1", "-p", "5202", "-B", w0_ip],
                  stdout=subprocess.DEVNULL)
        # A client started before its server listens fails at once and the test then
        # measures a direction with no traffic.
        assert net.wait_listening("ps", 5201) and net.wait_listening("w0", 5202)
        # The download starts first: its setup needs messages from w0, and once the
        # capped upload has filled w0's queue those wait seconds behind its data.
        down = net.popen("ps", ["iperf3", "-c", w0_ip, "-p", "5202", "-t", "9"],
                         stdout=subprocess.DEVNULL)
        assert wait_for_acks(net, timeout_s=10.0), "the download never started"
        up = net.popen("w0", ["iperf3", "-c", ps_ip, "-p", "5201", "-t", "7", "-P", "2"],
                       stdout=subprocess.DEVNULL)
        time.sleep(1.5)  # both flows at their rates
        t0 = time.monotonic()
        before = net.run("w0", ["tc", "-s", "class", "show", "dev", "w0-eth0"]).stdout
        time.sleep(3.0)
        after = net.run("w0", ["tc", "-s", "class", "show", "dev", "w0-eth0"]).stdout
        elapsed = time.monotonic() - t0
        # Measured: the flows' remaining seconds would show nothing more.
        for flow in (down, up):
            flow.terminate()
            flow.wait(timeout=30)
    delta = {c: tuple(a - b for a, b in zip(class_counters(after, c),
                                            class_counters(before, c), strict=True))
             for c in ("1:1", "1:10", "1:11")}
    ack_bytes, ack_pkts = delta["1:10"]
    data_bytes, data_pkts = delta["1:11"]
    assert ack_pkts > 1000 and ack_bytes / ack_pkts < 128, delta  # pure ACKs only
    assert data_pkts > 100 and data_bytes / data_pkts > 1000, delta  # full data segments
    assert delta["1:1"][1] == ack_pkts + data_pkts, delta
    # Both children together at the 2 Mbit/s cap (HTB counts whole frames).
    assert delta["1:1"][0] * 8 / elapsed == pytest.approx(2e6, rel=0.06), delta
