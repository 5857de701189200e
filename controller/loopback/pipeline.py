"""Runs pipeline stages as real processes over loopback TCP (no Mininet, no root), and the
one-process references a pipelined run must match (torchgpipe's transparency test)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from agents.core import config as cfgmod
from agents.core.lr_schedule import lr_at
from agents.pipeline.common import is_eval_step, micro_batch
from agents.pipeline.partition import balance_by_params, split
from agents.workloads.base import FlatModel, sgd_step_
from agents.workloads.factory import make_workload
from controller import warm
from controller.loopback.dp import REPO, free_port

BASE = ["workload.name='digits_deep'", "workload.hidden=32", "workload.depth=6",
        "workload.lr=0.2", "workload.momentum=0.9", "run.eval_every=1000"]


def make_run_dir(tmp: Path, overrides: list[str], name: str = "run"
                 ) -> tuple[Path, cfgmod.ExperimentConfig]:
    run_dir = tmp / name
    (run_dir / "events").mkdir(parents=True)
    cfg = cfgmod.load(REPO / "configs" / "digits.toml", [*BASE, *overrides])
    (run_dir / "config.toml").write_text(cfgmod.dumps(cfg))
    (run_dir / "secret").write_bytes(b"s3cret-for-tests-only-0123456789")
    return run_dir, cfg


def run_pipeline(tmp: Path, overrides: list[str], timeout_s: float = 120, name: str = "run",
                 ps: bool | None = None) -> tuple[Path, cfgmod.ExperimentConfig, list[int]]:
    """Every stage of every replica as its own process on 127.0.0.1, and the pipeline's PS
    (``agents.pipeline.stage_ps``) when ``ps`` (default: only when ``pipeline.replicas > 1``, which
    needs it); returns the exit codes, the PS's last."""
    run_dir, cfg = make_run_dir(tmp, overrides, name)
    pc = cfg.pipeline
    with_ps = pc.replicas > 1 if ps is None else ps
    ports = [[free_port() for _ in range(pc.stages)] for _ in range(pc.replicas)]
    ps_port = free_port()
    procs = []
    for r in range(pc.replicas):
        peers = ",".join(f"127.0.0.1:{port}" for port in ports[r])
        for s in range(pc.stages):
            cmd = [sys.executable, "-m", "agents.pipeline.stage", "--run-dir", str(run_dir),
                   "--stage", str(s), "--replica", str(r), "--peers", peers]
            if with_ps:
                cmd += ["--ps", f"127.0.0.1:{ps_port}"]
            log = open(run_dir / f"r{r}s{s}.log", "wb")
            procs.append(warm.spawn(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
    if with_ps:
        log = open(run_dir / "r_ps.log", "wb")
        procs.append(warm.spawn(
            [sys.executable, "-m", "agents.pipeline.stage_ps", "--run-dir", str(run_dir), "--host",
             "127.0.0.1", "--port", str(ps_port)],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
    rcs = []
    try:
        for proc in procs:
            rcs.append(proc.wait(timeout=timeout_s))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return run_dir, cfg, rcs


def logs(run_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(run_dir.glob("r*.log")))


AfterStep = Callable[[int, nn.Module], None]


def reference_pieces(cfg: cfgmod.ExperimentConfig, steps: int,
                     after_step: AfterStep | None = None) -> list[torch.Tensor]:
    """One process, unsplit model, plain SGD on the whole batch of every step (all replicas'
    micro-batches): each piece's flat weights, for GPipe and 1F1B to match.
    ``after_step(k, model)`` is called after step ``k``'s update."""
    pc = cfg.pipeline
    w = make_workload(cfg.workload)
    model = w.build_model(cfg.run.seed)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.workload.lr,
                          momentum=cfg.workload.momentum)
    m, d = pc.micro_batches, pc.replicas
    for k in range(steps):
        for group in opt.param_groups:  # the stages step with the scheduled lr of step k
            group["lr"] = _lr(cfg, k)
        opt.zero_grad()
        for r in range(d):
            for i in range(m):
                b = micro_batch(w, pc, k * m + i, r)
                (nn.functional.cross_entropy(model(b.x), b.y) / (m * d)).backward()
        opt.step()
        if after_step is not None:
            after_step(k, model)
    return _pieces(cfg, model)


def _lr(cfg: cfgmod.ExperimentConfig, step: int) -> float:
    wl = cfg.workload
    return lr_at(wl.lr, step, cfg.run.iterations, wl.lr_schedule, wl.lr_decay_at,
                 wl.lr_decay_factor)


def _pieces(cfg: cfgmod.ExperimentConfig, model: nn.Module) -> list[torch.Tensor]:
    pc = cfg.pipeline
    n = pc.stages * pc.chunks
    balance = list(pc.balance) or balance_by_params(model, n)
    return [FlatModel(piece).flat_params.clone() for piece in split(model, balance)]


def reference_two_group(cfg: cfgmod.ExperimentConfig, steps: int,
                        after_step: AfterStep | None = None, fresh: bool = True
                        ) -> list[torch.Tensor]:
    """One process applying the two-group schedule's two weight versions (PipeDream-2BW):
    B (pieces p..2p-1) steps synchronously; A (pieces 0..p-1) is run at ``V_s`` with
    ``V_0 = V_1 = W_0``, ``V_{s+1} = V_s - lr g_A(s-1)``, and after the last step its last
    gradient is applied once more. A gradient of step ``k`` is applied with step ``k``'s
    scheduled lr.

    ``after_step(k, model)`` sees the model after step ``k`` with A at ``V_{k+2}`` (step
    ``k``'s gradient applied: the version a stage sends the PS to evaluate), or with
    ``fresh=False`` at ``V_{k+1}`` (the version step ``k+1``'s forwards use)."""
    pc = cfg.pipeline
    w = make_workload(cfg.workload)
    model = w.build_model(cfg.run.seed)
    p, m, d = pc.stages, pc.micro_batches, pc.replicas
    balance = list(pc.balance) or balance_by_params(model, 2 * p)
    pieces = split(model, balance)
    a_flat = [FlatModel(pc_) for pc_ in pieces[:p]]
    b_flat = [FlatModel(pc_) for pc_ in pieces[p:]]
    mom = cfg.workload.momentum
    a_buf = [torch.zeros_like(f.flat_params) for f in a_flat]
    b_buf = [torch.zeros_like(f.flat_params) for f in b_flat]
    a_state = [t for f, buf in zip(a_flat, a_buf, strict=True) for t in (f.flat_params, buf)]
    pending: list[torch.Tensor] | None = None
    a_steps = 0

    def step_a(grads: list[torch.Tensor], step: int) -> None:
        """Apply step ``step``'s A gradients at that step's scheduled lr."""
        for f, g, buf in zip(a_flat, grads, a_buf, strict=True):
            sgd_step_(f.flat_params, g, buf, lr=_lr(cfg, step), momentum=mom,
                      first=a_steps == 0)

    for k in range(steps):
        for f in a_flat + b_flat:
            f.zero_grad()
        for r in range(d):
            for i in range(m):
                bt = micro_batch(w, pc, k * m + i, r)
                (nn.functional.cross_entropy(model(bt.x), bt.y) / (m * d)).backward()
        for f, buf in zip(b_flat, b_buf, strict=True):
            sgd_step_(f.flat_params, f.flat_grad, buf, lr=_lr(cfg, k), momentum=mom,
                      first=k == 0)
        grads = [f.flat_grad.clone() for f in a_flat]
        if pending is not None:  # V_{k+1} = V_k - lr g_A(k-1)
            step_a(pending, k - 1)
            a_steps += 1
        pending = grads
        if after_step is not None and not fresh:
            after_step(k, model)
        elif after_step is not None:  # V_{k+2} for the call, then back to V_{k+1}
            saved = [t.clone() for t in a_state]
            step_a(pending, k)
            after_step(k, model)
            for t, keep in zip(a_state, saved, strict=True):
                t.copy_(keep)
    assert pending is not None
    step_a(pending, steps - 1)
    return [f.flat_params.clone() for f in a_flat + b_flat]


def reference_evals(cfg: cfgmod.ExperimentConfig, fresh: bool = True
                    ) -> dict[int, dict[str, float]]:
    """The one-process reference of ``cfg``'s schedule (plain SGD for GPipe and 1F1B, the
    2BW versions for two-group) evaluated on the workload's held-out set after every step
    the pipeline's PS evaluates (:func:`agents.pipeline.common.is_eval_step`): step index -> metrics.
    The PS's ``eval`` events of a run of ``cfg`` must equal these."""
    w = make_workload(cfg.workload)
    out: dict[int, dict[str, float]] = {}

    def at(k: int, model: nn.Module) -> None:
        if is_eval_step(cfg.run, k):
            metrics = w.evaluate(model)
            assert metrics is not None, f"{cfg.workload.name} has no held-out set"
            out[k] = metrics

    if cfg.pipeline.schedule == "two_group":
        reference_two_group(cfg, cfg.run.iterations, at, fresh)
    else:
        reference_pieces(cfg, cfg.run.iterations, at)
    return out


def pipeline_pieces(run_dir: Path, cfg: cfgmod.ExperimentConfig, replica: int = 0
                    ) -> list[torch.Tensor]:
    """The pieces' final weights as the stages saved them, in pipeline-position order."""
    pc = cfg.pipeline
    out: list[torch.Tensor | None] = [None] * (pc.stages * pc.chunks)
    for s in range(pc.stages):
        node = f"s{s}" if pc.replicas == 1 else f"r{replica}s{s}"
        saved = torch.load(run_dir / f"{node}_final_weights.pt")
        for c, t in saved.items():
            out[c * pc.stages + s] = t
    assert all(t is not None for t in out)
    return [t for t in out if t is not None]
