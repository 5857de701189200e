"""The delay line's netlink codec and release schedule, and the netfilter rule plans
(pure: no root). The real thing runs in tests/topo/test_delay_mininet.py."""

from __future__ import annotations

import struct

import pytest

from topo import delayline as dl
from topo.build import impairments, require_impairments
from topo.netfilter import (
    Impairment,
    delay_queues,
    mechanisms,
    parse_queue_counters,
    rule_commands,
)
from topo.qdisc import CapabilityError
from topo.shapes.star import StarSpec
from topo.spec import LinkSpec


def packet_notice(queue: int, packet_id: int, stamp: tuple[int, int] | None = None) -> bytes:
    """An NFQNL_MSG_PACKET as the kernel sends it (META: header, maybe a stamp)."""
    attrs = dl._attr(dl.NFQA_PACKET_HDR, dl.PACKET_HDR.pack(packet_id, 0x0800, 0))
    if stamp is not None:
        attrs += dl._attr(dl.NFQA_TIMESTAMP, dl.TIMESTAMP.pack(*stamp))
    return dl._message(dl.NFQNL_MSG_PACKET, queue, attrs, family=dl.AF_INET)


def test_packet_notices_parse_with_id_queue_and_stamp() -> None:
    buf = packet_notice(100, 7) + packet_notice(101, 8, (1_700_000_000, 250))
    got = list(dl.parse_messages(buf))
    assert got == [dl.Packet(100, 7, None), dl.Packet(101, 8, 1_700_000_000_000_250_000)]


def test_errors_parse_and_malformed_datagrams_raise() -> None:
    err = dl.NLMSG_HDR.pack(36, dl.NLMSG_ERROR, 0, 5, 0) + struct.pack("=i", -2) + b"\0" * 16
    assert list(dl.parse_messages(err)) == [dl.NetlinkError(code=-2, seq=5)]
    good = packet_notice(100, 1)
    with pytest.raises(dl.DelayLineError, match="does not fit"):
        list(dl.parse_messages(good[:-4]))
    no_hdr = dl._message(dl.NFQNL_MSG_PACKET, 100, b"", family=dl.AF_INET)
    with pytest.raises(dl.DelayLineError, match="without NFQA_PACKET_HDR"):
        list(dl.parse_messages(no_hdr))


def test_batch_verdict_and_config_messages_carry_what_the_kernel_reads() -> None:
    msg = dl.verdict_batch(100, 42)
    length, kind, flags, _, _ = dl.NLMSG_HDR.unpack_from(msg)
    assert length == len(msg) and kind == (3 << 8) | dl.NFQNL_MSG_VERDICT_BATCH
    assert flags & dl.NLM_F_REQUEST
    assert dl.NFGEN_HDR.unpack_from(msg, 16) == (0, 0, 100)
    assert struct.unpack_from("!II", msg, 24) == (dl.NF_ACCEPT, 42)
    bind, conf = dl.config_messages(100, maxlen_pkts=5000)
    assert struct.unpack_from("!B", bind, 24)[0] == dl.NFQNL_CFG_CMD_BIND
    # META copy mode, the queue length, GSO whole, and FAIL_OPEN in the mask but not set.
    assert struct.pack("!IB", 0, dl.NFQNL_COPY_META) in conf
    assert struct.pack("!I", 5000) in conf
    assert dl._attr(dl.NFQA_CFG_MASK, struct.pack("!I", 0x5)) in conf
    assert dl._attr(dl.NFQA_CFG_FLAGS, struct.pack("!I", 0x4)) in conf
    with pytest.raises(dl.DelayLineError, match="queue=70000"):
        dl.verdict_batch(70000, 1)


def test_release_is_everything_older_than_the_delay_in_order() -> None:
    line = dl.DelayLine(queue=100, delay_ms=10.0)
    for i, t_ms in enumerate([0.0, 1.0, 2.0, 15.0]):
        line.arrive(i, int(t_ms * 1e6))
    assert line.next_due_ns() == 10_000_000
    assert line.due(9_999_999) is None
    assert line.due(11_500_000) == 1  # ids 0 and 1 in one batch
    assert line.due(12_000_000) == 2
    assert line.due(20_000_000) is None and line.next_due_ns() == 25_000_000
    assert line.stats.packets == 3 and line.stats.batches == 2 and line.stats.max_held == 4
    assert line.stats.late_max_us == pytest.approx(1500.0)
    with pytest.raises(dl.DelayLineError, match="delay_ms"):
        dl.DelayLine(queue=1, delay_ms=-1)


def test_verdicts_built_ahead_release_exactly_the_planned_ids() -> None:
    # The loop plans the batch for the next due time before spinning; packets that fall
    # due while it spins wait for the next batch, and lateness is charged at the send.
    line = dl.DelayLine(queue=100, delay_ms=1.0)
    for i, t_us in enumerate([0, 10, 500, 2000]):
        line.arrive(i + 1, t_us * 1000)
    assert line.last_due_id(1_009_999) == 1 and line.last_due_id(999_999) is None
    assert line.last_due_id(1_600_000) == 3 and len(line.held) == 4  # a peek releases nothing
    line.release_through(2, now_ns=1_520_000)  # sent late, after id 3 fell due too
    assert [pid for _, pid in line.held] == [3, 4]
    assert line.stats.packets == 2 and line.stats.batches == 1
    assert line.stats.late_max_us == pytest.approx(520.0)
    assert line.stats.late_sum_us == pytest.approx(520.0 + 510.0)
    assert line.due(1_520_000) == 3 and line.stats.late_max_us == pytest.approx(520.0)


def test_packets_due_before_their_notice_was_read_are_counted() -> None:
    line = dl.DelayLine(queue=100, delay_ms=1.0)
    line.arrive(1, 0, read_ns=400_000)
    line.arrive(2, 0, read_ns=1_000_000)
    assert line.stats.read_late == 1


def test_queue_arguments_are_checked() -> None:
    assert dl.parse_queue_arg("100:2.5") == (100, 2.5)
    for bad in ("100", "x:1", "100:-3", "99999:1"):
        with pytest.raises(dl.DelayLineError):
            dl.parse_queue_arg(bad)


def test_a_bad_fixed_spin_is_refused_naming_the_option(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    assert dl.main(["--queue", "1:1", "--spin-us", "-5"]) == 2  # before any socket opens
    assert "--spin-us" in capsys.readouterr().err


def test_rules_put_loss_before_the_queue_and_never_bypass() -> None:
    imps = [Impairment("ps-eth0", delay_ms=5, loss_pct=1.0),
            Impairment("ps-eth0", delay_ms=7, sources=("10.0.0.10", "10.0.0.11"))]
    cmds = rule_commands(imps)
    text = [" ".join(c) for c in cmds]
    assert "--probability 0.01" in text[0] and text[0].endswith("-j DROP")
    assert text[1].endswith("NFQUEUE --queue-num 100")
    assert "-s 10.0.0.10" in text[2] and "-s 10.0.0.11" in text[3]
    assert all("--queue-num 101" in t for t in text[2:])
    assert not any("bypass" in t for t in text)
    assert [c[4] for c in rule_commands(imps, "-D")] == ["-D"] * 4
    assert delay_queues(imps) == [(100, 5), (101, 7)]


def test_mechanisms_prefer_netem_then_netfilter() -> None:
    assert mechanisms({"netem": True, "nfqueue": True}) == {"delay": "netem", "loss": "netem"}
    assert mechanisms({"netem": False, "nfqueue": True, "xt_statistic": True}) == {
        "delay": "nfqueue", "loss": "statistic"}
    assert mechanisms({}) == {"delay": None, "loss": None}


def test_star_paths_sum_their_delays_and_combine_their_losses() -> None:
    spec = StarSpec(workers=2, worker_link=LinkSpec(rate_mbps=1000.0, delay_ms=1.0),
                    bottleneck_up=LinkSpec(rate_mbps=100.0, delay_ms=20.0, loss_pct=1.0),
                    bottleneck_down=LinkSpec(rate_mbps=100.0, delay_ms=10.0))
    plan = impairments(spec)
    # Into ps: the worker's own link (1 ms) then the up bottleneck (20 ms, 1 %).
    assert plan["ps"] == [Impairment("ps-eth0", delay_ms=21.0, loss_pct=1.0)]
    # Into w0: from ps 10 + 1 ms; from w1 1 + 1 ms (a switch-local path).
    by_src = {i.sources: i for i in plan["w0"]}
    assert by_src[("10.0.0.1",)].delay_ms == 11.0 and by_src[("10.0.0.11",)].delay_ms == 2.0
    lossy = StarSpec(workers=1, worker_link=LinkSpec(rate_mbps=None, loss_pct=10.0),
                     bottleneck_up=LinkSpec(rate_mbps=None, loss_pct=10.0))
    assert impairments(lossy)["ps"][0].loss_pct == pytest.approx(19.0)
    assert impairments(StarSpec(workers=1)) == {}


def test_a_kernel_without_any_mechanism_is_refused_naming_the_link() -> None:
    spec = StarSpec(workers=1, bottleneck_down=LinkSpec(rate_mbps=10.0, loss_pct=2.0))
    with pytest.raises(CapabilityError, match=r"topo.bottleneck_down.loss_pct=2 needs"):
        require_impairments(spec, {"netem": False, "nfqueue": True, "xt_statistic": False})
    assert require_impairments(spec, {"netem": True})["loss"] == "netem"


def test_kernel_queue_counters_parse() -> None:
    text = "  100  31004     3 1     0     7     2       10  1\n"
    assert parse_queue_counters(text) == {100: {"portid": 31004, "held": 3,
                                                "queue_dropped": 7, "user_dropped": 2,
                                                "id_sequence": 10}}


def test_the_heterogeneous_config_plans_delay_lines_and_w0s_cellular_uplink() -> None:
    from pathlib import Path

    from agents.core import config as cfgmod
    from controller.run import plan_commands

    cfg = cfgmod.load(Path(__file__).resolve().parents[2] / "configs" / "heterogeneous.toml")
    caps = {"netem": False, "nfqueue": True, "xt_statistic": True,
            "tcp_congestion_control": ["cubic"]}
    text = "\n".join(plan_commands(cfg, caps))
    assert text.count("-m topo.delayline --queue 100:15") == 5  # ps and the four workers
    assert "trace replay: w0.up=traces/data/cellular_like.log on w0-eth0" in text
    assert "rate 100000000bit" in text  # the workers' own 100 Mbit/s links
