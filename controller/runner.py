"""Starts every host's role and decides when the run is over.

The runner knows no role by name: it places ``controller.roles.get(host.role)`` on every
host of the network spec (``controller.roles.placement``), starts the process roles phase
by phase (a phase whose role says ``wait_ready`` must report ``ready`` over the control
socket before the next starts), hands the session roles (background traffic) their start
once the agents and the network driver run, and ends the run when every process of every
role that ``ends_run`` has exited. The others then get ``GRACE_S`` to exit on their own
(workers read the PS's BYE); the network's teardown stops whatever is left.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import Any

from agents.core.events import EventLog
from controller.exit_status import timeout_reason
from controller.roles import Role, RoleCommand, RoleContext, RoleSession, require_end

READY_TIMEOUT_S = 60.0
GRACE_S = 10.0
POLL_S = 0.1
# How long a deciding process's error exit waits for a signalled death among its peers
# before it is named the cause: a killed stage's neighbours fail because it died, yet their
# exits may be seen first (the warm process reaps its children in its own order, and a
# loaded machine may not run it for a while). Longer: a run whose PS fails on its own
# stops that much later.
SETTLE_S = 1.0

Starter = Callable[[RoleCommand], "subprocess.Popen[Any]"]


class RoleRunner:
    """``start_agents``, then ``start_sessions``, then ``wait``; ``stop_sessions`` in the
    caller's ``finally``. ``on_report`` takes the control socket's reports (any thread)."""

    def __init__(self, ctx: RoleContext, start: Starter, say: Callable[[str], None],
                 events: EventLog) -> None:
        self.ctx = ctx
        self.start = start
        self.say = say
        self.events = events
        self.placed = require_end(ctx.spec)
        self.progress_nodes = {h.name for role, hosts in self.placed if role.reports_progress
                               for h in hosts}
        self.ready: set[str] = set()
        # When each agent was last heard on the control channel (its heartbeats).
        self.heard_s: dict[str, float] = {}
        self.done_reasons: dict[str, str] = {}
        self._failed_since: float | None = None  # a deciding process's error exit first seen
        self._declared: set[int] = set()  # pids of the processes declared lost
        self.procs: list[tuple[Role, RoleCommand, subprocess.Popen[Any]]] = []
        self.sessions: list[RoleSession] = []

    def on_report(self, msg: dict[str, Any]) -> None:
        node, kind = str(msg.get("node", "")), msg.get("type")
        if node:
            self.heard_s[node] = time.monotonic()  # a heartbeat, or any other report
        if kind == "ready":
            self.ready.add(node)
        elif kind == "done":
            self.done_reasons[node] = str(msg.get("reason", ""))

    # -- start -----------------------------------------------------------------------

    def start_agents(self) -> None:
        """Start every process role, phase by phase."""
        phases = sorted({role.phase for role, _ in self.placed if role.session is None})
        for phase in phases:
            waiting = []
            for role, hosts in self.placed:
                if role.phase != phase or role.session is not None:
                    continue
                for cmd in role.commands(self.ctx, hosts):
                    proc = self.start(cmd)
                    self.procs.append((role, cmd, proc))
                    if role.wait_ready:
                        waiting.append((cmd, proc))
            self._wait_ready(waiting)

    def _wait_ready(self, waiting: list[tuple[RoleCommand, subprocess.Popen[Any]]]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for cmd, proc in waiting:
            log = cmd.log_path(self.ctx.run_dir)
            while cmd.host not in self.ready:
                if proc.poll() is not None:
                    raise RuntimeError(f"{cmd.host} exited with status {proc.returncode} "
                                       f"before it was ready; see {log}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{cmd.host} not ready after {READY_TIMEOUT_S:g} s; "
                                       f"see {log}")
                time.sleep(0.05)

    def start_sessions(self, net: Any) -> None:
        for role, _ in self.placed:
            if role.session is not None:
                session = role.session(self.ctx, self.say, self.events, self._watched(role))
                self.sessions.append(session)
                session.start(net)

    def _watched(self, role: Role) -> Callable[[RoleCommand], subprocess.Popen[Any]]:
        """A session's start of one of its agents: started as every agent is, and watched
        like the runner's own (its heartbeats; a role that does not end the run is let go
        when it is lost, and the run goes on)."""
        def start(cmd: RoleCommand) -> subprocess.Popen[Any]:
            proc = self.start(cmd)
            self.procs.append((role, cmd, proc))
            return proc
        return start

    def stop_sessions(self) -> None:
        sessions, self.sessions = self.sessions, []
        for s in sessions:
            s.stop()

    # -- the end ---------------------------------------------------------------------

    def wait(self, timeout_s: float, watch: Callable[[], str] | None = None) -> str:
        """Block until every ``ends_run`` process has exited, or ``timeout_s``, or an agent
        is lost (:meth:`_lost`); say so once for any other process that fails meanwhile.
        ``watch``: polled too; a non-empty answer (a server lost) ends the wait with it as
        the stop reason.
        Returns the stop reason."""
        enders = [(r, c, p) for r, c, p in self.procs if r.ends_run]
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for _, _, p in enders):
            if watch is not None and (why := watch()):
                self.say(f"{why}: stopping")
                return why
            if time.monotonic() > deadline:
                self.say(f"{timeout_reason(timeout_s)}: stopping")
                return timeout_reason(timeout_s)
            lost = self._lost()
            if lost:
                return lost
            self._note_failed_others()
            time.sleep(POLL_S)
        end = time.monotonic() + GRACE_S
        for _, _, p in (x for x in self.procs if not x[0].ends_run):
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        failed = self._failed_enders(settle=False)
        if failed:
            return failed
        reasons = [self.done_reasons.get(c.host, "") for _, c, _ in enders]
        return next((r for r in reasons if r), "completed")

    def _lost(self) -> str:
        """The stop reason when an agent was lost just now, else "". An agent that sent no
        heartbeat for ``run.stall_timeout_s`` is hung: it is killed, so that what follows
        is what follows its death. A process of a role that ends the run and that failed
        (exited non-zero, or was killed) ends the run at once, naming it: its peers
        would otherwise wait for it until ``run.timeout_s``. Any other role's death is
        its peers' business (a worker's: the PS's, under ``run.on_agent_death``)."""
        stall_s = self.ctx.cfg.run.stall_timeout_s
        now = time.monotonic()
        for role, c, p in self.procs:
            heard = self.heard_s.get(c.host)
            if p.poll() is None and heard is not None and now - heard > stall_s:
                why = (f"{c.host} lost: no heartbeat for {now - heard:.1f} s "
                       f"(run.stall_timeout_s = {stall_s:g})")
                self._declare(role, c, why)
                self._declared.add(p.pid)
                p.kill()
                p.wait()
                if role.ends_run:
                    return why
        return self._failed_enders(settle=True)

    def _note_failed_others(self) -> None:
        """A process of a role that does not end the run failed (a killed flow generator
        source, a worker that crashed): declared lost once, ``peers decide``, and the run
        goes on. Its session may have started it after the wait began, so ``procs`` is
        read anew."""
        for role, c, p in self.procs:
            if not role.ends_run and p.poll() not in (None, 0) and p.pid not in self._declared:
                self._declared.add(p.pid)
                self._declare(role, c, f"{c.host} exited with status {p.returncode}; "
                                       f"see {c.log or f'logs/{c.host}.log'}")

    def _failed_enders(self, settle: bool) -> str:
        """The stop reason when a process of a role that ends the run failed, else "".
        Several at once (a stage's death fails its neighbours): the one a signal ended,
        the cause, is named before those that exited with an error of their own; while
        only error exits are seen, ``settle`` waits ``SETTLE_S`` for such a death."""
        failed = [(role, c, p) for role, c, p in self.procs
                  if role.ends_run and p.poll() not in (None, 0)]
        if not failed:
            self._failed_since = None
            return ""
        killed = [f for f in failed if (f[2].returncode or 0) < 0]
        now = time.monotonic()
        if self._failed_since is None:
            self._failed_since = now
        if settle and not killed and now - self._failed_since < SETTLE_S:
            return ""
        role, c, p = (killed or failed)[0]
        why = f"{c.host} exited with status {p.returncode}; see {c.log or f'logs/{c.host}.log'}"
        self._declare(role, c, why)
        return why

    def _declare(self, role: Role, c: RoleCommand, why: str) -> None:
        action = "stop" if role.ends_run else "peers decide"
        self.say(f"agent lost: {why}: {'stopping' if role.ends_run else 'going on'}")
        self.events.emit("agent_lost", host=c.host, role=c.agent or role.name, reason=why,
                         action=action)
        self.heard_s.pop(c.host, None)
