"""Transparency (torchgpipe's test_transparency, for MoE): H expert-host processes over
real TCP on loopback give the outputs, gradients, weights and routing of the same MoE
in one process with one routing group per host."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from agents.core import config as cfgmod
from agents.moe import expert
from agents.moe.hosts import dispatch_bytes, owned_experts
from agents.moe.layer import MoELayer
from agents.moe.model import build_model, global_batch, load_data, loss_fn
from agents.moe.zero import ParamClass, classify
from controller import warm

pytestmark = pytest.mark.loopback  # starts real agent processes on 127.0.0.1

REPO = Path(__file__).resolve().parents[3]


def free_ports(n: int) -> int:
    """A base port with n free ports above it."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n > 65000:
            continue
        try:
            socks = []
            for i in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no free port range")


def run_hosts(tmp: Path, overrides: list[str], dump: bool = True, threads: bool = False,
              timeout_s: float = 120) -> tuple[Path, cfgmod.ExperimentConfig]:
    """Run the expert hosts as processes (``python -m agents.moe.expert``), or, to spare
    the interpreter start-ups, as threads calling the same ``main`` (same sockets)."""
    run_dir = tmp / "run"
    (run_dir / "events").mkdir(parents=True)
    hosts = int(next(o for o in overrides if o.startswith("moe.hosts=")).split("=")[1])
    cfg = cfgmod.load(REPO / "configs" / "digits.toml",
                      [*overrides, f"net.port={free_ports(hosts)}"])
    (run_dir / "config.toml").write_text(cfgmod.dumps(cfg))
    (run_dir / "secret").write_bytes(b"s3cret-for-tests-only-0123456789")
    procs = []
    args = [["--run-dir", str(run_dir), "--host", str(h)]
            + (["--dump", str(tmp / "dump")] if dump else []) for h in range(cfg.moe.hosts)]
    if threads:
        results: dict[int, BaseException | int] = {}

        def body(h: int) -> None:
            try:
                results[h] = expert.main(args[h])
            except BaseException as e:  # noqa: BLE001  (reported below)
                results[h] = e
        ts = [threading.Thread(target=body, args=(h,)) for h in range(cfg.moe.hosts)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout_s)
        assert all(results.get(h) == 0 for h in range(cfg.moe.hosts)), results
        return run_dir, cfg
    for h in range(cfg.moe.hosts):
        cmd = [sys.executable, "-m", "agents.moe.expert", *args[h]]
        procs.append(warm.spawn(cmd, cwd=REPO, stdout=open(run_dir / f"e{h}.log", "wb"),
                                stderr=subprocess.STDOUT))
    try:
        for h, p in enumerate(procs):
            rc = p.wait(timeout=timeout_s)
            assert rc == 0, (run_dir / f"e{h}.log").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return run_dir, cfg


def events(run_dir: Path, h: int, name: str) -> list[dict]:
    lines = (run_dir / "events" / f"e{h}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == name]


CASES = {
    "k2-probability-residual": ["moe.hosts=4", "moe.experts=8", "moe.top_k=2",
                                "moe.capacity_factor=0.75", "moe.drop_policy=\"probability\"",
                                "moe.residual=true", "moe.layers=2", "workload.batch_size=6",
                                "moe.zero3_min_numel=500", "run.iterations=3"],
    "k1-position": ["moe.hosts=2", "moe.experts=4", "moe.top_k=1",
                    "moe.capacity_factor=1.25", "moe.drop_policy=\"position\"",
                    "moe.layers=1", "workload.batch_size=8", "moe.zero3_min_numel=500",
                    "run.iterations=3"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_spread_equals_one_process(tmp_path: Path, case: str) -> None:
    # The 4-host case runs real processes; the 2-host case threads (the same sockets).
    run_dir, cfg = run_hosts(tmp_path, CASES[case], threads=case.startswith("k1"))
    m = cfg.moe
    H = m.hosts
    data = load_data(m.dataset)
    ref = build_model(m, data, groups=H, seed=cfg.run.seed)
    opt = torch.optim.SGD(ref.parameters(), lr=cfg.workload.lr,
                          momentum=cfg.workload.momentum)
    per = m.experts // H
    drops_total = 0
    for step in range(cfg.run.iterations):
        d = [dict(np.load(tmp_path / "dump" / f"h{h}_s{step}.npz")) for h in range(H)]
        x, y = global_batch(data, step, H, cfg.workload.batch_size)
        opt.zero_grad()
        logits = ref(x)
        loss, _ = loss_fn(ref, logits, y, m.aux_loss_coef)
        loss.backward()
        got_logits = np.concatenate([d[h]["logits"] for h in range(H)])
        np.testing.assert_allclose(got_logits, logits.detach().numpy(), atol=2e-5, rtol=1e-4)
        for name, p in ref.named_parameters():
            assert p.grad is not None
            if classify(name, p, m.zero3_min_numel) is ParamClass.EXPERT:
                e = int(name.split(".experts.")[1].split(".")[0])
                got = d[e // per][f"grad/{name}"]
            else:  # each host's local gradient; their sum is the global one
                got = sum(d[h][f"grad/{name}"] for h in range(H))
            np.testing.assert_allclose(got, p.grad.numpy(), atol=2e-5, rtol=1e-4,
                                       err_msg=f"grad {name} step {step}")
        # Routing: the same kept and dropped choices per expert and layer.
        for li, layer in enumerate(ref.moe):
            assert isinstance(layer, MoELayer) and layer.stats is not None
            routes = [r for h in range(H) for r in events(run_dir, h, "moe_route")
                      if r["iter"] == step and r["layer"] == li]
            assert len(routes) == H
            kept = np.sum([r["kept"] for r in routes], axis=0)
            dropped = np.sum([r["dropped"] for r in routes], axis=0)
            assert kept.tolist() == layer.stats.kept.tolist()
            assert dropped.tolist() == layer.stats.dropped.tolist()
            drops_total += int(dropped.sum())
        opt.step()
        for name, p in ref.named_parameters():
            if classify(name, p, m.zero3_min_numel) is ParamClass.EXPERT:
                e = int(name.split(".experts.")[1].split(".")[0])
                owners = [e // per]
            else:
                owners = list(range(H))
            for h in owners:
                np.testing.assert_allclose(d[h][f"weight/{name}"], p.detach().numpy(),
                                           atol=2e-5, rtol=1e-4,
                                           err_msg=f"weight {name} host {h} step {step}")
    if m.capacity_factor < 1:
        assert drops_total > 0  # the case exercises drops
    # Both shared classes are present and their bytes equal the formula.
    start = events(run_dir, 0, "moe_start")[0]
    assert start["zero3_numel"] > 0 and start["zero2_numel"] > 0
    for h in range(H):
        for b in events(run_dir, h, "moe_class_bytes"):
            assert b["expert_bytes"] == 0
            assert b["zero3_bytes"] == b["zero3_formula_bytes"] > 0
            assert b["zero2_bytes"] == b["zero2_formula_bytes"] > 0
            # ZeRO-3: reduce-scatter and two all-gathers (forward, backward); ZeRO-2: one
            # each. One frame (64-byte header + the shard) to every peer per collective.
            for kind, n in (("zero3", 3), ("zero2", 2)):
                shard = -(-start[f"{kind}_numel"] // H)
                assert b[f"{kind}_formula_bytes"] == n * (H - 1) * (4 * shard + 64)
    # ZeRO-3 frees for real: after each free a host holds only its shard of the split
    # class, after a gather shard + buffer, and no freed buffer outlived its free.
    for h in range(H):
        got = events(run_dir, h, "moe_param_bytes")
        assert len(got) == cfg.run.iterations
        shard = 4 * -(-start["zero3_numel"] // H)
        for b in got:
            assert b["zero3_freed_bytes"] == b["zero3_freed_formula_bytes"] == shard
            assert b["zero3_peak_bytes"] == b["zero3_peak_formula_bytes"] == (H + 1) * shard
            assert b["zero3_buffers_kept_alive"] == 0
            assert b["zero2_bytes"] == 4 * H * -(-start["zero2_numel"] // H)
            assert b["expert_bytes"] == 4 * start["expert_numel"]
            assert b["host_freed_bytes"] == shard + b["zero2_bytes"] + b["expert_bytes"]
        # Gradients: each shared class holds its full buffer to the end of the
        # reduce-scatter, then only its summed shard.
        grads = events(run_dir, h, "moe_grad_bytes")
        assert len(grads) == cfg.run.iterations
        for g in grads:
            for kind in ("zero3", "zero2"):
                gshard = 4 * -(-start[f"{kind}_numel"] // H)
                assert g[f"{kind}_grad_freed_bytes"] == g[f"{kind}_grad_freed_formula_bytes"] \
                    == gshard
                assert g[f"{kind}_grad_peak_bytes"] == g[f"{kind}_grad_peak_formula_bytes"] \
                    == (H + 1) * gshard
            assert g["grad_buffers_kept_alive"] == 0
            assert g["expert_grad_bytes"] == 4 * start["expert_numel"]
    # Each host saved what it alone holds: its experts, as the last step left them, and
    # its shard of each shared class (together, the whole model without a gather).
    last = cfg.run.iterations - 1
    for h in range(H):
        saved = torch.load(run_dir / f"e{h}_final_weights.pt")
        dumped = dict(np.load(tmp_path / "dump" / f"h{h}_s{last}.npz"))
        experts = [n for n in saved if not n.endswith(".shard")]
        assert len(experts) == 4 * m.layers * per  # two weights, two biases per expert
        for n in experts:
            np.testing.assert_array_equal(saved[n].numpy(), dumped[f"weight/{n}"])
        for kind in ("zero3", "zero2"):
            assert saved[f"{kind}.shard"].numel() == -(-start[f"{kind}_numel"] // H)
    # Dispatch bytes (both phases, headers included) equal dispatch_bytes() of the
    # rows each host routed to each peer's experts.
    for h in range(H):
        phases = events(run_dir, h, "moe_phase")
        for r in events(run_dir, h, "moe_route"):
            rows = [sum(r["kept"][e] for e in owned_experts(p, m.experts, H))
                    for p in range(H) if p != h]
            got = sum(ph["bytes_up"] for ph in phases if ph["iter"] == r["iter"]
                      and ph["layer"] == r["layer"]
                      and ph["phase"] in ("dispatch_counts", "dispatch_tokens"))
            assert got == dispatch_bytes(rows, m.d_model, per)
    # trace.json: every phase of every host is one span, whole-model phases on the host's
    # "step" thread (one after the other), a layer's phases on its "layers" thread.
    from analysis.load import load_events
    from analysis.trace import chrome_trace

    ev = load_events(run_dir)
    trace = chrome_trace(ev, pd.DataFrame(columns=["ts_ns", "direction", "dev"]))["traceEvents"]
    host = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    lane = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    for h in range(H):
        phases = events(run_dir, h, "moe_phase")
        for name, whole in (("step", True), ("layers", False)):
            spans = sorted((e for e in trace if e["ph"] == "X" and host[e["pid"]] == f"e{h}"
                            and lane[(e["pid"], e["tid"])] == name), key=lambda e: e["ts"])
            assert len(spans) == sum((p["layer"] < 0) == whole for p in phases) > 0
            if whole:
                assert all(a["ts"] + a["dur"] <= b["ts"] + 0.002
                           for a, b in zip(spans, spans[1:], strict=False))
