"""``gradbed run CONFIG --cli``: the config's network up, and Mininet's CLI on it.

For poking around the way Mininet users do (``w0 ping ps``, ``ps tc -s qdisc``,
``w0 iperf3 -c ps``): the network is built exactly as a run builds it (same spec, same
plan, congestion control set), but no role is started. Leaving the CLI (``exit``, Ctrl-D,
or the end of its standard input) tears the network down.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import IO

from agents.core.config import ExperimentConfig
from controller.run import check_spec
from topo.build import Network
from topo.shapes import shape_spec
from topo.spec import NetSpec


def banner(spec: NetSpec) -> list[str]:
    """What the CLI prints first: the hosts and the shaping points."""
    lines = [f"gradbed: {spec.shape} up, no roles started; exit or Ctrl-D tears it down"]
    for h in spec.hosts:
        lines.append(f"  host {h.name:<7} {h.ip:<12} kind {h.kind}, role {h.role or '-'}")
    for p in spec.places():
        link = p.point.link
        rate = "unshaped" if link.rate_mbps is None else f"{link.rate_mbps:g} Mbit/s"
        lines.append(f"  point {p.point.name:<10} {p.dev} ({p.host or 'root'}): {rate}"
                     + (f", trace {p.point.trace}" if p.point.trace else ""))
    return lines


def open_cli(cfg: ExperimentConfig, spec: NetSpec | None = None, *,
             stdin: IO[str] | None = None, say: Callable[[str], None] | None = None) -> None:
    """Build ``spec`` (the config's shape when None) and run Mininet's CLI on it until
    it exits; the network is torn down whatever happens."""
    spec = spec if spec is not None else shape_spec(cfg)
    check_spec(cfg, spec)
    with Network(spec, log=say) as net:
        net.set_congestion_control(cfg.net.congestion)
        from mininet.cli import CLI
        from mininet.log import setLogLevel

        print("\n".join(banner(spec)), flush=True)
        setLogLevel("output")  # the CLI prints its commands' output at this level
        try:
            CLI(net.mininet, stdin=stdin if stdin is not None else sys.stdin)
        finally:
            setLogLevel("error")
