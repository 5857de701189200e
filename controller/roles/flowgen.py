"""The flow generator role: background (cross) traffic from the background hosts to their
peers (``controller/background.py``: long iperf3 flows, flows drawn from a flow-size CDF by
``agents/traffic/flowgen.py``, or a replayed capture). It never ends a run: its flows stop when
the run does, and each host's totals become a ``background`` event."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from agents.core.events import EventLog
from controller.background import BackgroundTraffic, commands
from controller.roles import Role, RoleCommand, RoleContext, Starter, register
from topo.spec import HostSpec


def _commands(ctx: RoleContext, hosts: Sequence[HostSpec]) -> list[RoleCommand]:
    names = {h.name for h in hosts}
    return [RoleCommand(c.host, c.argv, c.log)
            for c in commands(ctx.cfg, ctx.spec, ctx.run_dir, ctx.python)
            if c.role == "server" or c.host in names]


class FlowgenSession:
    """Starts the flows ``background.start_s`` after the agents (servers before clients),
    and on :meth:`stop` interrupts them and logs one ``background`` event per host."""

    def __init__(self, ctx: RoleContext, say: Callable[[str], None], events: EventLog,
                 start: Starter | None = None) -> None:
        """``start``: the runner's start of a watched agent, for the flowgen sources (their
        heartbeats); iperf3 and tcpreplay are not ours and send none."""
        self.traffic = BackgroundTraffic(
            ctx.cfg, ctx.spec, ctx.run_dir, say, ctx.python,
            start_agent=None if start is None else
            lambda c: start(RoleCommand(c.host, c.argv, c.log)))
        self.say = say
        self.events = events

    def start(self, net: Any) -> None:
        self.traffic.start(net)

    def stop(self) -> None:
        if not self.traffic.cmds:
            return
        for report in self.traffic.stop():  # bulk flows; a flowgen source logs its own
            self.events.emit("background", **report)
            if "error" in report:
                self.say(f"background {report['host']}: {report['error']}")
            else:
                self.say(f"background {report['host']}: {report['bytes'] / 1e6:.1f} MB, "
                         f"{report['mbps']:.1f} Mbit/s over {report['seconds']:.1f} s")


ROLE = register(Role(
    name="flowgen",
    sections=("background",),
    host_kinds=("background",),
    ends_run=False,
    commands=_commands,
    phase=2,
    session=FlowgenSession,
))
