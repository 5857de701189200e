"""The parameter server role (``agents/dp/ps.py``): aggregates the workers' gradients, steps
the optimizer, sends weights back; its exit ends the run (seeds/004, seeds/000)."""

from __future__ import annotations

from collections.abc import Sequence

from controller.roles import Role, RoleCommand, RoleContext, register
from topo.spec import HostSpec


def commands(ctx: RoleContext, hosts: Sequence[HostSpec]) -> list[RoleCommand]:
    # The PS reads everything else from the run directory's config.toml. Each worker's
    # host keeps an admission slot of its own there while strangers flood.
    expect = [a for h in ctx.spec.hosts if h.role == "worker" and h.ip
              for a in ("--expect", h.ip)]
    return [RoleCommand(h.name, (ctx.python, "-m", "agents.dp.ps", "--run-dir",
                                 str(ctx.run_dir), *expect), listens=(ctx.cfg.net.port,))
            for h in hosts]


ROLE = register(Role(
    name="ps",
    sections=("run", "net", "workload", "compress", "shaping", "membership"),
    host_kinds=("ps",),
    ends_run=True,
    commands=commands,
    phase=0,
    wait_ready=True,  # workers connect as soon as they start: the PS must listen first
    reports_progress=True,
))
