"""A run placed over several servers against the same run on one server, side by side.

docs/cluster.md's fidelity points for Mininet Cluster Edition, measured in one invocation
on fake servers of this machine (``topo.fake_cluster``: network namespaces with their own
sshd, joined by VXLAN tunnels), each placed figure beside the same thing on this machine
alone (plain gradbed, no ``[cluster]`` section):

- **Shaping.** A star of the PS and one worker whose access link is shaped at 20 and at
  100 Mbit/s (bottleneck 1000 Mbit/s, queues the default 20 ms). Placed, the PS and its
  switch are on server 1 and the worker on server 2, so the shaped link is a VXLAN tunnel
  shaped on the worker's server. One iperf3 flow w0 -> ps each; the placed goodput over
  the one-server goodput must be within 3 %. Links over servers have MTU 1450, so their
  TCP ceiling is 0.16 % lower (``tcp_goodput_fraction``): reported, not corrected.
- **Delay.** The same star with 10 ms each way on the bottleneck (no netem here: an
  NFQUEUE delay line in each host, on its server): the least of 20 user-to-user pings
  w0 -> ps, placed within 5 % or 0.2 ms of one server's.
- **Iteration time.** ``configs/digits.toml`` (4 workers, dense, 100 Mbit/s bottleneck,
  seed 7) for ``ITERATIONS`` iterations, placed with the PS on server 1 and the workers on
  server 2; the median iteration time (``iter_time_s_p50``) over the one-server run's
  must be within 15 %. The PS's final weights of the two runs are compared too, outside
  the pass: the PS adds the workers' dense gradients in their order of arrival, so with
  more than two workers a different timing may round the sum differently (the suite's
  bit-identity test runs two workers, whose sum does not depend on the order).

Headline: the worst check's share of its bound, ``|placed - one|`` over what the bound
allows (<= 1 passes).
Needs root, Mininet, iperf3 and openssh-server (``GRADBED_WITH_SSHD=1 scripts/setup.sh``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import REPO, emit, gradbed_run, log

from agents.core import config as cfgmod
from topo.build import Network
from topo.cluster import SshAccess
from topo.fake_cluster import FakeCluster, fake_cluster
from topo.iperf import Goodput, iperf3_goodput
from topo.shapes import shape_spec
from topo.spec import default_queue_bytes

RATES_MBPS = (20.0, 100.0)
DURATION_S = int(os.environ.get("GB_CF_DURATION_S", "6"))
OMIT_S = 2
ITERATIONS = int(os.environ.get("GB_CF_ITERATIONS", "40"))
SEED = 7
GOODPUT_BOUND = 0.03       # placed goodput within 3 % of one server's
ITER_TIME_BOUND = 0.15     # placed median iteration time within 15 % of one server's
DELAY_MS = 10.0            # each way on the bottleneck: a 20 ms RTT
PINGS = 20
RTT_BOUND, RTT_BOUND_MS = 0.05, 0.2  # placed min RTT within 5 % or 0.2 ms of one server's


def _placement(c: FakeCluster) -> list[str]:
    """The PS (and its switch) on server 1, every worker on server 2."""
    s1, s2 = c.servers
    return [f'cluster.servers=["{s1}", "{s2}"]', f'cluster.pins={{ps="{s1}", worker="{s2}"}}',
            f'cluster.ssh_config="{c.ssh_config}"']


def _goodput(rate_mbps: float, c: FakeCluster | None) -> Goodput:
    """w0 -> ps through w0's access link shaped at ``rate_mbps``, on this machine
    (``c`` None) or placed over ``c``'s two servers."""
    cfg = cfgmod.load(REPO / "configs" / "demo.toml", [
        "net.workers=1", f"net.worker_link_mbps={rate_mbps:g}", "net.bottleneck_mbps=1000",
        "net.bottleneck_down_mbps=1000", f"net.queue_bytes={default_queue_bytes(rate_mbps)}",
        "net.delay_ms=0", "net.loss_pct=0", 'trace.up=""',
        *(_placement(c) if c is not None else [])])
    access = SshAccess(ssh_config=str(c.ssh_config)) if c is not None else None
    with Network(shape_spec(cfg), access=access) as net:
        return iperf3_goodput(net, "w0", "ps", rate_mbps, DURATION_S, OMIT_S)


def _shaping(c: FakeCluster) -> list[dict[str, Any]]:
    points = []
    for rate in RATES_MBPS:
        one, placed = _goodput(rate, None), _goodput(rate, c)
        ratio = placed.goodput_mbps / one.goodput_mbps
        log(f"{rate:g} Mbit/s: one server {one.goodput_mbps:.3f} Mbit/s "
            f"({one.of_ceiling:.4f} of its ceiling), placed {placed.goodput_mbps:.3f} "
            f"({placed.of_ceiling:.4f}): ratio {ratio:.4f}")
        points.append({"rate_mbps": rate, "ratio": ratio, "bound": GOODPUT_BOUND,
                       "pass": abs(ratio - 1) <= GOODPUT_BOUND,
                       **{f"{k}_{key}": v for k, g in (("one", one), ("placed", placed))
                          for key, v in (("goodput_mbps", g.goodput_mbps),
                                         ("of_ceiling", g.of_ceiling),
                                         ("mtu_bytes", g.mtu_bytes),
                                         ("retransmits", g.retransmits))}})
    return points


def _min_rtt_ms(c: FakeCluster | None) -> float:
    """The least of ``PINGS`` user-to-user RTTs w0 -> ps through ``DELAY_MS`` each way on
    the bottleneck (an NFQUEUE delay line in each host: this kernel has no netem), on this
    machine (``c`` None) or placed over ``c``'s two servers. User to user (``ping -U``):
    plain ping stamps the reply before the receiving delay line holds it."""
    cfg = cfgmod.load(REPO / "configs" / "demo.toml", [
        "net.workers=1", f"net.delay_ms={DELAY_MS:g}", "net.bottleneck_mbps=1000",
        "net.loss_pct=0", 'trace.up=""', *(_placement(c) if c is not None else [])])
    access = SshAccess(ssh_config=str(c.ssh_config)) if c is not None else None
    with Network(shape_spec(cfg), access=access) as net:
        out = net.run("w0", ["chrt", "-f", "5", "ping", "-U", "-c", str(PINGS), "-i", "0.2",
                             net.ip("ps")], timeout_s=PINGS + 30).stdout
    return float(out.split(" = ")[-1].split("/")[0])


def _rtt(c: FakeCluster) -> dict[str, Any]:
    one, placed = _min_rtt_ms(None), _min_rtt_ms(c)
    allowed_ms = max(RTT_BOUND * one, RTT_BOUND_MS)
    log(f"{2 * DELAY_MS:g} ms RTT: one server {one:.3f} ms, placed {placed:.3f} ms "
        f"(allowed difference {allowed_ms:.3f} ms)")
    return {"delay_ms_each_way": DELAY_MS, "pings": PINGS, "bound": RTT_BOUND,
            "bound_ms": RTT_BOUND_MS, "one_min_rtt_ms": one, "placed_min_rtt_ms": placed,
            "ratio": placed / one, "allowed_diff_ms": allowed_ms,
            "share_of_bound": abs(placed - one) / allowed_ms,
            "pass": abs(placed - one) <= allowed_ms}


def _weights(runs: dict[str, Path]) -> dict[str, Any]:
    """Whether the PS's final weights of the runs are bit-identical, and how far apart."""
    import torch

    one, placed = (torch.load(runs[k] / "ps_final_weights.pt") for k in ("one", "placed"))
    digest = [hashlib.sha256(w.numpy().tobytes()).hexdigest() for w in (one, placed)]
    return {"weights_identical": digest[0] == digest[1],
            "weights_max_abs_diff": float((one - placed).abs().max()),
            "weights_elements_differing": int((one != placed).sum()),
            "weights_elements": int(one.numel())}


def _iteration_time(c: FakeCluster, out: Path) -> dict[str, Any]:
    common = [f"run.iterations={ITERATIONS}", f"run.seed={SEED}"]
    config = REPO / "configs" / "digits.toml"
    runs = {"one": gradbed_run(config, "cf-one", common, out, report=False),
            "placed": gradbed_run(config, "cf-placed", common + _placement(c), out,
                                  report=False)}
    p50 = {k: json.loads((d / "summary.json").read_text())["iter_time_s_p50"]
           for k, d in runs.items()}
    weights = _weights(runs)
    ratio = p50["placed"] / p50["one"]
    log(f"digits, {ITERATIONS} iterations: median iteration {p50['one']:.4f} s on one "
        f"server, {p50['placed']:.4f} s placed: ratio {ratio:.4f}; weights identical: "
        f"{weights['weights_identical']} (max |diff| {weights['weights_max_abs_diff']:.3g})")
    return {"one_iter_time_s_p50": p50["one"], "placed_iter_time_s_p50": p50["placed"],
            "ratio": ratio, "bound": ITER_TIME_BOUND, "pass": abs(ratio - 1) <= ITER_TIME_BOUND,
            **weights, "iterations": ITERATIONS, "seed": SEED, "run_dirs": {k: str(d) for k, d in
                                                                  runs.items()}}


def main() -> int:
    if os.geteuid() != 0:
        log("cluster_fidelity needs root (Mininet, network namespaces)")
        return 1
    if not Path("/usr/sbin/sshd").exists():
        log("cluster_fidelity needs sshd: GRADBED_WITH_SSHD=1 scripts/setup.sh")
        return 1
    load_start, t0 = os.getloadavg()[0], time.monotonic()
    out = Path(tempfile.mkdtemp(prefix="gb-cluster-fidelity-"))
    with fake_cluster(out / "cluster", n=2) as c:
        shaping = _shaping(c)
        rtt = _rtt(c)
        iteration = _iteration_time(c, out / "runs")
    checks = [abs(p["ratio"] - 1) / p["bound"] for p in shaping]
    checks += [rtt["share_of_bound"], abs(iteration["ratio"] - 1) / iteration["bound"]]
    passed = all(p["pass"] for p in shaping) and rtt["pass"] and iteration["pass"]
    emit("cluster_fidelity", round(max(checks), 4),
         "worst |placed - one| over its bound (goodput 3 %, RTT 5 % or 0.2 ms, median "
         "iteration 15 %)", "<= 1",
         {"pass": passed, "shaping": shaping, "rtt": rtt, "iteration_time": iteration,
          "duration_s": DURATION_S, "omit_s": OMIT_S, "servers": "fake (topo.fake_cluster)",
          "wall_s": time.monotonic() - t0, "loadavg_1min_at_start": load_start,
          "loadavg_1min_at_end": os.getloadavg()[0]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
