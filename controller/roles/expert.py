"""The MoE expert host role (``agents/moe/expert.py``): E experts over H hosts of the fabric,
dispatch and combine as two-phase all-to-alls over TCP, shared layers sharded ZeRO-2/3
(DESIGN.md 1.4; GShard, DeepSpeed-MoE). Every expert host ends the run when it is done."""

from __future__ import annotations

from collections.abc import Sequence

from controller.roles import Role, RoleCommand, RoleContext, RoleError, register
from topo.spec import HostSpec


def commands(ctx: RoleContext, hosts: Sequence[HostSpec]) -> list[RoleCommand]:
    m = ctx.cfg.moe
    experts = sorted(ctx.spec.hosts_of_kind("expert"), key=lambda h: h.rank)
    if [h.rank for h in experts] != list(range(m.hosts)):
        raise RoleError(f"role 'expert': moe.hosts = {m.hosts}, but the network has expert "
                        f"hosts of ranks {[h.rank for h in experts]} (set topo.hosts = "
                        f"{m.hosts})")
    addrs = ",".join(f"{h.ip}:{ctx.cfg.net.port}" for h in experts)
    return [RoleCommand(h.name, (ctx.python, "-m", "agents.moe.expert", "--run-dir",
                                 str(ctx.run_dir), "--host", str(h.rank), "--addrs", addrs,
                                 "--auth", "stdin"),
                        # The key of its link to every other expert host (agents.net.link).
                        links=tuple(("expert", f"e{h.rank}", f"e{j}")
                                    for j in range(m.hosts) if j != h.rank),
                        listens=(ctx.cfg.net.port,))
            for h in hosts]


ROLE = register(Role(
    name="expert",
    sections=("run", "moe"),
    host_kinds=("expert",),
    ends_run=True,  # the run is over when every expert host has run run.iterations steps
    commands=commands,
    phase=1,
))
