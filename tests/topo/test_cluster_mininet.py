"""A network spread over fake servers (``scripts/fake_cluster.sh``) with Mininet Cluster
Edition: the star with the PS on one server and two workers on another, its workers'
links VXLAN tunnels, and a fabric over three servers whose shaped links across servers
deliver what the same link on one server does. Real Mininet over real ssh; root.

One cluster of three servers serves the module. While the star is up, a second network
on servers it holds is refused by their locks (``topo.server_lock``)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from agents.core import config as cfgmod
from controller.run import plan_commands
from topo.build import Network
from topo.cluster import LINK_MTU, SshAccess
from topo.fake_cluster import MONO_STEP_S, FakeCluster, fake_cluster
from topo.iperf import iperf3_goodput
from topo.lock import LockTimeout
from topo.placement import crossings, node_servers
from topo.remote_delayline import DELAY_ROOT, ServerDelayLine
from topo.server_lock import ServerLock
from topo.shapes import shape_spec
from topo.spec import default_queue_bytes

pytestmark = [pytest.mark.mininet,
              pytest.mark.skipif(not Path("/usr/sbin/sshd").exists(),
                                 reason="no sshd: GRADBED_WITH_SSHD=1 scripts/setup.sh")]

CAPS = {"netem": False, "nfqueue": True, "xt_statistic": True,
        "tcp_congestion_control": ["cubic"]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeCluster]:
    with fake_cluster(tmp_path_factory.mktemp("fc") / "cluster", n=3) as c:
        yield c


def _lock_is_free(c: FakeCluster, server: str) -> bool:
    probe = ServerLock(server, SshAccess(ssh_config=str(c.ssh_config)).argv(server),
                       timeout_s=0)
    try:
        probe.acquire()
    except LockTimeout:
        return False
    probe.release()
    return True


def _server_leftovers(c: FakeCluster) -> list[str]:
    """gradbed's interfaces, bridges, tunnels and host shells still on any fake server."""
    def on(s: str) -> list[str]:
        text = c.ssh(s, "ip -o link show; ps -eo args | grep '[m]ininet:\\|[t]opo.delayline' "
                        f"|| true; ls -d {DELAY_ROOT}/* 2>/dev/null || true").stdout
        out = []
        for line in text.splitlines():
            name = line.split(":")[1].strip().split("@")[0] if ": " in line else ""
            if "mininet:" in line or "delay" in line or name.startswith(("gbsw", "ps-", "w")):
                out.append(f"{s}: {line.strip()}")
        return out

    with ThreadPoolExecutor() as pool:  # each ssh is mostly waiting: all servers at once
        return [ln for lines in pool.map(on, c.servers) for ln in lines]


def _all_pairs_reach(net: Network, hosts: list[str]) -> None:
    """Every host pings every other: one session per host, all at once (an ssh costs ~1 s
    here, mostly waiting)."""
    pings = {}
    for a in hosts:
        others = " ".join(net.ip(b) for b in hosts if b != a)
        pings[a] = net.popen(a, ["sh", "-c", f"for ip in {others}; do ping -c 1 -W 3 "
                                 "$ip >/dev/null || echo $ip; done"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for a, p in pings.items():
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, f"{a}: {err}"
        assert out.split() == [], f"{a} cannot reach {out.split()}"


# Two workers: each of the star's checks holds for every worker alike (its tunnel, its
# delay line on its server); each more costs a tunnel, a host shell and a delay line,
# set up over ssh.
STAR_WORKERS = 2


def test_a_star_with_the_ps_on_one_server_and_its_workers_on_another(cluster):
    c = cluster
    _, s1, s2 = c.servers  # the first server stays free for the second network below
    # 10 ms on the bottleneck: without netem, an NFQUEUE delay line in every host, run on
    # that host's server.
    cfg = cfgmod.load("configs/demo.toml", [
        f"net.workers={STAR_WORKERS}", "net.delay_ms=10", "net.loss_pct=0", "trace.up=\"\"",
        f'cluster.servers=["{s1}", "{s2}"]',
        f'cluster.pins={{ps="{s1}", worker="{s2}"}}'])
    spec = shape_spec(cfg)
    planned = node_servers(spec)
    assert planned == {"gbsw0": s1, "ps": s1, **{f"w{i}": s2 for i in range(STAR_WORKERS)}}
    dry = plan_commands(cfg, CAPS)
    assert all(f"#   {n} on {s}" in dry for n, s in planned.items())
    assert len(crossings(spec)) == STAR_WORKERS
    access = SshAccess(ssh_config=str(c.ssh_config))
    with Network(spec, caps=CAPS, access=access) as net:
        assert net.cluster is not None
        assert net.cluster.built_placement(net.mininet) == planned
        # Each server's CLOCK_MONOTONIC runs N * 1000 s ahead (its time namespace);
        # the min-RTT ping-pong finds it within its stated error.
        for s in (s1, s2):
            clock = net.cluster.clocks["start"][s]
            n = c.servers.index(s) + 1
            assert abs(float(clock["offset_s"]) - n * MONO_STEP_S) \
                <= float(clock["error_s"]) + 1e-6
            assert float(clock["error_s"]) < 1.0  # a loaded 2-core machine
        # Every host reaches every other; ps <-> wK crosses the VXLAN tunnel.
        _all_pairs_reach(net, list(spec.host_names()))
        # The delay lines on both servers, 10 ms each way, give a 20 ms RTT within 5 %.
        # User to user (-U): plain ping stamps the reply on arrival, before the delay line
        # that holds it, and would leave out w1's half (tests/topo/test_delay_mininet.py).
        rtt = net.run("w1", ["chrt", "-f", "5", "ping", "-U", "-c", "5", "-i", "0.2",
                             net.ip("ps")]).stdout
        min_ms = float(rtt.split(" = ")[-1].split("/")[0])
        assert 19.0 <= min_ms <= 21.0, rtt
        delay_lines = c.ssh(s2, "ps -eo args | grep -c '^[^ ]*python[0-9.]* -m "
                                "topo[.]delayline'").stdout
        assert int(delay_lines) == STAR_WORKERS, delay_lines  # w0's and w1's, there
        # A worker's end of the tunnel: VXLAN, the run's MTU, shaped on its server.
        link = net.run("w0", ["ip", "-d", "link", "show", "w0-eth0"]).stdout
        assert "vxlan id" in link and f"mtu {LINK_MTU}" in link
        assert f"mtu {LINK_MTU}" in net.run("ps", ["ip", "link", "show",
                                                   "ps-eth0"]).stdout
        w0_shell = c.ssh(s2, f"cat /proc/{net.pid('w0')}/cmdline").stdout
        assert "mininet:w0" in w0_shell  # the pid is the server's: its shell runs there
        assert net.point_stats("w0.up").sent_pkts > 0
        assert "htb" in c.ssh(s2, f"nsenter -t {net.pid('w0')} -n tc qdisc show "
                                  "dev w0-eth0").stdout
        assert "gbsw0-eth2" in c.ssh(s1, "ip -o link show master gbsw0").stdout
        # A second network on the first server and one of the star's waits for the
        # star's lock there and gives up naming it, having built nothing; the first
        # server's lock, which it took on the way, it let go.
        other = shape_spec(cfgmod.load("configs/demo.toml", [
            "net.workers=1", "net.delay_ms=0", "net.loss_pct=0", 'trace.up=""',
            f'cluster.servers=["{c.servers[0]}", "{s1}"]',
            f'cluster.pins={{ps="{c.servers[0]}", worker="{s1}"}}']))
        with pytest.raises(LockTimeout, match=f"server {s1}: its network lock was not "
                                              "taken: .*gradbed run of"):
            with Network(other, caps=CAPS, access=access, lock_timeout_s=1):
                pass
        assert _lock_is_free(c, c.servers[0])
        _all_pairs_reach(net, ["ps", "w1"])  # the star is untouched
        # Last, w0's delay line on its server dies: named with its host and server, and
        # its link fails closed (nothing reaches w0 undelayed), as on one machine.
        assert net.dead_delay_line() == ""
        w0_line = next(h for h in net.host_impairments if h.host == "w0")
        assert isinstance(w0_line.proc, ServerDelayLine)
        c.ssh(s2, f"kill -9 {w0_line.proc.pid}")
        w0_line.proc.wait(timeout=30)
        dead = net.dead_delay_line()
        assert dead.startswith(f"host w0: delay line on {s2} died (exit 137") \
            and dead.endswith("its link drops every packet"), dead
        cut = net.popen("ps", ["ping", "-c", "3", "-i", "0.2", "-W", "1", net.ip("w0")],
                        stdout=subprocess.PIPE, text=True)
        assert " 0 received" in cut.communicate(timeout=30)[0]
    assert set(net.cluster.clocks["end"]) == {s1, s2}
    w0 = next(h for h in net.impairment_record()["hosts"] if h["host"] == "w0")
    assert str(w0["delay_line_died"]).startswith("exit 137"), w0
    assert _server_leftovers(c) == []
    assert _lock_is_free(c, s1) and _lock_is_free(c, s2)


# The fabric's access links, both ways; a 20 ms queue at that rate (the default's), so the
# queue that drains into iperf3's last interval weighs 1 % of a 2 s flow.
FABRIC_LINK_MBPS = 20.0
# A shaped link delivers its rate, no more: the HTB bucket's first burst is omitted and the
# drained queue adds 1 %. Most of it even on a loaded machine: 20 Mbit/s is 1700 frames a
# second, a sliver of a core for the sender, the tunnels and the receiver.
OF_CEILING = (0.90, 1.02)


def test_a_fabric_spread_round_robin_over_three_servers_shaped_as_on_one(cluster):
    c = cluster
    servers = ", ".join(f'"{s}"' for s in c.servers)
    # gbh4 is pinned to the switch's server, beside gbh2: a path that stays on one server.
    cfg = cfgmod.load("configs/demo.toml", [
        'topo.shape="fabric"', "topo.hosts=5", "net.workers=5", "net.delay_ms=0",
        "net.loss_pct=0", 'trace.up=""', f"net.worker_link_mbps={FABRIC_LINK_MBPS:g}",
        f"net.queue_bytes={default_queue_bytes(FABRIC_LINK_MBPS)}",
        f"cluster.servers=[{servers}]", 'cluster.placement="roundrobin"',
        f'cluster.pins={{gbh4="{c.servers[0]}"}}'])
    spec = shape_spec(cfg)
    planned = node_servers(spec)
    s1, s2, s3 = c.servers
    assert planned == {"gbsw0": s1, "gbh0": s2, "gbh1": s3, "gbh2": s1, "gbh3": s2,
                       "gbh4": s1}
    with Network(spec, caps=CAPS, access=SshAccess(ssh_config=str(c.ssh_config)),
                 lock_timeout_s=60) as net:
        assert net.cluster is not None
        assert net.cluster.built_placement(net.mininet) == planned
        _all_pairs_reach(net, list(spec.host_names()))
        # Side by side, in the same seconds: gbh0 -> gbh1 crosses both tunnels (gbh0's
        # server, the switch's, gbh1's), gbh2 -> gbh4 stays on the switch's server. The
        # two flows share no shaping point (each host's up, the other's down).
        with ThreadPoolExecutor(2) as pool:
            flows = [pool.submit(iperf3_goodput, net, a, b, FABRIC_LINK_MBPS, 2)
                     for a, b in (("gbh0", "gbh1"), ("gbh2", "gbh4"))]
            placed, one = (f.result() for f in flows)
    figures = (f"across servers {placed.goodput_mbps:.2f} Mbit/s ({placed.of_ceiling:.3f} of "
               f"the ceiling), on one {one.goodput_mbps:.2f} ({one.of_ceiling:.3f})")
    assert placed.mtu_bytes == one.mtu_bytes == LINK_MTU
    assert OF_CEILING[0] <= one.of_ceiling <= OF_CEILING[1], figures
    assert OF_CEILING[0] <= placed.of_ceiling <= OF_CEILING[1], figures
    assert _server_leftovers(c) == []
