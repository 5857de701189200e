"""The data-parallel worker role (``agents/dp/worker.py``): trains on its shard, sends
compressed gradients to the one PS of the network, applies the weights it gets back. It is
told its host's packet size (``gso_segs``), which its drain rate source needs."""

from __future__ import annotations

from collections.abc import Sequence

from controller.roles import Role, RoleCommand, RoleContext, register, the_host
from topo.spec import HostSpec


def commands(ctx: RoleContext, hosts: Sequence[HostSpec]) -> list[RoleCommand]:
    ps = the_host(ctx.spec, "ps", "worker")
    return [RoleCommand(h.name, (ctx.python, "-m", "agents.dp.worker", "--run-dir",
                                 str(ctx.run_dir), "--worker", str(h.rank), "--ps", ps.ip,
                                 "--port", str(ctx.cfg.net.port),
                                 "--gso-segs", str(h.gso_segs)))
            for h in hosts]


ROLE = register(Role(
    name="worker",
    sections=("run", "net", "workload", "compress", "adaptive", "shaping"),
    host_kinds=("worker",),
    ends_run=False,  # a worker that dies is the PS's business (run.on_worker_death)
    commands=commands,
    phase=1,
))
