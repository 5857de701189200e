"""Placement over servers as data: the ``[cluster]`` section, Mininet Cluster Edition's
placers over a spec's names, pins, and the dry run's placement lines. Pure: no root."""

from __future__ import annotations

from collections import Counter

import pytest

from agents.core import config as cfgmod
from controller.run import plan_commands
from topo.placement import crossings, describe_placement, node_servers, place, servers_used
from topo.plan import build_plan, group_steps
from topo.shapes import shape_spec
from topo.spec import SpecError

NFQ = {"netem": False, "nfqueue": True, "xt_statistic": True}
TWO = ["localhost", "10.99.0.2"]
THREE = ["localhost", "10.99.0.2", "10.99.0.3"]


def cfg(*overrides: str) -> cfgmod.ExperimentConfig:
    return cfgmod.load("configs/demo.toml", list(overrides))


def test_one_server_on_this_machine_is_todays_spec_and_plan():
    plain = shape_spec(cfg())
    assert plain == place(plain, ["localhost"])
    assert all(h.placement == "" for h in plain.hosts)
    assert all(s.placement == "" for s in plain.switches)
    # The whole dry run is what it was: no placement lines, no "on SERVER".
    lines = plan_commands(cfg(), NFQ)
    assert not [ln for ln in lines if "placement" in ln or " on localhost" in ln]
    assert describe_placement(plain) == []


def test_switchbin_puts_every_host_with_its_switch():
    spec = shape_spec(cfg('topo.shape="dumbbell"', "cluster.servers=" + repr(TWO)
                          .replace("'", '"')))
    where = node_servers(spec)
    switches = [s.name for s in spec.switches]
    assert [where[s] for s in switches] == TWO  # one switch per server (Mininet's bins)
    for e in spec.edges:
        if e.a in switches and e.b not in switches:
            assert where[e.b] == where[e.a]
        if e.b in switches and e.a not in switches:
            assert where[e.a] == where[e.b]
    # Only the trunk between the two switches crosses servers.
    assert [(c.edge.a, c.edge.b) for c in crossings(spec)] == [tuple(switches)]


def test_pins_by_role_and_by_node_and_a_pinned_switch_takes_its_hosts():
    base = shape_spec(cfg("net.workers=4"))
    spec = place(base, TWO, pins={"ps": "localhost", "worker": "10.99.0.2"})
    where = node_servers(spec)
    assert where["ps"] == where["gbsw0"] == "localhost"
    assert [where[f"w{i}"] for i in range(4)] == ["10.99.0.2"] * 4
    assert len(crossings(spec)) == 4
    # A node's own pin wins over its role's.
    spec = place(base, TWO, pins={"worker": "10.99.0.2", "w3": "localhost"})
    assert node_servers(spec)["w3"] == "localhost"
    # Pinning the switch moves every unpinned host with it.
    spec = place(base, TWO, pins={"gbsw0": "10.99.0.2"})
    assert servers_used(spec) == ["10.99.0.2"]
    assert all(h.placement == "10.99.0.2" for h in spec.hosts)
    assert crossings(spec) == []


def test_roundrobin_and_seeded_random_spread_a_fabric_over_three_servers():
    base = shape_spec(cfg('topo.shape="fabric"', "topo.hosts=6", "net.workers=6"))
    rr = place(base, THREE, "roundrobin")
    counts = Counter(node_servers(rr).values())
    assert sorted(counts.values()) == [2, 2, 3]  # 7 nodes (1 switch + 6 hosts) in turn
    assert len(crossings(rr)) == 4  # every host not on the switch's server
    a = place(base, THREE, "random", seed=7)
    assert a == place(base, THREE, "random", seed=7)  # the dry run and the build agree
    draws = {tuple(node_servers(place(base, THREE, "random", seed=s)).values())
             for s in range(8)}
    assert len(draws) > 1  # the seed matters
    pinned = place(base, THREE, "random", pins={"gbh0": "10.99.0.3"}, seed=7)
    assert node_servers(pinned)["gbh0"] == "10.99.0.3"


def test_dry_run_prints_every_nodes_server_and_every_crossing_link():
    c = cfg("net.workers=4", 'cluster.servers=["localhost", "10.99.0.2"]',
            'cluster.pins={ps="localhost", worker="10.99.0.2"}')
    lines = plan_commands(c, NFQ)
    spec = shape_spec(c)
    for node, server in node_servers(spec).items():
        assert f"#   {node} on {server}" in lines
    assert "# 4 link(s) cross servers:" in lines
    assert any("w2-eth0 on 10.99.0.2 <-> gbsw0-eth4 on localhost" in ln for ln in lines)
    # Each step's interface names its server, from the same placed spec.
    assert "# w0-eth0 (in w0) on 10.99.0.2: point w0.up" in lines
    assert "# gbsw0-eth1 on localhost: point up" in lines
    assert build_plan(spec, NFQ)  # the plan of the placed spec is the same data


def test_placement_errors_name_the_field():
    base = shape_spec(cfg())
    with pytest.raises(SpecError, match=r"cluster.pins.rack: the star has no node or role "
                       r"'rack'; nodes .*'gbsw0'.*roles \['ps', 'worker'\]"):
        place(base, TWO, pins={"rack": "localhost"})
    with pytest.raises(SpecError, match=r"cluster.pins: ps -> '10.9.9.9' is not one of"):
        place(base, TWO, pins={"ps": "10.9.9.9"})
    with pytest.raises(SpecError, match="cluster.placement = 'hash'"):
        place(base, TWO, "hash")


def test_the_cluster_section_reports_every_bad_field_at_once():
    with pytest.raises(cfgmod.ConfigError) as e:
        cfgmod.from_dict({"cluster": {
            "servers": ["localhost", "localhost", "bad name", "300.1.1.1"],
            "user": "Root!", "placement": "hash", "pins": {"ps": "elsewhere"}}})
    errors = e.value.errors
    assert "cluster.servers[2] = 'bad name': must be a host name or an IPv4 address" in errors
    assert "cluster.servers[3] = '300.1.1.1': must be a host name or an IPv4 address" in errors
    assert any(m.startswith("cluster.servers = ") and "repeated: localhost" in m
               for m in errors)
    assert any(m.startswith("cluster.user = 'Root!'") for m in errors)
    assert any(m.startswith("cluster.placement = 'hash': must be one of switchbin")
               for m in errors)
    assert any(m.startswith("cluster.pins.ps = 'elsewhere': must be one of cluster.servers")
               for m in errors)
    assert len(errors) == 6
    ok = cfgmod.from_dict({"cluster": {"servers": TWO, "pins": {"worker": "10.99.0.2"}}})
    assert ok.cluster.remote and not cfgmod.from_dict({}).cluster.remote


def test_plan_steps_group_by_namespace_and_server_keeping_their_order():
    # The dumbbell's two switches land on two servers: two root namespaces.
    spec = place(shape_spec(cfg('topo.shape="dumbbell"', "net.workers=2")), TWO)
    where = node_servers(spec)
    steps = build_plan(spec, NFQ)
    groups = group_steps(steps, where)
    roots = [dev for host, dev, _ in groups if host is None]
    assert sorted(where[d.rsplit("-eth", 1)[0]] for d in roots) == sorted(TWO)
    assert len(groups) == len(spec.hosts) + 2
    assert sum(len(g[2]) for g in groups) == len(steps)
    for host, dev, commands in groups:  # each namespace's steps, in their order
        server = where[host or dev.rsplit("-eth", 1)[0]]
        assert commands == [list(s.argv) for s in steps if s.host == host
                            and where[s.host or s.dev.rsplit("-eth", 1)[0]] == server]
    # On one machine the root namespace is one group.
    local = build_plan(shape_spec(cfg('topo.shape="dumbbell"', "net.workers=2")), NFQ)
    assert [g[0] for g in group_steps(local, {})].count(None) == 1
