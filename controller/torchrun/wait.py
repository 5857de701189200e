"""The wait of a ``gradbed torchrun`` run, and the stop reason that ends it: until every
host's torchrun has exited, one fails (naming the rank that failed first), one stalls
(``torchrun.stall_s``: naming a host that never reached rendezvous or
``init_process_group``, or stopped moving bytes), a server is lost, or the timeout.

A host's progress is the bytes its connections move (:mod:`.sockdiag`), and, until its
ranks reach ``init_process_group``, the CPU its processes use (importing torch is no
stall: :mod:`.busy`).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agents.core import config as cfgmod
from agents.core.events import now_ns
from controller.exit_status import failed_start_reason, timeout_reason
from controller.roles import RoleCommand
from controller.roles.torchrun import RankPlan, failure_time, rank_exit_codes
from controller.run import SERVER_GRACE_S, wait_lost
from controller.torchrun.busy import BusyClock, tree_cpu_s
from controller.torchrun.servers import SSH_FAILED, ServerWatch, failed_watch
from controller.torchrun.sockdiag import ConnSampler

FAILURE_SETTLE_S = 1.0
POLL_S = 0.1
#: How often the CPU time of the hosts that have not reached init_process_group is read
#: (one pass over /proc; .busy judges it per BUSY_WINDOW_S).
CPU_READ_S = 0.25

Procs = Sequence[tuple[RoleCommand, subprocess.Popen[Any]]]


class RanksWait:
    """One run's wait. plans: every host's ranks. sampler: its connections, started.
    where: the hosts of other servers -> their server, each watched by one of
    ``watches``. server_lost(): the loss of a server, or "". say: run.log's lines."""

    def __init__(self, cfg: cfgmod.ExperimentConfig, run_dir: Path,
                 plans: Mapping[str, RankPlan], sampler: ConnSampler,
                 where: Mapping[str, str], watches: Sequence[ServerWatch],
                 server_lost: Callable[[], str], say: Callable[[str], None]) -> None:
        self.cfg, self.run_dir, self.plans = cfg, run_dir, plans
        self.sampler, self.where, self.watches = sampler, where, watches
        self._server_lost, self.say = server_lost, say
        self.busy = BusyClock()
        self._cpu_read_ns = 0

    def __call__(self, procs: Procs) -> str:
        """The stop reason, once the run ends."""
        tr = self.cfg.torchrun
        deadline = time.monotonic() + self.cfg.run.timeout_s
        while True:
            if lost := self._server_lost():
                return self._stopping(lost)
            if any(p.poll() not in (None, 0) for _, p in procs):
                return self._lost_or(self._first_failure(procs), procs)
            if all(p.poll() is not None for _, p in procs):
                return "completed"
            if time.monotonic() > deadline:
                return timeout_reason(self.cfg.run.timeout_s)
            now = now_ns()
            self._watch_cpu(procs, now)
            # A server's watch that ended early sends no more samples: like a local
            # sampler that failed, it reads no bytes, and that is no stall.
            self.sampler.error = self.sampler.error or failed_watch(list(self.watches))
            running = [c.host for c, p in procs if p.poll() is None]
            # Peers of a rank that has not called init_process_group wait in theirs: while
            # one has not, only such ranks are judged, each once idle for stall_s. A
            # sampler that failed reads no bytes: that is no stall (its error is in the
            # summary's torchrun.sampler_error).
            late = [h for h in running if not self.reached_init(h)]
            stalled = [h for h in (late or running) if self.sampler.error is None
                       and (now - self._last_progress_ns(h)) / 1e9 > tr.stall_s]
            if stalled:
                # The host that stopped reading (its peers' bytes wait unread in its
                # sockets) is the stuck one, its peers wait on it; else the host idle
                # longest, which stopped first.
                sampler = self.sampler
                host = min(stalled, key=lambda h: (sampler.unread_bytes(h) == 0,
                                                   self._last_progress_ns(h)))
                return self._lost_or(self._stalled(host, tr.stall_s), procs)
            time.sleep(POLL_S)

    def _stopping(self, lost: str) -> str:
        self.say(f"{lost}: stopping")
        return lost

    def _lost_or(self, reason: str, procs: Procs) -> str:
        """``reason``, or the loss of a server when that is what ended the run: a server
        that dies takes its hosts' ssh sessions (status 255) and its watch with it, and
        its control connection may end a moment after them (a busy machine), by when
        the peers of its ranks may have failed too. Given SERVER_GRACE_S then."""
        signs = (any(p.poll() == SSH_FAILED for c, p in procs if c.host in self.where)
                 or any(w.failed for w in self.watches))
        lost = wait_lost(self._server_lost, SERVER_GRACE_S) if signs else ""
        return self._stopping(lost) if lost else reason

    def _watch_cpu(self, procs: Procs, now: int) -> None:
        """Feed the busy clock the CPU time of each host that has not reached
        init_process_group (its torchrun and ranks), at most every CPU_READ_S."""
        if now - self._cpu_read_ns < CPU_READ_S * 1e9:
            return
        self._cpu_read_ns = now
        late = {c.host: p.pid for c, p in procs
                if p.poll() is None and not self.reached_init(c.host)}
        roots = {h: pid for h, pid in late.items() if h not in self.where}
        if roots:  # once every rank trains, only bytes count
            for host, cpu_s in tree_cpu_s(roots).items():
                self.busy.update(host, cpu_s, now)
        # A host of another server: its watch's latest reading of the tree there.
        for w in self.watches:
            for host, (cpu_s, ts) in list(w.cpu.items()):
                if host in late:
                    self.busy.update(host, cpu_s, ts)

    def _last_progress_ns(self, host: str) -> int:
        """When ``host`` last moved a byte to another host, or, until its ranks reached
        init_process_group, last used CPU (importing torch is no stall: .busy)."""
        moved = self.sampler.progress[host][1]
        if self.reached_init(host):
            return moved
        return max(moved, self.busy.busy_since(host))

    def reached_init(self, host: str) -> bool:
        """Whether every rank of ``host`` opened its store connection (init_process_group):
        one client connection per rank besides torchrun's own."""
        return len(self.sampler.store_clients[host]) > self.cfg.torchrun.nproc_per_node

    def _first_failure(self, procs: Procs) -> str:
        """The stop reason naming the rank that failed first. Its peers fail right after
        it (gloo: connection closed by peer), often within one poll: after a short wait,
        the failure that torchrun's report dates first wins, and among those, a rank
        whose own exit code is not the peers' 1."""
        time.sleep(FAILURE_SETTLE_S)
        found = []
        for c, p in procs:
            if p.poll() in (None, 0):
                continue
            text = read_log(self.run_dir / "logs" / f"{c.host}.log")
            codes = rank_exit_codes(self.plans[c.host], p.returncode, text)
            for r, code in codes.items():
                if code not in (0, None):
                    found.append((failure_time(text, r), code == 1, r, code, c.host))
            if not any(code not in (0, None) for code in codes.values()):
                found.append(("~", True, self.plans[c.host].ranks[0], p.returncode, c.host))
        _, _, rank, code, host = min(found)
        return f"rank {rank} (host {host}) exited with status {code}; see logs/{host}.log"

    def _stalled(self, host: str, stall_s: float) -> str:
        named = f"host {host}"
        if host in self.where:
            named += f" on {self.where[host]}"  # its watch ran there
        plan = self.plans[host]
        ranks = ranks_text(plan)
        env = " ".join(f"{k}={v}" for k, v in sorted(plan.env.items())
                       if k.endswith("IFNAME") or k.startswith("NCCL"))
        master = f"{self.plans[next(iter(self.plans))].ip}:{self.cfg.torchrun.port}"
        if self.sampler.progress[host][0] == 0:
            return failed_start_reason(
                f"{ranks} ({named}) never reached rendezvous: no "
                    f"connection to another host in {stall_s:g} s (master {master}, {env}); "
                    f"see logs/{host}.log")
        if not self.reached_init(host):
            return failed_start_reason(
                f"{ranks} ({named}) never reached init_process_group: "
                    f"idle for {stall_s:g} s, no byte moved and no CPU used "
                    f"(torchrun.stall_s; master {master}, {env}); see logs/{host}.log")
        return (f"{ranks} ({named}) stalled: its connections moved no bytes "
                f"for {stall_s:g} s (torchrun.stall_s); see logs/{host}.log")


def ranks_text(plan: RankPlan) -> str:
    """A host's ranks as a line names them: ``rank 2`` or ``ranks [2, 3]``."""
    ranks = list(plan.ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def read_log(path: Path) -> str:
    """A host's log, or "" when it cannot be read."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
