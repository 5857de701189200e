"""``gradbed.ddp.instrument``: what ``gradbed torchrun`` tells a rank, the events a DDP
model's iterations and buckets leave in the run directory (one rank, gloo on 127.0.0.1, in
this process), their place in ``trace.json``, and nothing at all outside gradbed."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradbed.ddp
from agents.core import config as cfgmod
from agents.core.events import jsonl_to_parquet, read_jsonl
from analysis.trace import chrome_trace
from controller.roles.torchrun import rank_plans, torchrun_spec
from gradbed.ddp.instrument import node_name
from tests.support.ddp_ranks import free_port
from topo.shapes import shape_spec

REPO = Path(__file__).resolve().parents[3]


def test_gradbed_torchrun_gives_each_rank_its_run_host_and_uplink_rate() -> None:
    c = cfgmod.load(REPO / "examples/torchrun_ddp/fabric4.toml", ["net.worker_link_mbps=50"])
    plans = rank_plans(c, torchrun_spec(shape_spec(c)), "/py", Path("/s/t.py"),
                       Path("/runs/r1/logs/ranks"))
    for i, p in enumerate(plans):
        assert p.env["GRADBED_RUN_DIR"] == "/runs/r1" and p.env["GRADBED_HOST"] == f"gbh{i}"
        assert p.env["GRADBED_LINK_MBPS"] == "50"  # gbh3's trace replays on a 50 Mbit/s link


def test_the_events_file_is_named_after_the_host_and_the_local_rank() -> None:
    assert node_name({"GRADBED_HOST": "w2", "LOCAL_WORLD_SIZE": "1"}) == "w2"
    assert node_name({"GRADBED_HOST": "w2", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == "w2.1"


@pytest.fixture
def group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def train(ddp: nn.Module, steps: int, record: gradbed.ddp.Instrument) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        opt.zero_grad()
        loss = ddp(torch.randn(8, 64, generator=g)).square().mean()
        loss.backward()
        opt.step()
        record.loss(loss)


def test_outside_gradbed_instrument_registers_and_writes_nothing(group, monkeypatch) -> None:
    monkeypatch.delenv("GRADBED_RUN_DIR", raising=False)
    ddp = DDP(nn.Linear(64, 4))
    record = gradbed.ddp.instrument(ddp)
    assert not record.active
    assert ddp._comm_hooks == [] and not ddp._forward_pre_hooks
    train(ddp, 2, record)


def test_iterations_and_buckets_land_in_the_run_and_on_its_timeline(group, tmp_path) -> None:
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(64, 4096), nn.ReLU(), nn.Linear(4096, 64)),
              bucket_cap_mb=0.5)
    ddp.register_comm_hook(*gradbed.ddp.hook("topk", ratio=0.1))
    record = gradbed.ddp.instrument(ddp, run_dir=tmp_path)
    train(ddp, 4, record)
    record.close()
    rows = read_jsonl(next((tmp_path / "events").glob("*.jsonl")))
    iters = [r for r in rows if r["event"] == "ddp_iter"]
    buckets = [r for r in rows if r["event"] == "ddp_bucket"]
    assert [r["iter"] for r in iters] == [0, 1, 2, 3]
    assert all(r["hook"] == "topk" and not math.isnan(r["loss"]) for r in iters)
    assert len({r["bucket"] for r in buckets}) >= 2  # several buckets, each recorded
    for r in buckets:
        assert r["start_ns"] <= r["end_ns"] and r["comm_s"] >= 0 and r["compress_s"] >= 0
        # Dense before the bucket rebuild, top-k 10 % (values and indices) after it.
        assert r["keep"] == (1.0 if r["iter"] < 2 else 0.1)
        if r["iter"] >= 2:
            assert r["payload_bytes"] < r["raw_bytes"] / 4
    for r in iters:  # the iteration's sums are its buckets'
        mine = [b for b in buckets if b["iter"] == r["iter"]]
        assert r["raw_bytes"] == sum(b["raw_bytes"] for b in mine)
        assert r["start_ns"] <= min(b["start_ns"] for b in mine)
    ev = pd.read_parquet(jsonl_to_parquet(next((tmp_path / "events").glob("*.jsonl"))))
    trace = chrome_trace(ev, pd.DataFrame())
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert sum(e["name"] == "ddp_iter" for e in spans) == 4
    assert {e["name"] for e in spans} >= {"ddp_iter", "b0", "b1"}
