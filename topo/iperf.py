"""One iperf3 flow between two hosts of a built network, and what it delivered.

The shaping checks (a link over several servers against the same link on one server,
``benchmarks/cluster_fidelity.py`` and the cluster tests) measure the same way: an iperf3
server for one test in the receiving host, a client in the sending one, the receiver's
goodput from the client's end summary. Both run through :class:`topo.build.Network`, so
a host of another server runs them there, over the run's ssh connection.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass

from agents.core.ethernet import tcp_goodput_fraction
from topo.build import Network

IPERF3_PORT = 5201


@dataclass(frozen=True)
class Goodput:
    """One iperf3 flow's result. ``goodput_mbps``: TCP payload the receiver got per
    second of the measured interval (omitted seconds excluded); ``ceiling_mbps``: what a
    link shaped at ``rate_mbps`` with MTU ``mtu_bytes`` can carry of TCP payload."""

    rate_mbps: float
    mtu_bytes: int
    goodput_mbps: float
    measured_s: float
    retransmits: int

    @property
    def ceiling_mbps(self) -> float:
        return self.rate_mbps * tcp_goodput_fraction(self.mtu_bytes)

    @property
    def of_ceiling(self) -> float:
        """Goodput over the ceiling: 1 is a link that delivers exactly its shaped rate."""
        return self.goodput_mbps / self.ceiling_mbps


def link_mtu_bytes(net: Network, host: str) -> int:
    """The MTU of ``host``'s first interface, read there (1450 on a run over several
    servers, 1500 on one)."""
    out = net.run(host, ["ip", "-o", "link", "show", f"{host}-eth0"]).stdout.split()
    return int(out[out.index("mtu") + 1])


def iperf3_goodput(net: Network, src: str, dst: str, rate_mbps: float, seconds: int,
                   omit_s: int = 1) -> Goodput:
    """One iperf3 flow ``src`` -> ``dst`` for ``omit_s`` + ``seconds`` (the first
    ``omit_s`` left out: slow start and the HTB bucket's first burst). ``rate_mbps`` is
    the path's narrowest shaped rate, for the ceiling, at ``src``'s MTU.

    The receiver's goodput runs until the test's end marker has crossed the path's queue,
    so a standing queue of Q bytes adds up to Q over ``seconds``: keep the queue small
    against ``rate x seconds`` (``topo.spec.default_queue_bytes`` is 20 ms)."""
    server = net.popen(dst, ["iperf3", "-s", "-1", "-B", net.ip(dst), "-p", str(IPERF3_PORT)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if not net.wait_listening(dst, IPERF3_PORT):
            raise RuntimeError(f"iperf3 -s in {dst} did not listen on {IPERF3_PORT}")
        try:
            res = net.run(src, ["iperf3", "-c", net.ip(dst), "-p", str(IPERF3_PORT), "-t",
                                str(seconds), "-O", str(omit_s), "-J"],
                          timeout_s=seconds + omit_s + 30)
        except subprocess.CalledProcessError as e:  # -J puts iperf3's error in its JSON
            raise RuntimeError(f"iperf3 {src} -> {dst} failed (exit {e.returncode}): "
                               f"{(e.stdout or '')[-500:]}{e.stderr or ''}") from e
        server.wait(timeout=10)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    end = json.loads(res.stdout)["end"]
    recv = end["sum_received"]
    return Goodput(rate_mbps=rate_mbps, mtu_bytes=link_mtu_bytes(net, src),
                   goodput_mbps=float(recv["bits_per_second"]) / 1e6,
                   measured_s=float(recv["seconds"]),
                   retransmits=int(end["sum_sent"].get("retransmits", 0)))
