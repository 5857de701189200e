"""The pipeline stage role (``agents/stage.py``): one process per stage of each of the
``pipeline.replicas`` pipelines, activations forward and gradients backward over the
fabric's shaped access links (DESIGN.md 1.3; GPipe, 1F1B, the seed's two-group schedule).

Placement: the fabric's hosts of kind ``stage``, by rank: host ``r * p + s`` runs stage
``s`` of replica ``r``, listening on ``pipeline.base_port + s``; replica 0's stage ``s``
also averages that stage's gradients over the replicas (``--hub``). The run ends when
every stage has exited.
"""

from __future__ import annotations

from collections.abc import Sequence

from agents.core.nodes import stage_links
from controller.roles import Role, RoleCommand, RoleContext, RoleError, register
from topo.spec import HostSpec


def commands(ctx: RoleContext, hosts: Sequence[HostSpec]) -> list[RoleCommand]:
    pc = ctx.cfg.pipeline
    p, d = pc.stages, pc.replicas
    ranked = sorted(hosts, key=lambda h: h.rank)
    if p < 2 or len(ranked) != p * d:
        raise RoleError(f"stage: {len(ranked)} stage hosts for pipeline.stages={p} x "
                        f"pipeline.replicas={d} (set topo.hosts = {max(p, 2) * d})")
    out = []
    for h in ranked:
        r, s = divmod(h.rank, p)
        peers = ",".join(f"{ranked[r * p + i].ip}:{pc.base_port + i}" for i in range(p))
        argv = [ctx.python, "-m", "agents.stage", "--run-dir", str(ctx.run_dir),
                "--stage", str(s), "--replica", str(r), "--peers", peers, "--auth", "stdin"]
        if d > 1:
            argv += ["--hub", f"{ranked[s].ip}:{pc.base_port + s}"]
        # The keys of the links this stage is an end of, on its stdin (agents.link).
        out.append(RoleCommand(h.name, tuple(argv), links=tuple(stage_links(r, s, p, d))))
    return out


ROLE = register(Role(
    name="stage",
    sections=("run", "net", "workload", "pipeline"),
    host_kinds=("stage",),
    ends_run=True,  # the run is over when every stage has run its schedule
    commands=commands,
    phase=1,
))
