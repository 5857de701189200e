"""``agent_limited`` in a real run's summary (real Mininet, TCP, PS and workers): with the
workers' CPU capped by a cgroup (``cpu.max``, or v1's CFS quota), a 1 Gbit/s bottleneck
sits idle while their gradients wait in them, and the summary says agent-limited; the
same cap at 10 Mbit/s leaves the link busy, and the summary says network-limited.

The payload is scaled to the rate so each upload window lasts about a second: ResNet-18's
gradient (47 MB a worker) at 1 Gbit/s, the digits MLP's (1.2 MB) at 10 Mbit/s.
"""

from __future__ import annotations

import threading

import pytest

from tests.support.cpu_cap import CpuCap, cap_when_connected, cpu_cap_kind
from tests.support.mininet_run import gradbed_run, summary

pytestmark = [pytest.mark.mininet,
              pytest.mark.skipif(cpu_cap_kind() is None, reason="no cgroup cpu controller")]

CONFIG = "configs/wire_utilization.toml"
WORKERS = 2
COMMON = [f"net.workers={WORKERS}", "run.iterations=1", "run.timeout_s=60",
          "workload.compute_ms=100"]
RATES = {
    1000: ["net.bottleneck_mbps=1000", "net.bottleneck_down_mbps=10000",
           'workload.model="resnet18"'],
    10: ["net.bottleneck_mbps=10", "net.bottleneck_down_mbps=1000",
         'workload.name="digits_mlp"', "workload.hidden=512", "workload.chunk_bytes=300000"],
}


def capped_run(tmp_path, rate_mbps: int) -> dict:
    out = tmp_path / f"r{rate_mbps}"
    stop = threading.Event()
    # The two workers share a fifth of a core once connected to the PS. The timeouts leave
    # room for the machine-wide network lock (600 s), which other runs may hold.
    with CpuCap(f"gradbed-test-cap-{rate_mbps}", cores=0.2) as cap:
        watcher = cap_when_connected(cap, str(out), "agents.dp.worker", 5000, WORKERS, stop,
                                     timeout_s=900)
        try:
            run_dir, proc = gradbed_run(CONFIG, COMMON + RATES[rate_mbps], out, timeout_s=900)
        finally:
            stop.set()
            watcher.join(timeout=5)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert len(cap.pids) == WORKERS, f"capped {cap.pids}"
        assert cap.throttled_us() > 0 or rate_mbps < 1000, "the cap never bit"
    return summary(run_dir)


def test_capped_agents_at_1gbit_are_agent_limited_and_not_at_10mbit(tmp_path):
    fast = capped_run(tmp_path, 1000)
    assert fast["agent_limited"] is True, fast["agent_limited_why"]
    assert fast["agent_limited_why"].startswith("agent-limited")
    assert fast["bottleneck_utilization"] < 0.9
    slow = capped_run(tmp_path, 10)
    assert slow["agent_limited"] is False, slow["agent_limited_why"]
    assert slow["bottleneck_utilization"] >= 0.9
