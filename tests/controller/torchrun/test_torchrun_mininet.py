"""``gradbed torchrun`` in real Mininet (root): the example's DDP script on 4 emulated
hosts (5 ms and 0.1 % loss on every uplink, one uplink replaying the cellular trace) ends
with the parameters of the same script on loopback; a ring all-reduce's TCP payload per
host is 2(N-1)/N x S; a rank that exits non-zero ends the run naming it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from analysis.load import load_run
from tests.support.mininet_run import REPO, leftovers, summary

pytestmark = pytest.mark.mininet

EXAMPLE = REPO / "examples" / "torchrun_ddp"
CONFIG = EXAMPLE / "fabric4.toml"


def mine_left() -> list[str]:
    """What these runs could leave: the fabric's hosts (gbh*) and torchrun processes.
    Other engineers' networks on this machine (stars, fake clusters) are not counted."""
    return [x for x in leftovers() if "gbh" in x or "torch.distributed" in x]


def gradbed_torchrun(out: Path, script: Path, args: list[str], overrides: list[str] = (),
                     timeout_s: float = 1200) -> tuple[Path, subprocess.CompletedProcess[str]]:
    argv = [sys.executable, "-m", "controller.cli", "torchrun", str(CONFIG), "--out",
            str(out), "--no-progress"]
    for o in overrides:
        argv += ["--set", o]
    # The timeout covers waiting for the machine-wide network lock, which other runs may
    # hold for minutes. From the test's folder (the ranks start where gradbed was started), with this
    # checkout first on the path.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([*argv, "--", str(script), *args], cwd=out, capture_output=True,
                          text=True, timeout=timeout_s, env=env)
    lines = proc.stdout.strip().splitlines()
    assert lines, f"gradbed torchrun printed nothing; stderr:\n{proc.stderr[-3000:]}"
    return Path(lines[-1]), proc


def test_ddp_parameters_equal_loopback_and_one_more_step_is_far(tmp_path: Path) -> None:
    steps = 4
    run_dir, proc = gradbed_torchrun(tmp_path, EXAMPLE / "train.py",
                                     ["--steps", str(steps), "--save", str(tmp_path / "net.pt")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(run_dir)
    assert s["stop_reason"] == "completed", s
    assert s["torchrun"]["exit_codes"] == {"0": 0, "1": 0, "2": 0, "3": 0}
    sent = s["torchrun"]["bytes"]["payload_sent_bytes"]
    assert all(b > 0 for b in sent.values()), sent  # every host's ranks crossed its link
    assert (run_dir / "tcp.parquet").exists() and load_run(run_dir).summary == s
    assert 0 < s["torchrun"]["points_busy_utilization"]["gbh3.up"] <= 1.05  # the traced uplink
    # The same script on loopback (4 local processes, no emulation), one step further.
    ref = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "4", str(EXAMPLE / "train.py"),
                          "--steps", str(steps + 1), "--history", str(tmp_path / "hist.pt")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    got = torch.load(tmp_path / "net.pt")
    hist = torch.load(tmp_path / "hist.pt")

    def gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))

    assert gap(got, hist[steps - 1]) <= 1e-6
    assert gap(got, hist[steps]) > 1e-3  # the check can fail: one extra step is far away
    assert mine_left() == []


def test_ring_allreduce_payload_is_two_n_minus_one_over_n(tmp_path: Path) -> None:
    floats, hosts = 1_000_000, 4
    run_dir, proc = gradbed_torchrun(tmp_path, EXAMPLE / "allreduce.py",
                                     ["--floats", str(floats)],
                                     ["net.worker_link_mbps=1000", "topo.traces={}",
                                      "net.loss_pct=0"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    b = summary(run_dir)["torchrun"]["bytes"]
    want = 2 * (hosts - 1) / hosts * 4 * floats
    for host, sent in b["payload_sent_bytes"].items():
        assert abs(sent - want) / want < 0.02, (host, sent, want)
        assert abs(b["payload_received_bytes"][host] - want) / want < 0.02
        # Headers and ACKs ride on top of the payload on the emulated interface.
        assert sent < b["interface_tx_bytes"][host] < 1.1 * sent + 200_000
    assert mine_left() == []


def test_a_rank_that_fails_ends_the_run_naming_it(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text("import sys, torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "dist.barrier()\n"
                      "if dist.get_rank() == 2:\n    sys.exit(3)\n"
                      "dist.barrier()\n")
    run_dir, proc = gradbed_torchrun(tmp_path, script, [], ["topo.traces={}"])
    assert proc.returncode == 4, proc.stderr[-3000:]
    s = load_run(run_dir).summary
    assert s["stop_reason"].startswith("rank 2 (host gbh2) exited with status 3"), s
    assert s["torchrun"]["exit_codes"]["2"] == 3
    assert "rank 2 (host gbh2) exited with status 3" in proc.stderr
    assert mine_left() == []


def test_an_fsdp_script_shards_over_the_emulated_links(tmp_path: Path) -> None:
    """FSDP2 (``fully_shard``) over gloo: the parameters after K steps are the DDP
    script's on loopback (a reduce-scatter sums in another order: 1e-5), and every host
    sends between one all-gather plus one reduce-scatter of the parameters per step and
    five times that (forward and backward all-gathers, a reduce-scatter gloo may run as
    an all-reduce), plus the rendezvous."""
    steps, hosts, hidden = 3, 4, 128
    run_dir, proc = gradbed_torchrun(tmp_path, EXAMPLE / "fsdp.py",
                                     ["--steps", str(steps), "--save", str(tmp_path / "f.pt")],
                                     ["topo.traces={}", "net.loss_pct=0"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    params_bytes = 4 * (64 * hidden + hidden + hidden * 10 + 10)
    shard = (hosts - 1) / hosts * params_bytes
    for host, sent in summary(run_dir)["torchrun"]["bytes"]["payload_sent_bytes"].items():
        assert 2 * shard * steps < sent < 5 * shard * (steps + 1) + 100_000, (host, sent)
    ref = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "4", str(EXAMPLE / "train.py"),
                          "--steps", str(steps), "--save", str(tmp_path / "d.pt")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    for a, b in zip(torch.load(tmp_path / "f.pt"), torch.load(tmp_path / "d.pt"), strict=True):
        assert float((a - b).abs().max()) < 1e-5
    assert mine_left() == []


def test_a_rank_that_never_reaches_init_process_group_is_named(tmp_path: Path) -> None:
    """Rank 2 sleeps before init_process_group; its peers wait in theirs. After
    torchrun.stall_s without a byte the run ends naming rank 2 and its variables, long
    before gloo's 30-minute timeout. stall_s stays above the time torch takes to import
    on a loaded 2-core machine (10-20 s, twice: torchrun, then the rank)."""
    script = tmp_path / "late.py"
    script.write_text("import os, time, torch.distributed as dist\n"
                      "if os.environ['RANK'] == '2':\n    time.sleep(600)\n"
                      "dist.init_process_group('gloo')\n"
                      "dist.barrier()\n")
    run_dir, proc = gradbed_torchrun(tmp_path, script, [],
                                     ["topo.traces={}", "torchrun.stall_s=30"])
    assert proc.returncode == 3, proc.stderr[-3000:]  # a rank that never came up: failed start
    reason = load_run(run_dir).summary["stop_reason"]
    assert reason.startswith("failed to start: rank 2 (host gbh2) never reached "
                             "init_process_group"), reason
    assert "GLOO_SOCKET_IFNAME=gbh2-eth0" in reason and "10.0.0.10:29500" in reason
    assert summary(run_dir)["wall_s"] < 200
    assert mine_left() == []
