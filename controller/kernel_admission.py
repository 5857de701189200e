"""The kernel's half of admission at every listening agent: netfilter rules, in the
listening host's own network namespace, that drop a source's surplus connection attempts
before they reach the agent.

The agents' own admission (:mod:`agents.net.admission`) bounds what a keyless peer may
hold, but every connection it refuses still costs the agent an ``accept``, a ``close`` and
a refusal note in Python, on a core the run needs, and a flooder reopens each one as soon
as it is closed. 20,000 slow connections from one background host kept the data-parallel
PS accepting and closing about 5,000 connections a second and slowed the run to 1.36-1.46x
its clean median iteration time (docs/robustness.md). In the kernel the surplus costs a
packet each, and no one reopens what was dropped: a dropped SYN is retried by the flooder's
own kernel after 1 s, 3 s, 7 s..., so a flood backs itself off.

Per listening port, one rule from the same ``[guard]`` field as the agents' own rate bound
(the agents keep all their limits: defence in depth, and the only bound on a loopback
run, which has no namespace of its own): a SYN beyond ``max_connects_per_source_per_s`` a
second from one address (``hashlimit``, a token bucket of that size per source) is
dropped. Legitimate agents retry at most 20 times a second (a stage or an expert host
every 50 ms, a worker every 200 ms), so they never meet it.

No count of a source's open connections (``connlimit``): it needs connection tracking in
the namespace, which then looks up every packet of the run, data included, and cost the
PS 7 % of its 1 Gbit/s upload window (``wire_utilization``: 0.605 against 0.654 without,
four runs each, alternating; with the token bucket alone 0.657 against 0.594). The
bucket alone holds the flood to 64 new connections a second per source, which the agents'
own per-source bound refuses for under 1 % of a core.

Only SYNs to the agent's port are matched: what the agent opens itself, and every packet of
an admitted connection, pass. The rules go with the host's namespace when the network is
torn down; ``guard.kernel_admission = false`` leaves them out (a kernel without
``xt_hashlimit``), and the agents' limits then hold alone.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from typing import Any

from agents.core.guard_config import GuardConfig

#: Every rule carries it, so ``iptables -S`` in a host says whose they are.
RULE_COMMENT = "gradbed-admission"


def rules(ports: Sequence[int], guard: GuardConfig) -> list[list[str]]:
    """The iptables commands (argv lists, in order) that guard ``ports`` of one host; none
    when ``guard.kernel_admission`` is off or nothing listens. Pure."""
    if not guard.kernel_admission:
        return []
    per_s = guard.max_connects_per_source_per_s
    return [["iptables", "-w", "-A", "INPUT", "-p", "tcp", "--syn", "--dport", str(port),
             "-m", "hashlimit", "--hashlimit-above", f"{per_s}/sec",
             "--hashlimit-burst", str(per_s), "--hashlimit-mode", "srcip",
             "--hashlimit-name", f"gb{port}",
             "-m", "comment", "--comment", RULE_COMMENT, "-j", "DROP"] for port in ports]


def describe(host: str, ports: Sequence[int], guard: GuardConfig) -> list[str]:
    """The dry run's and run.log's lines for ``host``'s rules."""
    return [f"$ {shlex.join(r)}   # in {host}" for r in rules(ports, guard)]


def install(net: Any, host: str, ports: Sequence[int], guard: GuardConfig,
            say: Callable[[str], None]) -> None:
    """Install :func:`rules` in ``host`` (``net.run``: its namespace, on its server) before
    its agent listens. Raises RuntimeError naming the host, the field to turn them off and
    iptables' own words when the kernel refuses one."""
    cmds = rules(ports, guard)
    if not cmds:
        return
    for line in describe(host, ports, guard):
        say(line)
    try:
        net.run(host, ["sh", "-c", " && ".join(map(shlex.join, cmds))])
    except Exception as e:  # CalledProcessError, or an ssh failure on another server
        said = getattr(e, "stderr", "") or str(e)
        raise RuntimeError(
            f"{host}: the kernel refused gradbed's admission rules for port(s) "
            f"{', '.join(map(str, ports))} ({said.strip()[-300:]}); a kernel without "
            "xt_hashlimit: set guard.kernel_admission = false") from e
