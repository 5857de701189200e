"""Shapes turn a config into a NetSpec; one plan drives both the builder and the dry run.
Pure: no root."""

from __future__ import annotations

import dataclasses

import pytest

from agents.core import config as cfgmod
from controller.background import commands
from controller.run import plan_commands
from topo import qdisc
from topo.build import Network
from topo.netfilter import Impairment
from topo.plan import build_plan, impairments
from topo.shapes import get, names, register, shape_spec
from topo.shapes.star import StarSpec, star_spec
from topo.spec import (
    EdgeSpec,
    HostSpec,
    LinkSpec,
    NetSpec,
    ShapingPoint,
    SpecError,
    SwitchSpec,
)

CAPS = {"netem": False, "tcp_congestion_control": ["cubic"]}
NFQ = {"netem": False, "nfqueue": True, "xt_statistic": True}


def cfg(*overrides: str) -> cfgmod.ExperimentConfig:
    return cfgmod.load("configs/demo.toml", list(overrides))


def test_the_three_shapes_are_registered_and_an_unknown_one_is_named():
    assert {"star", "dumbbell", "fabric"} <= set(names())
    with pytest.raises(SpecError, match="topo.shape = 'ring': must be one of .*dumbbell"):
        get("ring")


def test_star_places_every_point_where_the_star_always_had_it():
    spec = shape_spec(cfg("net.background_hosts=1"))
    where = {p.point.name: (p.host, p.dev) for p in spec.places()}
    assert where["up"] == (None, "gbsw0-eth1")
    assert where["down"] == ("ps", "ps-eth0")
    assert where["w0.up"] == ("w0", "w0-eth0") and where["w0.down"] == (None, "gbsw0-eth2")
    assert where["bg0.up"] == ("bg0", "bg0-eth0")
    assert spec.watch == ("up", "down")
    assert [(h.name, h.role, h.ip) for h in spec.hosts][:2] == [("ps", "ps", "10.0.0.1"),
                                                               ("w0", "worker", "10.0.0.10")]
    star = star_spec(cfg("net.background_hosts=1"))
    assert {h.name: h.gso_segs for h in spec.hosts} == {
        h: star.sender_gso_segs(h) for h in star.host_names()}
    assert spec.point("up").link == star.bottleneck_up
    assert spec.point("w0.up").ack_first and not spec.point("w0.down").ack_first


def test_star_plan_is_exactly_the_qdisc_commands_of_each_point():
    spec = StarSpec(workers=2, ack_first=True).net_spec()
    steps = build_plan(spec, CAPS)
    up = [list(s.argv) for s in steps if s.what == "up"]
    assert up == qdisc.shaping_commands("gbsw0-eth1", spec.point("up").link, CAPS)
    w1 = [list(s.argv) for s in steps if s.what == "w1.up"]
    assert w1 == qdisc.shaping_commands("w1-eth0", spec.point("w1.up").link, CAPS,
                                        ack_first=True)
    assert all(s.host == "w1" for s in steps if s.what == "w1.up")
    # Offload first, on every interface of every edge (both veth ends).
    offload = [s for s in steps if s.what == "offload"]
    assert steps[:len(offload)] == offload
    assert {s.dev for s in offload} == {"ps-eth0", "w0-eth0", "w1-eth0", "gbsw0-eth1",
                                        "gbsw0-eth2", "gbsw0-eth3"}


def test_dry_run_prints_the_builders_plan():
    c = cfg("net.workers=2")
    lines = plan_commands(c, CAPS)
    spec = shape_spec(c)
    planned = ["$ " + " ".join(s.argv) for s in build_plan(spec, CAPS)]
    builder = [ln for ln in lines if ln.startswith("$ ") and "agents." not in ln
               and "gradbed-admission" not in ln]
    assert builder == planned
    # Then, before each listening agent, the kernel's admission rules in its host.
    ps = next(i for i, ln in enumerate(lines) if "agents.dp.ps" in ln)
    assert "gradbed-admission" in lines[ps - 1] and lines[ps - 1].endswith("# in ps")


def test_dumbbell_trunk_is_the_bottleneck_and_background_flows_cross_it(tmp_path):
    c = cfg("topo.shape=\"dumbbell\"", "net.background_hosts=2", "background.flows=2",
            "net.bottleneck_mbps=40")
    spec = shape_spec(c)
    assert spec.place("up").dev == "gbsw0-eth1" and spec.place("up").host is None
    assert spec.place("down").dev == "gbsw1-eth1"
    assert spec.point("up").link.rate_mbps == 40 and spec.point("up").link.queue_bytes == 500_000
    left = {e.a for e in spec.edges if e.b == "gbsw0"}
    right = {e.a for e in spec.edges if e.b == "gbsw1"} - {"gbsw0"}  # and the trunk
    assert left == {"w0", "w1", "w2", "w3", "bg0", "bg1"}
    assert right == {"ps", "sink0", "sink1"}
    cmds = commands(c, spec, tmp_path)
    servers = [x for x in cmds if x.role == "server"]
    assert [x.host for x in servers] == ["sink0", "sink1"]
    client = next(x for x in cmds if x.host == "bg1")
    assert client.argv[client.argv.index("-c") + 1] == spec.ip("sink1")
    # The workers still reach the one PS.
    assert "--ps 10.0.0.1" in "\n".join(plan_commands(c, CAPS))


def test_fabric_shapes_every_access_link_both_ways_and_delays_once():
    c = cfg("topo.shape=\"fabric\"", "topo.hosts=3", "net.worker_link_mbps=200",
            "net.delay_ms=5")
    spec = shape_spec(c)
    assert spec.host_names() == ["gbh0", "gbh1", "gbh2"]
    assert all(h.role == "" for h in spec.hosts)
    for h in spec.host_names():
        assert spec.point(f"{h}.up").link.rate_mbps == 200
        assert spec.point(f"{h}.down").link.rate_mbps == 200
        assert spec.point(f"{h}.up").link.delay_ms == 5
        assert spec.point(f"{h}.down").link.delay_ms == 0
    # A kernel with no way to delay refuses, naming the point; never silence.
    with pytest.raises(qdisc.CapabilityError, match="point gbh0.up.delay_ms=5 needs"):
        build_plan(spec, {"netem": False})
    # Without netem the delay goes to the receivers: every path crosses one .up point.
    imps = impairments(spec)
    assert imps["gbh1"] == [Impairment("gbh1-eth0", delay_ms=5.0)]
    assert not any("netem" in " ".join(s.argv) for s in build_plan(spec, NFQ))


def _burst_args(spec, point: str) -> list[str]:
    """The burst and cburst values the plan installs on ``point``'s class 1:1."""
    for step in build_plan(spec, NFQ):
        a = list(step.argv)
        if step.what == point and "classid" in a and a[a.index("classid") + 1] == "1:1":
            return [a[a.index("burst") + 1], a[a.index("cburst") + 1]]
    raise AssertionError(f"no class 1:1 for {point}")


def test_fabric_access_burst_is_the_configured_time_at_the_rate():
    base = ("topo.shape=\"fabric\"", "topo.hosts=2", "net.worker_link_mbps=100")
    spec = shape_spec(cfg(*base, "topo.access_burst_ms=2"))
    for point in ("gbh0.up", "gbh0.down", "gbh1.up", "gbh1.down"):
        assert spec.point(point).link.burst_ms == 2
        assert _burst_args(spec, point) == ["25000", "25000"]  # 2 ms at 12.5 MB/s
    # 0 keeps gradbed's default bucket (10 ms: 125 KB at 100 Mbit/s); at least two frames.
    default = shape_spec(cfg(*base))
    assert default.point("gbh0.up").link.burst_ms is None
    assert _burst_args(default, "gbh0.up") == ["125000", "125000"]
    assert qdisc.htb_burst_bytes(1.0, burst_ms=2) == 2 * 1514
    with pytest.raises(cfgmod.ConfigError, match="topo.access_burst_ms"):
        cfg(*base, "topo.access_burst_ms=-1")
    with pytest.raises(SpecError, match="burst_ms"):
        LinkSpec(rate_mbps=10, burst_ms=0.01)


def test_dumbbell_paths_cross_the_trunk_once():
    c = cfg("topo.shape=\"dumbbell\"", "net.workers=2", "net.background_hosts=1",
            "net.delay_ms=10", "net.loss_pct=1")
    imps = impairments(shape_spec(c))
    # Into ps: every left host crosses the trunk (10 ms, 1 %); sink0 is on ps's side.
    assert imps["ps"] == [Impairment("ps-eth0", delay_ms=10.0, loss_pct=1.0,
                                     sources=("10.0.0.10", "10.0.0.11", "10.0.0.100"))]
    # w0 hears w1 and bg0 undelayed (same switch), ps and sink0 through the trunk.
    assert imps["w0"] == [Impairment("w0-eth0", delay_ms=10.0, loss_pct=1.0,
                                     sources=("10.0.0.1", "10.0.0.200"))]


def test_traces_go_on_their_points_and_unknown_points_are_named():
    c = cfg("topo.traces={\"w1.up\" = \"traces/data/cellular_like.trace\"}",
            "trace.down=\"traces/data/square_10_50.trace\"")
    spec = shape_spec(c)
    assert spec.point("w1.up").trace == "traces/data/cellular_like.trace"
    assert spec.point("down").trace == "traces/data/square_10_50.trace"
    assert spec.point("up").trace == "" and spec.point("w0.up").trace == ""
    with pytest.raises(SpecError, match="'w9.up' is not in this star; allowed .*'w0.up'"):
        shape_spec(cfg("topo.traces={\"w9.up\" = \"x.trace\"}"))
    with pytest.raises(SpecError, match="trace.up and topo.traces\\['up'\\]"):
        shape_spec(cfg("topo.traces={\"up\" = \"a.trace\"}", "trace.up=\"b.trace\""))


def test_a_host_behind_a_traced_uplink_sends_one_segment_packets():
    # Its rate follows the trace (a few Mbit/s for a cellular one): 8-segment packets would
    # hold 9 ms of a 10 Mbit/s link each. A trace on the switch's side of its link (the
    # host's downlink) or on the bottleneck leaves the host's packets as they were.
    plain = shape_spec(cfg("net.bottleneck_mbps=400", "net.worker_link_mbps=100"))
    assert {h.name: h.gso_segs for h in plain.hosts}["w0"] == 8
    spec = plain.with_traces({"w0.up": "traces/data/cellular_like.log",
                              "w1.down": "traces/data/cellular_like.log",
                              "up": "traces/data/cellular_like.log"})
    assert {h.name: h.gso_segs for h in spec.hosts} == {"ps": 1, "w0": 1, "w1": 8, "w2": 8,
                                                      "w3": 8}
    assert ("w0", "w0-eth0", 1) in spec.interfaces()


def test_a_trace_on_a_tc_capped_uplink_is_refused():
    from controller.driver import check_driver

    c = cfg("topo.traces={\"w1.up\" = \"traces/data/cellular_like.trace\"}",
            "shaping.method=\"tc\"")
    with pytest.raises(SpecError, match="both set w1's uplink rate"):
        check_driver(c, shape_spec(c))
    check_driver(cfg("shaping.method=\"pacing\"", *[
        "topo.traces={\"w1.up\" = \"traces/data/cellular_like.trace\"}"]),
        shape_spec(cfg("topo.traces={\"w1.up\" = \"traces/data/cellular_like.trace\"}")))


def point(name: str, rate: float | None = 10.0) -> ShapingPoint:
    return ShapingPoint(name, LinkSpec(rate_mbps=rate))


@pytest.mark.parametrize("make, text", [
    (lambda: HostSpec("h1", "worker", "worker", "10.0.0.2"), "host name='h1'"),
    (lambda: HostSpec("w1", "worker", "worker", "10.0.0.300"), "w1.ip='10.0.0.300'"),
    (lambda: SwitchSpec("s1"), "switch name='s1'"),
    (lambda: ShapingPoint("a b", LinkSpec(rate_mbps=1.0)), "name='a b'"),
    (lambda: ShapingPoint("x", LinkSpec(rate_mbps=None), trace="t.trace"), "needs a rate_mbps"),
    (lambda: EdgeSpec("sink1234567", 0, "gbsw0", 1, point("a"), point("b")),
     "longer than 15"),
    (lambda: NetSpec("t", (HostSpec("w0", "w", "", "10.0.0.2"),
                           HostSpec("w1", "w", "", "10.0.0.2")), (), ()), "used by another"),
    (lambda: NetSpec("t", (HostSpec("w0", "w", "", "10.0.0.2"),), (SwitchSpec("gbsw0"),),
                     (EdgeSpec("w0", 0, "gbsw1", 1, point("a"), point("b")),)),
     "node 'gbsw1' is not in the spec"),
    (lambda: NetSpec("t", (HostSpec("w0", "w", "", "10.0.0.2"),), (SwitchSpec("gbsw0"),),
                     (EdgeSpec("w0", 0, "gbsw0", 1, point("a"), point("a")),)),
     "point name 'a' is used twice"),
    (lambda: NetSpec("t", (HostSpec("w0", "w", "", "10.0.0.2"),), (SwitchSpec("gbsw0"),),
                     (EdgeSpec("w0", 0, "gbsw0", 1, point("a"), point("b")),), watch=("c",)),
     "watch='c'"),
])
def test_spec_errors_name_what_is_wrong(make, text):
    with pytest.raises(SpecError) as info:
        make()
    assert text in str(info.value)


def test_a_new_shape_is_one_registered_function():
    @register("pair_for_test")
    def pair(c: cfgmod.ExperimentConfig) -> NetSpec:
        hosts = (HostSpec("ps", "ps", "ps", "10.0.0.1"),
                 HostSpec("w0", "worker", "worker", "10.0.0.10"))
        return NetSpec("pair_for_test", hosts, (), (
            EdgeSpec("w0", 0, "ps", 0, point("up", c.net.bottleneck_mbps),
                     point("down", c.net.bottleneck_mbps)),), watch=("up",))

    c = cfg("topo.shape=\"pair_for_test\"", "net.workers=1", "net.bottleneck_mbps=7")
    lines = plan_commands(c, CAPS)
    assert any("tc class replace dev w0-eth0" in ln and "rate 7000000bit" in ln for ln in lines)
    assert any("tc class replace dev ps-eth0" in ln for ln in lines)
    assert sum("-m agents.dp.worker" in ln for ln in lines) == 1


def test_a_node_placed_on_another_machine_is_refused_before_anything_is_built():
    spec = shape_spec(cfg())
    w1 = next(h for h in spec.hosts if h.name == "w1")
    remote = dataclasses.replace(spec, hosts=tuple(
        dataclasses.replace(h, placement="rack2") if h is w1 else h for h in spec.hosts))
    assert build_plan(remote, NFQ)  # the plan is data: the dry run prints it
    # The builder refuses it in its constructor: no lock taken, nothing made.
    with pytest.raises(SpecError, match=r"w1.placement='rack2'.*Cluster Edition"):
        Network(remote, lock_path="/nonexistent/dir/lock")
