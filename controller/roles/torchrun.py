"""The torchrun role: real ``python -m torch.distributed.run`` on every training host,
running the user's unmodified script (``controller/torchrun/``). Its processes end the
run: the run is over when every host's torchrun has exited."""

from __future__ import annotations

from collections.abc import Sequence

from controller.roles import Role, RoleCommand, RoleContext, register
from controller.torchrun.plan import ROLE, TRAINING_KINDS, rank_plans
from topo.spec import HostSpec


def commands(ctx: RoleContext, hosts: Sequence[HostSpec]) -> list[RoleCommand]:
    from pathlib import Path

    tr = ctx.cfg.torchrun
    plans = rank_plans(ctx.cfg, ctx.spec, tr.python or ctx.python, Path(tr.script),
                       ctx.run_dir / "logs" / "ranks")
    names = {h.name for h in hosts}
    return [RoleCommand(p.host, p.argv) for p in plans if p.host in names]


ROLE_DECL = register(Role(
    name=ROLE,
    sections=("run", "net", "torchrun"),
    host_kinds=TRAINING_KINDS,
    ends_run=True,
    commands=commands,
    phase=1,
))
