"""A network spread over fake servers (``scripts/fake_cluster.sh``) with Mininet Cluster
Edition: the star with the PS on server 1 and four workers on server 2, its workers' links
VXLAN tunnels. Real Mininet over real ssh; root."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.core import config as cfgmod
from controller.run import plan_commands
from tests.support.fake_cluster import MONO_STEP_S, FakeCluster, fake_cluster
from topo.build import Network
from topo.cluster import LINK_MTU, SshAccess
from topo.placement import crossings, node_servers
from topo.shapes import shape_spec

pytestmark = [pytest.mark.mininet,
              pytest.mark.skipif(not Path("/usr/sbin/sshd").exists(),
                                 reason="no sshd: GRADBED_WITH_SSHD=1 scripts/setup.sh")]

CAPS = {"netem": False, "nfqueue": True, "xt_statistic": True,
        "tcp_congestion_control": ["cubic"]}


def _server_leftovers(c: FakeCluster) -> list[str]:
    """gradbed's interfaces, bridges, tunnels and host shells still on any fake server."""
    out = []
    for s in c.servers:
        text = c.ssh(s, "ip -o link show; ps -eo args | grep '[m]ininet:' || true").stdout
        for line in text.splitlines():
            name = line.split(":")[1].strip().split("@")[0] if ": " in line else ""
            if "mininet:" in line or name.startswith(("gbsw", "ps-", "w")):
                out.append(f"{s}: {line.strip()}")
    return out


def _all_pairs_reach(net: Network, hosts: list[str]) -> None:
    """Every host pings every other (one session per host: an ssh costs ~1 s here)."""
    for a in hosts:
        others = " ".join(net.ip(b) for b in hosts if b != a)
        failed = net.run(a, ["sh", "-c", f"for ip in {others}; do ping -c 1 -W 3 "
                             "$ip >/dev/null || echo $ip; done"]).stdout.split()
        assert failed == [], f"{a} cannot reach {failed}"


def test_a_star_with_the_ps_on_one_server_and_its_workers_on_another(tmp_path: Path):
    with fake_cluster(tmp_path / "cluster", n=2) as c:
        s1, s2 = c.servers
        cfg = cfgmod.load("configs/demo.toml", [
            "net.workers=4", "net.delay_ms=0", "net.loss_pct=0", "trace.up=\"\"",
            f'cluster.servers=["{s1}", "{s2}"]',
            f'cluster.pins={{ps="{s1}", worker="{s2}"}}'])
        spec = shape_spec(cfg)
        planned = node_servers(spec)
        assert planned == {"gbsw0": s1, "ps": s1, **{f"w{i}": s2 for i in range(4)}}
        dry = plan_commands(cfg, CAPS)
        assert all(f"#   {n} on {s}" in dry for n, s in planned.items())
        assert len(crossings(spec)) == 4
        with Network(spec, caps=CAPS, access=SshAccess(ssh_config=str(c.ssh_config))) as net:
            assert net.cluster is not None
            assert net.cluster.built_placement(net.mininet) == planned
            # Each server's CLOCK_MONOTONIC runs N * 1000 s ahead (its time namespace);
            # the min-RTT ping-pong finds it within its stated error.
            for n, s in enumerate(c.servers, start=1):
                clock = net.cluster.clocks["start"][s]
                assert abs(float(clock["offset_s"]) - n * MONO_STEP_S) \
                    <= float(clock["error_s"]) + 1e-6
                assert float(clock["error_s"]) < 1.0  # a loaded 2-core machine
            # Every host reaches every other; ps <-> wK crosses the VXLAN tunnel.
            _all_pairs_reach(net, list(spec.host_names()))
            # A worker's end of the tunnel: VXLAN, the run's MTU, shaped on server 2.
            link = net.run("w0", ["ip", "-d", "link", "show", "w0-eth0"]).stdout
            assert "vxlan id" in link and f"mtu {LINK_MTU}" in link
            assert f"mtu {LINK_MTU}" in net.run("ps", ["ip", "link", "show",
                                                       "ps-eth0"]).stdout
            w0_shell = c.ssh(s2, f"cat /proc/{net.pid('w0')}/cmdline").stdout
            assert "mininet:w0" in w0_shell  # the pid is server 2's: its shell runs there
            assert net.point_stats("w0.up").sent_pkts > 0
            assert "htb" in c.ssh(s2, f"nsenter -t {net.pid('w0')} -n tc qdisc show "
                                      "dev w0-eth0").stdout
            assert "gbsw0-eth2" in c.ssh(s1, "ip -o link show master gbsw0").stdout
        assert set(net.cluster.clocks["end"]) == {s1, s2}
        assert _server_leftovers(c) == []


def test_a_fabric_spread_round_robin_over_three_servers(tmp_path: Path):
    with fake_cluster(tmp_path / "cluster", n=3) as c:
        servers = ", ".join(f'"{s}"' for s in c.servers)
        cfg = cfgmod.load("configs/demo.toml", [
            'topo.shape="fabric"', "topo.hosts=5", "net.workers=5", "net.delay_ms=0",
            "net.loss_pct=0", 'trace.up=""', f"cluster.servers=[{servers}]",
            'cluster.placement="roundrobin"'])
        spec = shape_spec(cfg)
        planned = node_servers(spec)
        assert set(planned.values()) == set(c.servers)  # every server holds some node
        with Network(spec, caps=CAPS, access=SshAccess(ssh_config=str(c.ssh_config))) as net:
            assert net.cluster is not None
            assert net.cluster.built_placement(net.mininet) == planned
            _all_pairs_reach(net, list(spec.host_names()))
        assert _server_leftovers(c) == []
