"""Real Mininet: ``adaptive.rate_source = "drain"`` reads a worker's own shaped uplink from
the kernel's transmit stamps (agents/net/txstamps.py, agents/core/drain.py).

w0's uplink is the HTB on its own interface, as in every gradbed run. Through it:

- w0's compressed case (11 writes of 3.5 KB, 0.9 ms apart, onto 10 Mbit/s with the default
  10 ms bucket) reads the link's TCP payload rate within 5 % in most uploads, and at most
  one reads more than 5 % above it;
- a dense 340 KB in 32 KB writes onto 100 Mbit/s: its median stays inside the band the
  policy counts as the plan (eps = 0.2). Single uploads there read 78-101 Mbit/s of a
  95.6 Mbit/s payload rate: a write spans three packets and only its last is stamped, so
  an idle gap before an unstamped one reads low; and on a busy CPU a packet can wait for
  the qdisc to run while the bucket still holds credit (125 KB at this rate), which reads
  high. Above the plan a sample counts as the plan, so neither cuts the worker;
- a writer slower than its 100 Mbit/s link (5 KB every 3 ms) gives no sample at all: on a
  quiet machine two of its packets can each wait 50 us on the qdisc's own delay, but the
  next write was never begun before the last packet left (agents.core.drain).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from agents.core.ethernet import TCP_MSS_BYTES
from tests.topo.test_topo_mininet import assert_nothing_left
from topo.build import StarNetwork
from topo.shapes.star import StarSpec
from topo.spec import TCP_GOODPUT_FRACTION, LinkSpec

pytestmark = pytest.mark.mininet
REPO = Path(__file__).resolve().parents[2]
PORT = 7011


def uploads(net: StarNetwork, n: int, chunks: int, chunk_bytes: int,
            gap_ms: float) -> dict[str, list]:
    packet_bytes = net.spec.host("w0").gso_segs * TCP_MSS_BYTES
    py, env = sys.executable, {**os.environ, "PYTHONPATH": str(REPO)}
    server = net.popen("ps", [py, str(REPO / "tests" / "support" / "stamp_probe.py"), "serve",
                              str(PORT)], cwd=REPO, env=env)
    try:
        assert net.wait_listening("ps", PORT)
        try:
            # net.run passes no environment of ours: name this checkout, as for the server.
            out = net.run("w0", ["env", f"PYTHONPATH={REPO}", py,
                                 str(REPO / "tests" / "support" / "stamp_probe.py"),
                                 "probe", net.ip("ps"), str(PORT), str(n), str(chunks),
                                 str(chunk_bytes), str(gap_ms), str(packet_bytes)],
                          timeout_s=60).stdout
        except subprocess.CalledProcessError as e:
            pytest.fail(f"the probe exited {e.returncode}: {e.stderr[-3000:]}")
        server.wait(timeout=10)
    finally:
        if server.poll() is None:
            server.kill()
    return json.loads(out.strip().splitlines()[-1])


def test_the_kernels_stamps_read_the_workers_own_uplink() -> None:
    spec = StarSpec(workers=1, worker_link=LinkSpec(rate_mbps=10),
                    bottleneck_up=LinkSpec(rate_mbps=None),
                    bottleneck_down=LinkSpec(rate_mbps=None))
    with StarNetwork(spec) as net:
        slow = uploads(net, 8, 11, 3_500, 0.9)
        payload_bps = 10e6 * TCP_GOODPUT_FRACTION
        assert all(n >= 1 for n in slow["stamps"]), slow
        timed = [r for r in slow["rates_bps"] if r is not None]
        assert len(timed) >= 6, slow
        assert statistics.median(timed) == pytest.approx(payload_bps, rel=0.05), slow
        # On a busy CPU the qdisc can run late and send a held packet at once (the
        # docstring): one upload of the eight may read high (CI: 12.3 Mbit/s once).
        assert sum(r > 1.05 * payload_bps for r in timed) <= 1, slow

        net.set_point_rate("w0.up", 100)
        dense = uploads(net, 5, 11, 32_768, 0.0)
        timed = [r for r in dense["rates_bps"] if r is not None]
        assert len(timed) >= 4, dense
        fast_bps = 100e6 * TCP_GOODPUT_FRACTION
        assert 0.8 * fast_bps <= statistics.median(timed) <= 1.05 * fast_bps, dense

        writer = uploads(net, 5, 11, 5_000, 3.0)
        assert writer["rates_bps"] == [None] * 5, writer
    assert_nothing_left()


def test_a_traced_uplink_with_a_real_rtt_is_read_on_most_uploads() -> None:
    # configs/heterogeneous.toml's w0: a 10 Mbit/s uplink of one-segment packets (both a
    # traced uplink, NetSpec.with_traces, and a 10 Mbit/s access link, StarSpec.sender_gso_
    # segs, give one segment), 15 ms of one-way delay each way on the
    # bottleneck (the NFQUEUE delay line here), 11 writes of 3.6 KB back to back. With the
    # bottleneck's 8-segment packets and each packet's start taken at the previous stamped
    # key, such uploads gave a sample in 2 of 97 iterations, reading 2-4 Mbit/s.
    star = StarSpec(workers=1, worker_link=LinkSpec(rate_mbps=10),
                    bottleneck_up=LinkSpec(rate_mbps=400, delay_ms=15),
                    bottleneck_down=LinkSpec(rate_mbps=400, delay_ms=15))
    spec = star.net_spec().with_traces({"w0.up": "traces/data/cellular_like.log"})
    assert spec.host("w0").gso_segs == 1
    with StarNetwork(spec) as net:
        got = uploads(net, 12, 11, 3_624, 0.3)
    # Measured: every upload read 10.25-10.26 Mbit/s, 7 % above the 9.56 Mbit/s payload
    # rate. The writes wait in the socket and are merged into full packets, so a stamped
    # key sits inside its packet rather than at its end: each end of the timed run is
    # known to within one packet (agents.core.drain), here 1.4 KB of a 10 KB run.
    payload_bps = 10e6 * TCP_GOODPUT_FRACTION
    timed = [r for r in got["rates_bps"][2:] if r is not None]  # after slow start
    assert len(timed) >= 8, got
    assert statistics.median(timed) == pytest.approx(payload_bps, rel=0.1), got
    # One upload of the ten may read outside the band on a busy CPU (CI: 11.8 Mbit/s once).
    assert sum(not 0.8 * payload_bps <= r <= 1.15 * payload_bps for r in timed) <= 1, got
    assert_nothing_left()
