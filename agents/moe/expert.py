"""The MoE expert host: one of H hosts that together train an MoE classifier.

Run inside a host as ``python -m agents.moe.expert --run-dir RUN --host H --addrs A0,A1,...``
(``Ai`` = ``ip:port`` of expert host i; without ``--addrs``, every host is on
127.0.0.1 at ``net.port + i``). It reads ``RUN/config.toml`` (section ``[moe]``, steps
from ``run.iterations``, seed from ``run.seed``) and its key (``--auth``), joins the full mesh
of expert hosts (:mod:`agents.moe.mesh`), and trains (:mod:`agents.moe.hosts`): its
experts, its data-parallel replica of the shared layers and its ZeRO shards. Host 0
decides when the run ends: when every host has run ``run.iterations`` steps.

Events (``RUN/events/eH.jsonl``, declared in :mod:`agents.core.events`): ``moe_phase``
per phase of every step (the timeline), ``moe_route`` per layer and step (tokens,
drops and imbalance per expert), ``moe_class_bytes`` per step (bytes per parameter
class and their formula), ``moe_param_bytes`` per step (parameter bytes held: ZeRO-3's
peak and after its free, beside their formulas), ``moe_grad_bytes`` per step (gradient
bytes held by each shared class at the end of its reduce-scatter and after it freed the
full-size buffer, beside their formulas), ``moe_offload`` per step with
``moe.offload_budget_bytes`` > 0 (expert transfers into the device budget and bytes
moved), ``moe_step`` (losses), ``eval`` (held-out accuracy, host 0).
``--dump DIR`` also writes each step's logits, local gradients and updated weights to
``DIR/hH_sS.npz`` (the transparency test reads them; numpy, no pickle).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agents.core import config as cfgmod
from agents.core.events import EventLog
from agents.moe.hosts import ExpertHost
from agents.moe.mesh import Mesh, file_keys, mesh_keys
from agents.moe.model import load_data
from agents.moe.zero import ParamClass, class_bytes
from agents.net import auth, codec, wire
from agents.net.admission import AdmissionLimits
from agents.net.control import liveness_client
from agents.workloads.device import make_deterministic, memory_stats


def parse_addrs(text: str, hosts: int) -> list[tuple[str, int]]:
    out = []
    for i, item in enumerate(text.split(",")):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise SystemExit(f"--addrs: entry {i} {item!r} is not ip:port")
        out.append((host, int(port)))
    if len(out) != hosts:
        raise SystemExit(f"--addrs: {len(out)} addresses for moe.hosts = {hosts}")
    return out


def max_frame_bytes(cfg: cfgmod.ExperimentConfig, tokens_per_image: int,
                    class_numels: list[int]) -> int:
    """The largest payload any exchange may carry: a peer's rows for all of this
    host's experts at full capacity, a ZeRO shard, or the evaluation's rows."""
    m = cfg.moe
    per_host = m.experts // m.hosts
    cap_tokens = max(cfg.workload.batch_size, 360 // m.hosts) * tokens_per_image
    from agents.moe.capacity import expert_capacity

    cap = expert_capacity(cap_tokens, m.top_k, m.experts, m.capacity_factor, m.min_capacity)
    rows = 4 * m.d_model * cap * per_host
    shard = max([4 * (-(-n // m.hosts)) for n in class_numels] + [0])
    return max(rows, shard, 4096)


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m agents.moe.expert", description=__doc__)
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--host", required=True, type=int, help="this host's index")
    ap.add_argument("--addrs", default=None, help="ip:port of every expert host, in order")
    ap.add_argument("--dump", type=Path, default=None, help="write per-step tensors here")
    auth.add_auth_argument(ap)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Check the arguments and keys (a bad one exits at once, naming it), then train;
    a peer's bad frame ends the host with exit code 3 and an ``expert_error`` event."""
    args = _args(argv)
    torch.set_num_threads(1)
    cfg = cfgmod.load(args.run_dir / "config.toml")
    make_deterministic(cfg.run.deterministic)
    m = cfg.moe
    if not 0 <= args.host < m.hosts:
        raise SystemExit(f"--host: {args.host} not in [0, moe.hosts={m.hosts})")
    addrs = (parse_addrs(args.addrs, m.hosts) if args.addrs else
             [("127.0.0.1", cfg.net.port + i) for i in range(m.hosts)])
    # With --auth stdin the bundle holds this host's control key and the key of its link to
    # every other expert host, which only the two ends hold (agents.net.link).
    bundle, secret = auth.agent_keys(args.auth, args.run_dir, codec.PUBLIC_SECRET)
    try:
        link_keys = (file_keys(secret, args.host, m.hosts) if bundle is None
                     else mesh_keys(bundle, args.host, m.hosts))
    except KeyError as e:
        raise SystemExit(f"expert host {args.host}: {e.args[0]}") from None
    # Heartbeats on the control channel: a hung host is declared lost by the controller.
    liveness_client(args.run_dir, bundle, timeout_s=cfg.guard.handshake_timeout_s)
    log = EventLog.for_node(args.run_dir, args.run_dir.name, f"e{args.host}")
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
    return wire.run_agent(lambda: _train(cfg, args, addrs, link_keys, secret, log),
                          name=lambda: f"expert host {args.host}", errors=(codec.FrameError,),
                          code=3, on_error=lambda e: log.emit("expert_error", error=e),
                          close=log.close)


def _train(cfg: cfgmod.ExperimentConfig, args: argparse.Namespace,
           addrs: list[tuple[str, int]], link_keys: dict[int, bytes], secret: bytes,
           log: EventLog) -> int:
    m = cfg.moe
    run_id = args.run_dir.name
    data = load_data(m.dataset)
    # Build once to size the frame limit (the shared classes' sizes).
    probe = ExpertHost(m, data, args.host, None, seed=cfg.run.seed, train=cfg.workload)
    numels = [c.numel for c in probe.opt.classes.values()]
    limit = max_frame_bytes(cfg, data.tokens, numels)
    del probe
    with Mesh(args.host, addrs, codec.run_tag(run_id, secret), run_id=run_id,
              keys=link_keys, crc=m.crc, max_payload_bytes=limit,
              handshake_timeout_s=cfg.guard.handshake_timeout_s,
              limits=AdmissionLimits.from_guard(cfg.guard), log=log) as mesh:
        host = ExpertHost(m, data, args.host, mesh, seed=cfg.run.seed, train=cfg.workload)
        log.emit("moe_start", hosts=m.hosts, experts=m.experts, owned=host.mine,
                 expert_numel=host.opt.expert_numel,
                 zero3_numel=host.opt.classes[ParamClass.ZERO3].numel,
                 zero2_numel=host.opt.classes[ParamClass.ZERO2].numel, max_frame_bytes=limit)
        formula = {c.value: class_bytes(sc.numel, m.hosts, c.value)
                   for c, sc in host.opt.classes.items()}
        for step in range(cfg.run.iterations):
            _step(cfg, args, host, mesh, log, step, formula)
        torch.save(host.opt.local_state(), args.run_dir / f"e{args.host}_final_weights.pt")
        if host.offload is not None and host.offload.device.type == "cuda":
            log.emit("device_memory", cfg.run.iterations - 1,
                     **memory_stats(host.offload.device))
        log.emit("moe_done", cfg.run.iterations - 1)
    return 0


def _step(cfg: cfgmod.ExperimentConfig, args: argparse.Namespace, host: ExpertHost,
          mesh: Mesh, log: EventLog, step: int, formula: dict[str, int]) -> None:
    """One training step and its events (and its tensors with ``--dump``)."""
    m = cfg.moe
    dump: dict[str, torch.Tensor] | None = {} if args.dump else None
    r = host.train_step(step, dump)
    for ph in host.log.phases:
        log.emit("moe_phase", step, **ph.as_event())
    for rt in r["routing"]:
        log.emit("moe_route", step, **rt)
    log.emit("moe_class_bytes", step, **{f"{k}_bytes": v
                                         for k, v in r["bytes_by_class"].items()},
             **{f"{k}_formula_bytes": v for k, v in formula.items()})
    log.emit("moe_param_bytes", step, **r["param_bytes"])
    log.emit("moe_grad_bytes", step, **r["grad_bytes"])
    if r["offload"] is not None:
        log.emit("moe_offload", step, policy=m.offload_policy,
                 budget_bytes=m.offload_budget_bytes, device=m.offload_device,
                 **r["offload"])
    log.emit("moe_step", step, loss=r["loss"], ce=r["ce"], aux=r["aux"],
             step_s=r["step_s"], expert_uses=[f"{lay}.{e}" for lay, e in
                                              r["expert_uses"]])
    if dump is not None:
        host.opt.gather_before_use(mesh, step + 1)  # complete zero3 weights to dump
        for n, w in host.weights().items():
            dump[f"weight/{n}"] = w
        arrays: dict[str, Any] = {k: v.numpy() for k, v in dump.items()}
        np.savez(args.dump / f"h{args.host}_s{step}.npz", **arrays)
    if (step + 1) % m.eval_every == 0 or step == cfg.run.iterations - 1:
        ev = host.evaluate(step)
        if args.host == 0:
            log.emit("eval", step, **ev)


if __name__ == "__main__":
    wire.exit_process(main())
