"""tc command builders, the stats parser on real iproute2-6.1 output, and the Tc runner."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from topo import qdisc
from topo.cleanup import is_gradbed_link, is_gradbed_process
from topo.qdisc import CapabilityError, QdiscStats
from topo.spec import LinkSpec, SpecError
from topo.tc import Tc, TcError, batches

NO_NETEM = {"netem": False, "htb": True, "bfifo": True}
WITH_NETEM = {"netem": True, "htb": True, "bfifo": True}

# Captured from `tc -s qdisc show dev gbsw0-eth1` after a 5 s iperf3 flow at 100 Mbit/s.
TEXT_AFTER_FLOW = """\
qdisc htb 1: root refcnt 3 r2q 10 default 0x1 direct_packets_stat 0 direct_qlen 1000
 Sent 87460866 bytes 57812 pkt (dropped 0, overlimits 56745 requeues 0)
 backlog 0b 0p requeues 0
qdisc bfifo 20: parent 1:1 limit 250000b
 Sent 87460866 bytes 57812 pkt (dropped 0, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
"""
# Same layout mid-flow at 1 Mbit/s, where iproute2 abbreviates the backlog in kilobytes.
TEXT_WITH_BACKLOG = """\
qdisc htb 1: root refcnt 3 r2q 10 default 0x1 direct_packets_stat 0 direct_qlen 1000
 Sent 1227338 bytes 812 pkt (dropped 225, overlimits 1606 requeues 0)
 backlog 46934b 31p requeues 0
qdisc bfifo 20: parent 1:1 limit 48448b
 Sent 1227338 bytes 812 pkt (dropped 225, overlimits 0 requeues 0)
 backlog 46934b 31p requeues 0
qdisc ingress ffff: parent ffff:fff1 ----------------
 Sent 0 bytes 0 pkt (dropped 0, overlimits 0 requeues 0)
 backlog 2Kb 0p requeues 0
"""
# Captured from `tc -s -j qdisc show dev d0` (iproute2-6.1.0) with htb, bfifo and ingress.
JSON_OUTPUT = (
    '[{"kind":"htb","handle":"1:","root":true,"refcnt":3,"options":{"r2q":10,"default":"0x1",'
    '"direct_packets_stat":0,"direct_qlen":1000},"bytes":735587023,"packets":486150,'
    '"drops":3,"overlimits":139020,"requeues":0,"backlog":3028,"qlen":2},'
    '{"kind":"bfifo","handle":"20:","parent":"1:1","options":{"limit":2500000},'
    '"bytes":735587023,"packets":486150,"drops":3,"overlimits":0,"requeues":0,'
    '"backlog":3028,"qlen":2},'
    '{"kind":"ingress","handle":"ffff:","parent":"ffff:fff1","options":{},"bytes":0,'
    '"packets":0,"drops":0,"overlimits":0,"requeues":0,"backlog":0,"qlen":0}]')


def test_shaping_commands_htb_then_bfifo():
    cmds = qdisc.shaping_commands("gbsw0-eth1", LinkSpec(rate_mbps=100.0, queue_bytes=90_000),
                                  NO_NETEM)
    assert cmds == [
        ["tc", "qdisc", "replace", "dev", "gbsw0-eth1", "root", "handle", "1:", "htb",
         "default", "1"],
        ["tc", "class", "replace", "dev", "gbsw0-eth1", "parent", "1:", "classid", "1:1",
         "htb", "rate", "100000000bit", "ceil", "100000000bit", "burst", "125000", "cburst",
         "125000", "quantum", str(qdisc.HTB_QUANTUM_BYTES)],
        ["tc", "qdisc", "replace", "dev", "gbsw0-eth1", "parent", "1:1", "handle", "20:",
         "bfifo", "limit", "90000"],
    ]


def test_burst_scales_with_rate_and_never_below_two_frames():
    assert qdisc.htb_burst_bytes(1.0) == 2 * 1514
    assert qdisc.htb_burst_bytes(1000.0) == int(1e9 / 8 * qdisc.HTB_BURST_S)
    assert qdisc.htb_burst_bytes(1.0, offload=True) == 2 * qdisc.GSO_FRAME_BYTES
    assert qdisc.rate_arg(10_000.0) == "10000000000bit"
    assert qdisc.rate_arg(0.5) == "500000bit"
    with pytest.raises(SpecError, match="rate_mbps=20000"):
        qdisc.rate_arg(20_000.0)


def test_cap_burst_fits_all_caps_in_half_the_bottleneck_queue():
    # 16 caps of 6.25 Mbit/s into a 100 KB queue: 10 ms each (7.8 KB) would be 125 KB.
    assert qdisc.cap_burst_bytes(6.25, 100_000, 16) == 100_000 // 32
    assert qdisc.cap_burst_bytes(6.25, 50_000, 16) == 2 * 1514
    assert qdisc.cap_burst_bytes(25.0, 400_000, 4) == qdisc.htb_burst_bytes(25.0)
    assert qdisc.cap_burst_bytes(62.5, 1_000_000, 16) == 1_000_000 // 32
    for rate, queue, n in [(1.0, 10_000, 64), (62.5, 100_000, 16), (500.0, 10**7, 2)]:
        b = qdisc.cap_burst_bytes(rate, queue, n)
        assert 2 * 1514 <= b <= max(2 * 1514, qdisc.htb_burst_bytes(rate))
    assert qdisc.cap_burst_bytes(6.25, 100_000, 16, offload=True) == 2 * qdisc.GSO_FRAME_BYTES
    with pytest.raises(SpecError, match="n_workers=0"):
        qdisc.cap_burst_bytes(6.25, 100_000, 0)
    args = qdisc.change_rate_commands("w0-eth0", 6.25, burst_bytes=3028)[0]
    assert args[args.index("burst") + 1] == "3028" and args[args.index("cburst") + 1] == "3028"


def test_offload_off_also_limits_gso_to_one_segment():
    # A local TCP sender builds GSO packets even with the device's GSO off; only
    # gso_max_segs 1 makes the sender's own HTB see (and release) single frames.
    off = qdisc.offload_commands("w0-eth0", False)
    assert off == [["ethtool", "-K", "w0-eth0", "gso", "off", "tso", "off", "gro", "off"],
                   ["ip", "link", "set", "dev", "w0-eth0", "gso_max_segs", "1"]]
    assert qdisc.offload_commands("w0-eth0", False, 2)[1][-1] == "2"
    with pytest.raises(SpecError, match="gso_max_segs=0"):
        qdisc.offload_commands("w0-eth0", False, 0)
    on = qdisc.offload_commands("w0-eth0", True)
    assert on[1][-1] == str(qdisc.GSO_MAX_SEGS_DEFAULT) and on[0][4] == "on"


def test_unshaped_link_installs_nothing():
    assert qdisc.shaping_commands("w0-eth0", LinkSpec(rate_mbps=None), NO_NETEM) == []


def test_netem_goes_between_htb_and_bfifo_when_present():
    cmds = qdisc.shaping_commands("ps-eth0", LinkSpec(rate_mbps=10.0, delay_ms=5,
                                                      loss_pct=0.5), WITH_NETEM)
    assert cmds[2] == ["tc", "qdisc", "replace", "dev", "ps-eth0", "parent", "1:1", "handle",
                       "10:", "netem", "limit", "100000", "delay", "5000us", "loss", "0.5%"]
    assert cmds[3][5:8] == ["parent", "10:1", "handle"]
    assert cmds[3][-3:] == ["bfifo", "limit", str(default_queue(10.0))]


def default_queue(rate_mbps: float) -> int:
    return LinkSpec(rate_mbps=rate_mbps).effective_queue_bytes()


def test_delay_without_netem_names_the_missing_qdisc():
    with pytest.raises(CapabilityError) as info:
        qdisc.shaping_commands("ps-eth0", LinkSpec(rate_mbps=10.0, delay_ms=5), NO_NETEM)
    msg = str(info.value)
    assert "netem" in msg and "delay_ms=5" in msg and "ps-eth0" in msg
    with pytest.raises(CapabilityError, match="loss_pct"):
        qdisc.shaping_commands("ps-eth0", LinkSpec(rate_mbps=None, loss_pct=1), {})


def test_change_rate_is_class_change_never_delete():
    cmds = qdisc.change_rate_commands("w0-eth0", 25.0)
    assert len(cmds) == 1
    assert cmds[0][:4] == ["tc", "class", "change", "dev"]
    assert "25000000bit" in cmds[0]
    assert not any("del" in arg for cmd in cmds for arg in cmd)
    q = qdisc.change_queue_commands("w0-eth0", 30_000)
    assert q == [["tc", "qdisc", "change", "dev", "w0-eth0", "parent", "1:1", "handle", "20:",
                  "bfifo", "limit", "30000"]]


def test_parse_text_stats():
    stats = qdisc.parse_tc_stats(TEXT_AFTER_FLOW)
    assert [(s.kind, s.handle, s.parent) for s in stats] == [("htb", "1:", "root"),
                                                            ("bfifo", "20:", "1:1")]
    assert stats[0].overlimits == 56745
    assert stats[1].sent_bytes == 87460866 and stats[1].sent_pkts == 57812
    with_backlog = qdisc.parse_tc_stats(TEXT_WITH_BACKLOG)
    assert with_backlog[1].backlog_bytes == 46934 and with_backlog[1].backlog_pkts == 31
    assert with_backlog[1].drops == 225
    assert with_backlog[2].backlog_bytes == 2000  # "2Kb": iproute2 uses powers of 1000


def test_parse_json_stats_and_bottleneck_counters():
    stats = qdisc.parse_tc_stats(JSON_OUTPUT)
    assert [s.kind for s in stats] == ["htb", "bfifo", "ingress"]
    leaf = qdisc.bottleneck_counters(JSON_OUTPUT)
    assert leaf == QdiscStats(kind="bfifo", handle="20:", parent="1:1",
                              sent_bytes=735587023, sent_pkts=486150, drops=3,
                              overlimits=139020, requeues=0, backlog_bytes=3028,
                              backlog_pkts=2)
    # Text and JSON of the same layout give the same bottleneck view.
    assert qdisc.bottleneck_counters(TEXT_WITH_BACKLOG).overlimits == 1606


def test_stats_errors_say_what_is_missing():
    with pytest.raises(ValueError, match="no bfifo 20: leaf .found: htb 1:"):
        qdisc.bottleneck_counters(TEXT_AFTER_FLOW.split("qdisc bfifo")[0])
    with pytest.raises(ValueError, match="bad JSON"):
        qdisc.parse_tc_stats("[{")


def test_dry_run_records_and_echoes_without_running():
    lines: list[str] = []
    tc = Tc(log=lines.append, dry_run=True)
    host = tc.in_netns(4242, "w0")
    tc.run_all(qdisc.change_rate_commands("gbsw0-eth1", 50.0))
    host.tc("qdisc", "show", "dev", "w0-eth0")
    assert tc.recorded == host.recorded and len(tc.recorded) == 2
    assert lines[0].startswith("$ tc class change dev gbsw0-eth1 parent 1: classid 1:1 htb")
    assert lines[1] == "$ tc qdisc show dev w0-eth0  # in w0"
    assert host.full_argv(["tc"]) == ["nsenter", "-t", "4242", "-n", "--", "tc"]


def test_failing_command_raises_with_exit_code_and_stderr():
    lines: list[str] = []
    tc = Tc(log=lines.append)
    with pytest.raises(TcError) as info:
        tc.run([sys.executable, "-c", "import sys; sys.stderr.write('RTNETLINK: boom'); "
                                      "sys.exit(2)"])
    err = info.value
    assert err.returncode == 2 and err.stderr == "RTNETLINK: boom"
    assert "exit 2" in str(err) and "boom" in str(err) and "root namespace" in str(err)
    assert lines and lines[0].startswith("$ ")
    with pytest.raises(TcError, match="not found"):
        tc.run(["gradbed-no-such-binary"])
    assert tc.run([sys.executable, "-c", "print('ok')"], echo=False) == "ok\n"
    assert len(lines) == 2  # the quiet query was not echoed


def test_commands_for_another_server_go_as_one_session_that_names_the_failed_one(tmp_path):
    # "sh -c" stands in for "ssh root@SERVER": it runs the one command line it is given.
    lines: list[str] = []
    there = Tc(log=lines.append).on_server(("sh", "-c"), "10.99.0.2")
    out = tmp_path / "order"
    there.run_all([["sh", "-c", f"echo one >> {out}"], ["sh", "-c", f"echo 'two words' >> {out}"]])
    assert out.read_text() == "one\ntwo words\n"
    assert lines[0].endswith("  # on 10.99.0.2")
    with pytest.raises(TcError) as info:
        there.run_all([["true"], [sys.executable, "-c", "import sys; sys.stderr.write('boom');"
                                                       " sys.exit(3)"], ["sh", "-c", f"echo no >> {out}"]])
    err = info.value
    assert err.argv[0] == sys.executable and err.returncode == 3 and err.stderr == "boom"
    assert "root namespace on 10.99.0.2" in str(err)
    assert out.read_text().count("no") == 0  # nothing after the failed command ran
    host = there.in_netns(4242, "w0")
    assert host.full_argv(["tc", "qdisc", "show"]) == [
        "sh", "-c", "nsenter -t 4242 -n -- tc qdisc show"]


def test_cleanup_matches_only_gradbed_names():
    for name in ["gbsw0", "gbsw0-eth1", "gbsw12-eth33", "w3-eth0", "ps-eth0", "bg1-eth0"]:
        assert is_gradbed_link(name), name
    for name in ["eth0", "lo", "ifb0", "s1-eth1", "h1-eth0", "gbsw", "docker0", "ps"]:
        assert not is_gradbed_link(name), name
    assert is_gradbed_process(["python", "-m", "agents.dp.worker", "--rank", "0"]) == (
        "agent agents.dp.worker")
    assert is_gradbed_process(["bash", "--norc", "--noediting", "-is", "mininet:w3"])
    assert is_gradbed_process(["bash", "--norc", "-is", "mininet:h1"]) is None
    assert is_gradbed_process(["python", "-m", "pytest"]) is None
    # Background iperf3 on gradbed's ports counts as an agent (only inside a host's
    # namespace, see leftover_processes); anyone else's iperf3 never does.
    assert is_gradbed_process(["iperf3", "-s", "-1", "-B", "10.0.0.1", "-p", "15201"]) == (
        "agent iperf3 (background, port 15201)")
    assert is_gradbed_process(["iperf3", "-s", "-p", "5201"]) is None
    assert is_gradbed_process(["iperf3", "-c", "10.0.0.1", "-p"]) is None


def test_ack_first_layout_puts_pure_acks_ahead_under_the_same_cap():
    link = LinkSpec(rate_mbps=1000.0, queue_bytes=50_000)
    cmds = qdisc.shaping_commands("w0-eth0", link, NO_NETEM, ack_first=True)
    text = [" ".join(c) for c in cmds]
    assert text[0].endswith("root handle 1: htb default 11")  # unclassified -> data
    assert "classid 1:1 htb rate 1000000000bit ceil 1000000000bit" in text[1]  # the cap
    ack, data = text[2], text[3]
    assert "parent 1:1 classid 1:10 htb rate 8000bit" in ack and "prio 0" in ack
    assert "parent 1:1 classid 1:11 htb rate 8000bit" in data and "prio 1" in data
    assert "parent 1:10 handle 21: pfifo" in text[4]
    assert text[5].startswith("tc filter replace dev w0-eth0 parent 1: protocol ip")
    assert text[5].endswith("match u8 0x10 0xff at 33 flowid 1:10")
    assert text[6].endswith("parent 1:11 handle 20: bfifo limit 50000")
    assert qdisc.change_queue_commands("w0-eth0", 9000, ack_first=True)[0][6] == "1:11"
    # Rate changes touch only the cap (1:1): the children borrow all they send from it.
    assert qdisc.change_rate_commands("w0-eth0", 6.25)[0][8] == "1:1"
    # Without the flag, or with netem (the ACKs would skip its delay), the plain layout.
    assert qdisc.shaping_commands("w0-eth0", link, NO_NETEM) == qdisc.shaping_commands(
        "w0-eth0", link, NO_NETEM, ack_first=False)
    delayed = LinkSpec(rate_mbps=10.0, delay_ms=5)
    assert not any("1:10" in " ".join(c) for c in qdisc.shaping_commands(
        "w0-eth0", delayed, {"netem": True}, ack_first=True))


def test_consecutive_tc_and_ip_commands_are_cut_into_batches_in_order():
    cmds = [["ethtool", "-K", "w0-eth0", "gso", "off"],
            ["ip", "link", "set", "dev", "w0-eth0", "gso_max_segs", "1"],
            ["tc", "qdisc", "replace", "dev", "w0-eth0", "root", "handle", "1:", "htb"],
            ["tc", "class", "replace", "dev", "w0-eth0", "parent", "1:", "classid", "1:1"],
            ["tc", "-s", "qdisc", "show"],  # a global option: alone
            ["tc", "filter", "add", "dev", "w0-eth0", "u32", "match", "#x"],  # a comment
            ["tc", "qdisc", "show"], ["tc", "class", "show"]]
    got = batches(cmds)
    assert got == [(None, [cmds[0]]), ("ip", [cmds[1]]), ("tc", cmds[2:4]), (None, [cmds[4]]),
                   (None, [cmds[5]]), ("tc", cmds[6:8])]
    assert [c for _, group in got for c in group] == cmds  # nothing lost, nothing moved


@pytest.fixture
def own_netns():
    """A process in a network namespace of its own with a veth pair (a host's stand-in)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: a network namespace and a veth")
    p = subprocess.Popen(["unshare", "--net", "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{p.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            assert time.monotonic() < deadline, "unshare never entered its namespace"
            time.sleep(0.01)
        Tc().in_netns(p.pid, "h").run(["ip", "link", "add", "v0", "type", "veth", "peer",
                                       "name", "v1"])
        yield p.pid
    finally:
        p.kill()
        p.wait()


def test_a_batch_runs_in_the_hosts_namespace_and_names_the_command_that_failed(own_netns,
                                                                               monkeypatch):
    started: list[list[str]] = []
    real_run = subprocess.run

    def counted(argv, **kw):
        started.append(list(argv))
        return real_run(argv, **kw)

    monkeypatch.setattr(subprocess, "run", counted)
    lines: list[str] = []
    host = Tc(log=lines.append).in_netns(own_netns, "h")
    cmds = [*qdisc.offload_commands("v0", False, 2),
            *qdisc.shaping_commands("v0", LinkSpec(rate_mbps=10.0, queue_bytes=20_000),
                                    NO_NETEM)]
    host.run_all(cmds)
    # ethtool, ip, and the three tc commands as one process; each still echoed.
    assert [a[5:] for a in started] == [cmds[0], cmds[1], ["tc", "-batch", "-"]]
    assert [ln.split("  # ")[0][2:] for ln in lines] == [" ".join(c) for c in cmds]
    shown = host.run(["tc", "qdisc", "show", "dev", "v0"], echo=False)
    assert "htb 1: root" in shown and "bfifo 20: parent 1:1 limit 20000b" in shown
    assert "gso_max_segs 2" in host.run(["ip", "-d", "link", "show", "v0"], echo=False)
    good = ["tc", "qdisc", "replace", "dev", "v1", "root", "bfifo", "limit", "3000"]
    bad = ["tc", "qdisc", "replace", "dev", "nosuch0", "root", "handle", "1:", "htb"]
    after = ["tc", "qdisc", "replace", "dev", "v1", "root", "pfifo", "limit", "7"]
    with pytest.raises(TcError) as info:
        host.run_all([good, bad, after])
    err = info.value
    assert err.argv == bad and "nosuch0" in err.stderr and "Command failed" not in err.stderr
    assert "host h (pid" in str(err)
    shown = host.run(["tc", "qdisc", "show", "dev", "v1"], echo=False)
    assert "bfifo" in shown and "pfifo" not in shown.replace("bfifo", "")  # it stopped there
