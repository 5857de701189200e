"""4 MoE expert hosts on the fabric at 100 Mbit/s, in real Mininet: training runs and the
loss falls; the summary says whether the agents or the links set the dispatches' pace;
the run leaves nothing behind. The run's expert host 1 is flooded from host 0's address
meanwhile, and its real peers join it through their own admission slots. A second, small
run of 2 hosts whose CPU a cgroup caps, on 1 Gbit/s links, reads agent-limited, and the
report's words name the expert hosts."""

from __future__ import annotations

import os
import re
import statistics
from pathlib import Path

import pytest

from agents.core import config as cfgmod
from agents.core.ethernet import TCP_GOODPUT_FRACTION
from analysis import moe as amoe
from analysis.metrics import agent_limited_points, busiest_point_windows
from tests.support.cpu_cap import assert_agent_limited, capped_run, cpu_cap_kind
from tests.support.mininet_run import (
    REPO,
    flood_from,
    leftovers,
    start_run,
    summary,
)
from topo.qdisc import htb_burst_bytes

pytestmark = [pytest.mark.mininet,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for Mininet")]


ITERATIONS = 12


# A keyless flood of expert host 1's listener from gbh0 (host 0 only answers dials, so at
# host 1 its address is a stranger's), started before the agents: 12 slow connections,
# against a pool of 10 of which hosts 2 and 3 (they dial host 1) keep one each, so the
# flood's 8 (guard.max_handshakes_per_source) fill the shared pool and the rest are
# refused. The admitted ones hold their slots for the whole join (a 60 s deadline). These
# are the agents' own slots, which must hold without the kernel's help (a loopback run, a
# kernel without xt_hashlimit): the kernel's per-source bound is off here, since it
# would hold back the flooder's probing (a SYN a millisecond until host 1 listens) by a
# SYN retransmit, 1 s, past the joins (tests/controller/test_kernel_admission.py checks
# the kernel's half).
FLOOD = ["--slow", "12"]
FLOOD_GUARD = ["guard.max_handshakes=10", "guard.handshake_timeout_s=60",
               "guard.kernel_admission=false"]
FLOODER_IP, HOST1_IP = "10.0.0.10", "10.0.0.11"


def test_expert_hosts_train_on_the_fabric(tmp_path: Path) -> None:
    port = cfgmod.load(REPO / "configs" / "moe.toml").net.port
    with flood_from("gbh0", lambda: start_run("configs/moe.toml", [
            f"run.iterations={ITERATIONS}", "net.worker_link_mbps=100", "moe.eval_every=1000",
            *FLOOD_GUARD], tmp_path), (HOST1_IP, port), FLOOD) as (proc, _):
        out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    run_dir = Path(out.strip().splitlines()[-1])
    rows = amoe.load_events(run_dir)
    _check_flood_refused(rows)
    for h in range(4):
        ce = [r["ce"] for r in sorted((r for r in rows if r.get("event") == "moe_step"
                                       and r["node"] == f"e{h}"), key=lambda r: r["iter"])]
        assert len(ce) == ITERATIONS
        # The seeded run's last three steps are at 0.65-0.67 of its first three on every
        # host (after 24 steps the last six were at 0.49-0.56 of the first six).
        assert statistics.mean(ce[-3:]) < 0.8 * statistics.mean(ce[:3]), ce
    disp = amoe.dispatch_table(rows, 100.0)
    assert len(disp) == ITERATIONS and all(d["hosts"] == 4 for d in disp)
    # The busiest link cannot carry more payload than its shaped rate allows in the
    # phase, plus the HTB bucket it may have filled while idle.
    burst = htb_burst_bytes(100.0, False, cfgmod.load(REPO / "configs" / "moe.toml")
                            .topo.access_burst_ms or None)
    for d in disp:
        assert d["efficiency"] > 0
        assert d["payload_bytes"] <= d["phase_s"] * 12.5e6 * TCP_GOODPUT_FRACTION + burst, d
    assert [r for r in rows if r.get("event") == "eval"]
    # The controller sampled every access link's class by itself, and the summary judged
    # the dispatches on the busiest of them.
    assert (run_dir / "classes.parquet").exists()
    run_summary = summary(run_dir)
    assert isinstance(run_summary["agent_limited"], bool), run_summary["agent_limited_why"]
    assert re.search(r"gbh\d\.(up|down).* busy \d\.\d\d", run_summary["agent_limited_why"]), run_summary
    # The verdict pools every exchange of rows, each on its busiest link: the combine of
    # every step (moe.toml: one layer, no warm-up) lies in a window of its own or in one
    # merged with an exchange it overlaps (the backward's, begun by an early host).
    windows = amoe.transfer_windows(rows)
    combine = amoe.exchange_windows(rows, "combine")
    assert len(combine) == ITERATIONS, combine
    assert all(any(s <= cs and ce <= e for _, s, e in windows) for _, cs, ce in combine), (
        combine, windows)
    samples = amoe.load_class_samples(run_dir).rename(columns={"point": "direction"})
    assert run_summary["agent_limited_why"] == agent_limited_points(
        samples, busiest_point_windows(samples, windows))[1]
    assert not leftovers()


def _check_flood_refused(rows: list[dict]) -> None:
    """Only host 1 refused anyone, and only the flooder's address: its 8 held the shared
    pool (it met its bound per source) before host 2 or host 3 joined host 1, and both
    joined, through the slot each keeps there."""
    refused = [r for r in rows if r.get("event") == "refused"]
    assert {(r["node"], r["source"]) for r in refused} == {("e1", FLOODER_IP)}, refused
    full = [r["ts_ns"] for r in refused
            if r["reason"] == "8 unauthenticated connections already"]
    assert full, refused
    joined = {r["peer_index"]: r["ts_ns"] - r["elapsed_ms"] * 1e6 for r in rows
              if r.get("event") == "handshake" and r["node"] == "e1" and r["end"] == "answer"
              and r["ok"]}
    assert sorted(joined) == [2, 3], joined
    # Each dials host 1 only after its handshake with host 0, and retries every 50 ms
    # while host 1 does not listen yet; the flood, there before, probes every millisecond
    # (at a higher priority than the run), so it is usually first. Both hosts beating it
    # takes both retries landing in the millisecond or two before its own: in 12 runs at
    # load 4-7 the later of the two came 7-350 ms after the pool was full.
    assert min(full) < max(joined.values()), (full, joined)


@pytest.mark.skipif(cpu_cap_kind() is None, reason="no cgroup cpu controller")
def test_expert_hosts_with_their_cpu_capped_at_1gbit_are_agent_limited(tmp_path: Path) -> None:
    """Two expert hosts on 1 Gbit/s links sharing a fifth of a core (a cgroup's CPU
    bandwidth limit, from their first mesh connection on): the links idle while token rows
    wait in the hosts."""
    hosts = 2
    port = cfgmod.load(REPO / "configs" / "moe.toml").net.port
    run_dir = capped_run("gradbed-test-cap-experts", "agents.moe.expert", port, hosts,
                         "configs/moe.toml", [
                             f"moe.hosts={hosts}", f"topo.hosts={hosts}", "moe.experts=4",
                             "run.iterations=3", "net.worker_link_mbps=1000",
                             "moe.eval_every=1000"], tmp_path)
    assert_agent_limited(run_dir, "MoE expert hosts")
