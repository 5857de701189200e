"""The pipeline stage role (``agents/pipeline/stage.py``): one process per stage of each of the
``pipeline.replicas`` pipelines, activations forward and gradients backward over the
fabric's shaped access links (DESIGN.md 1.3; GPipe, 1F1B, the seed's two-group schedule),
and the pipeline's PS (``agents/pipeline/stage_ps.py``) on a host of its own.

Placement: the fabric's hosts of kind ``stage``, by rank: host ``r * p + s`` runs stage
``s`` of replica ``r``, listening on ``net.port + s``; host ``p * d`` runs the PS
(on ``net.port``), which averages each stage's gradients over the d replicas once
per step and evaluates the model (``topo.hosts = p * d + 1``). The run ends when every
stage and the PS have exited.
"""

from __future__ import annotations

from collections.abc import Sequence

from agents.core.nodes import stage_links, stage_ps_links
from controller.roles import Role, RoleCommand, RoleContext, RoleError, register
from topo.spec import HostSpec


def commands(ctx: RoleContext, hosts: Sequence[HostSpec]) -> list[RoleCommand]:
    pc = ctx.cfg.pipeline
    p, d = pc.stages, pc.replicas
    ranked = sorted(hosts, key=lambda h: h.rank)
    if p < 2 or len(ranked) != p * d + 1:
        raise RoleError(f"stage: {len(ranked)} stage hosts for pipeline.stages={p} x "
                        f"pipeline.replicas={d} and the PS (set topo.hosts = "
                        f"{max(p, 2) * d + 1})")
    ps = ranked[p * d]
    # Each stage's host keeps an admission slot of its own at the PS while strangers flood.
    expect = [a for h in ranked[:p * d] if h.ip for a in ("--expect", h.ip)]
    out = [RoleCommand(ps.name, (ctx.python, "-m", "agents.pipeline.stage_ps", "--run-dir",
                                 str(ctx.run_dir), "--port", str(ctx.cfg.net.port),
                                 "--auth", "stdin", *expect),
                       links=tuple(stage_ps_links(p, d)), agent="stage_ps",
                       listens=(ctx.cfg.net.port,))]
    for h in ranked[:p * d]:
        r, s = divmod(h.rank, p)
        peers = ",".join(f"{ranked[r * p + i].ip}:{ctx.cfg.net.port + i}" for i in range(p))
        out.append(RoleCommand(h.name, (
            ctx.python, "-m", "agents.pipeline.stage", "--run-dir", str(ctx.run_dir), "--stage", str(s),
            "--replica", str(r), "--peers", peers, "--auth", "stdin",
            "--ps", f"{ps.ip}:{ctx.cfg.net.port}"),
            # The keys of the links this stage is an end of, on its stdin (agents.net.link).
            links=tuple(stage_links(r, s, p, d)), listens=(ctx.cfg.net.port + s,)))
    return out


ROLE = register(Role(
    name="stage",
    sections=("run", "net", "workload", "pipeline"),
    host_kinds=("stage",),
    ends_run=True,  # the run is over when every stage has run its schedule
    commands=commands,
    phase=1,
))
