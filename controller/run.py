"""Runs one experiment end to end: the only place that owns OS state for a run.

``Experiment(cfg).run()`` makes the run directory, builds the star in Mininet,
sets the congestion control, starts the PS and the workers inside their hosts,
samples the bottleneck's ``tc -s`` counters every 100 ms, replays bandwidth
traces and applies rate shaping (``controller.driver``), shows progress, and
tears everything down in ``finally``. Ctrl-C, SIGTERM or SIGHUP at any point (and
again during the teardown) still leaves a loadable run directory (events converted to
Parquet, ``links.parquet``, ``summary.json`` with ``interrupted: true`` and the signal in
``stop_reason``) and no Mininet state (``controller.signals``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agents.core import config as cfgmod
from agents.core.events import EventLog, now_ns
from agents.core.links import LINK_COLUMNS
from agents.net import auth
from agents.net.control import control_path
from controller import kernel_admission, rundir
from controller.agent_env import agent_environment
from controller.class_sampler import ClassSampler, class_sample_ms
from controller.control import ControlServer, pid_source
from controller.driver import check_driver
from controller.exit_status import FAILED_PREFIX, failed_start_reason, signal_reason, status_for
from controller.paths import resolve_paths
from controller.record import write_record, write_report
from controller.roles import RoleCommand, RoleContext
from controller.roles import plan_commands as role_commands
from controller.runlog import RunLog
from controller.runner import RoleRunner
from controller.sampler import PeriodicSampler
from controller.signals import Interrupted, StopSignals
from controller.warm import WarmStarter, warm_for_agents
from topo.build import Network
from topo.placement import LOCAL, servers_used
from topo.plan import build_plan, describe_impairments, describe_plan
from topo.probe import probe
from topo.shapes import shape_spec
from topo.shapes.star import star_spec
from topo.spec import NetSpec, SpecError

# pandas (with analysis.load and controller.summary) is imported when the run's tables are
# written, not at the start: the controller's own start is on every run's critical path.
if TYPE_CHECKING:  # Mininet Cluster Edition is imported only for a run over several servers
    import pandas as pd

    from controller.remote import RemoteAgents
    from controller.warm_remote import ServerWarms
    from topo.cluster import SshAccess

__all__ = ["Experiment", "LinkSampler", "links_frame", "plan_commands", "shape_spec",
           "star_spec"]

LINK_SAMPLE_S = 0.1


def check_spec(cfg: cfgmod.ExperimentConfig, spec: NetSpec) -> None:
    """Refuse a spec the run could not drive: the driver's checks (``check_driver``), and
    data-parallel workers that do not match ``net.workers`` (the PS waits for that many,
    numbered 0..N-1)."""
    check_driver(cfg, spec)
    ranks = sorted(h.rank for h in spec.hosts if h.role == "worker")
    if ranks and ranks != list(range(cfg.net.workers)):
        raise SpecError(f"the {spec.shape} places the worker role on ranks {ranks}; "
                        f"net.workers = {cfg.net.workers} needs ranks 0..{cfg.net.workers - 1}")


def plan_commands(cfg: cfgmod.ExperimentConfig, caps: dict[str, Any],
                  spec: NetSpec | None = None) -> list[str]:
    """What ``gradbed run --dry-run`` prints: every command the builder would run
    (``topo.plan.build_plan``, the very list ``Network`` executes) and every process the
    roles would start. Pure: no root, nothing touched. Raises CapabilityError, SpecError
    or RoleError where the real run would."""
    spec = spec or shape_spec(cfg)
    check_spec(cfg, spec)
    out = describe_plan(spec, build_plan(spec, caps))
    out.insert(1, f"# congestion control in every host: {cfg.net.congestion}")
    out += describe_impairments(spec, caps)
    ctx = RoleContext(cfg, spec, Path("RUN"))
    for role, c in role_commands(ctx):
        out += kernel_admission.describe(c.host, c.listens, cfg.guard)
        out.append(f"$ {' '.join(c.argv)}   # in {c.host}, role {role.name}")
    for p in spec.places():
        if p.point.trace:
            out.append(f"# then trace replay: {p.point.name}={p.point.trace} on {p.dev} "
                       f"every {cfg.trace.granularity_ms} ms with tc class change")
    if cfg.shaping.method != "none":
        out.append(f"# then link/N caps by {cfg.shaping.method}: "
                   f"{cfg.net.bottleneck_mbps / cfg.net.workers:g} Mbit/s per worker")
    return out


class LinkSampler(PeriodicSampler):
    """Samples the qdisc counters of the spec's watched shaping points (a star's or
    dumbbell's ``up`` and ``down`` bottleneck) and of every point that replays a trace,
    every 100 ms; ``direction`` is the point's name."""

    def __init__(self, net: Network, period_s: float = LINK_SAMPLE_S) -> None:
        super().__init__("link-sampler", period_s)
        self.net = net
        spec = net.spec
        traced = [p.point.name for p in spec.places() if p.point.trace]
        self.points = list(dict.fromkeys([*spec.watch, *traced]))
        self.rows: list[dict[str, Any]] = []

    def sample(self) -> None:
        for d in self.points:
            st = self.net.point_stats(d)
            dev = self.net.point_dev(d)
            self.rows.append({"ts_ns": now_ns(), "direction": d, "dev": dev,
                              "sent_bytes": st.sent_bytes, "sent_pkts": st.sent_pkts,
                              "drops": st.drops, "overlimits": st.overlimits,
                              "backlog_bytes": st.backlog_bytes,
                              "backlog_pkts": st.backlog_pkts,
                              "rate_mbps": self.net.rate_mbps(dev)})

    def frame(self) -> pd.DataFrame:
        return links_frame(list(self.rows))


def links_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """The link samples as ``links.parquet`` holds them (agents/core/links.py's columns)."""
    import pandas as pd

    return pd.DataFrame(rows, columns=list(LINK_COLUMNS))


# How long a delay line that died on another server waits for that server's own watch
# (its control connection) to say the server is gone: a dead server takes both.
SERVER_GRACE_S = 3.0


def network_broken(server_lost: Callable[[], str], net: Network, grace_s: float) -> str:
    """Why the network stops the run now, or "": a server lost, or a delay line that died
    (its link drops every packet: what the run goes on to measure would be a cut link,
    not the configured one). The line names the host and, on another server, the
    server; the stop reason is ``failed: ...`` (exit status 1). A delay line that died
    with its server leaves the reason to that server's watch, given ``grace_s``."""
    if lost := server_lost():
        return lost
    dead = net.dead_delay_line()
    if not dead:
        return ""
    return wait_lost(server_lost, grace_s) or f"{FAILED_PREFIX} {dead}"


def wait_lost(server_lost: Callable[[], str], grace_s: float) -> str:
    """What ``server_lost()`` says once it names a lost server, within ``grace_s``; ""
    if it names none by then."""
    deadline = time.monotonic() + grace_s
    while not (lost := server_lost()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return lost


class Experiment:
    #: Whether this kind of run starts gradbed's agents, which fork from one warm
    #: interpreter (controller.warm); a run of the user's own processes does not.
    forks_agents = True

    def __init__(self, cfg: cfgmod.ExperimentConfig, out_root: Path = Path("runs"),
                 argv: list[str] | None = None, progress: bool = True,
                 quiet: bool = False, spec: NetSpec | None = None,
                 report: bool = True, notes: Sequence[str] = (),
                 warm: WarmStarter | None = None) -> None:
        # Relative file names in a config built in Python are the caller's; the agents run
        # elsewhere (controller.paths).
        self.cfg = resolve_paths(cfg, Path.cwd())
        self.out_root = out_root
        self.argv = argv
        self.notes = tuple(notes)  # warnings from loading the config, repeated in run.log
        self.progress = progress and not quiet
        self.quiet = quiet
        # False: no report/index.html (a sweep writes one report for all its runs).
        self.report = report
        # The agents' warm process when the caller started it early (``gradbed run`` does,
        # before its checks); the run then owns it and closes it at its teardown. None: the
        # run starts its own (controller.warm.warm_for_agents).
        self._warm = warm
        self.run_dir: Path | None = None
        self.driver: Any = None
        self.runner: RoleRunner | None = None
        self._stops = StopSignals()
        self.log = RunLog(self.progress, lambda: self._stops.hung_up)
        self.events: EventLog | None = None
        self._started = False  # every agent came up: a failure from here on is no failed start
        self.stop_reason = ""
        # A bad shape or trace placement is refused here, before any directory exists.
        # ``spec``: a network of the caller's own (gradbed's Python API) instead of the
        # config's shape; the config still gives everything else.
        self.spec: NetSpec = spec if spec is not None else shape_spec(self.cfg)
        check_spec(cfg, self.spec)
        # A spec placed over several servers is built there (topo.cluster) and its agents
        # run there (controller.remote); None: everything on this machine.
        self._access: SshAccess | None = None
        if servers_used(self.spec) != [LOCAL]:
            from topo.cluster import SshAccess

            self._access = SshAccess.from_config(self.cfg.cluster)
        self._remote: RemoteAgents | None = None
        self._ctl: ControlServer | None = None
        # The run's master key lives in this process only; agents get theirs on stdin.
        self._master = auth.new_master()
        self._net: Network | None = None

    # -- logging --------------------------------------------------------------------

    def say(self, line: str) -> None:
        """A line of the run (``controller.runlog``): into run.log, and on the terminal
        but for an echoed command."""
        self.log.say(line)

    def _on_report(self, msg: dict[str, Any]) -> None:
        """Reports from agents over the control socket, and its own refusals (runs on the
        control server's thread)."""
        kind, node = msg.get("type"), msg.get("node")
        if kind == "control_refused":
            # What keyless peers tried at the control socket, aggregated by its server.
            if self.events is not None:
                self.events.emit("refused", source=msg.get("source"), reason=msg.get("reason"),
                                 count=msg.get("count"), example=msg.get("error"))
            return
        if self.runner is not None:
            self.runner.on_report(msg)
        progress = self.runner.progress_nodes if self.runner is not None else set()
        if node in progress and kind == "iter_done":
            self.log.progress(msg)
        if self.driver is not None:
            self.driver.on_report(msg)

    # -- the run --------------------------------------------------------------------

    def run(self) -> Path:
        """Run the experiment; returns its directory. Whatever stops it (an error before or
        after the start, Ctrl-C, SIGTERM, SIGHUP), the directory loads and its summary says
        why; :attr:`exit_status` is then the command's status (``controller.exit_status``).
        """
        with self._stops:
            run_dir = rundir.create(self.out_root, self.cfg.run.name)
            self.run_dir = run_dir
            rundir.mark_active(run_dir)
            try:
                return self._run(run_dir)
            except BaseException as e:
                self._stops.disarm()
                self.stop_reason = self.stop_reason or self._stop_reason(e)
                rundir.finish(run_dir, self.stop_reason, error=f"{type(e).__name__}: {e}",
                              cfg_toml=cfgmod.dumps(self.cfg), argv=self.argv)
                raise
            finally:
                self._stops.disarm()
                # The registry entry stays until the directory is complete, so that
                # ``gradbed cleanup`` can finish a run whose summary could not be written.
                if rundir.complete(run_dir):
                    rundir.mark_done(run_dir)
                rundir.hand_over(run_dir)

    @property
    def exit_status(self) -> int:
        """The exit status ``gradbed run`` gives this run (``controller.exit_status``)."""
        return status_for(self.stop_reason)

    def _stop_reason(self, e: BaseException) -> str:
        """The summary's ``stop_reason`` for a run that an exception ended."""
        if isinstance(e, Interrupted):
            return signal_reason(e.signum)
        if isinstance(e, KeyboardInterrupt):
            return "interrupted"
        if lost := self._server_lost():
            return self._stopping(lost)  # what failed after that failed because of it
        error = str(e) or type(e).__name__
        return f"failed: {error}" if self._started else failed_start_reason(error)

    def _run(self, run_dir: Path) -> Path:
        """The run's phases: its record opened, the network built and the agents run in it
        (:meth:`_in_network`), everything stopped (:meth:`_teardown`), the record
        finished (:meth:`_finalize`), the last files closed (:meth:`_close_last`)."""
        t_start = time.monotonic()
        caps, meta = self._open_record(run_dir)
        parts = _Parts(meta, t_start)
        interrupted = False
        stop_reason = ""
        self.say("building the network")
        try:
            stop_reason = self._in_network(run_dir, caps, parts)
        except KeyboardInterrupt as e:
            interrupted = True
            stop_reason = self._stop_reason(e)
        except Exception as e:
            stop_reason = self._stop_reason(e)
            self.say(f"{stop_reason}: {type(e).__name__}: {e}")
            raise
        finally:
            self._stops.disarm()  # a second Ctrl-C, or SIGTERM after it, must not cut this short
            self.stop_reason = stop_reason
            try:
                self._teardown(run_dir, parts, stop_reason)
                self._finalize(run_dir, parts.sampler, parts.meta,
                               time.monotonic() - parts.t_start, interrupted, stop_reason)
            finally:
                self._close_last(run_dir, parts.starter)
        return run_dir

    def _open_record(self, run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """The run directory's first files, run.log and the controller's events opened;
        the kernel's capabilities and the run's meta.json as written."""
        started_ns = now_ns()
        # Room for the summary is kept from the start, and a provisional one says, until the
        # real one replaces it, that the run never finished.
        rundir.reserve_room(run_dir)
        rundir.write_summary(run_dir, rundir.provisional_summary())
        self.events = EventLog.for_node(run_dir, run_dir.name, "controller")
        self.log.open(run_dir / "run.log", self.events)
        caps = probe()
        rundir.write_atomic(run_dir / "config.toml", cfgmod.dumps(self.cfg))
        meta = rundir.meta(run_dir, caps, started_ns, self.argv)
        rundir.write_json(run_dir / "meta.json", meta)
        # The network as built: hosts, roles, every shaping point and where it sits.
        rundir.write_json(run_dir / "network.json", self.spec.describe())
        self.say(f"run {run_dir.name}: {self.headline()}")
        for note in self.notes:
            self.say(note)
        return caps, meta

    def _in_network(self, run_dir: Path, caps: dict[str, Any], parts: _Parts) -> str:
        """The control socket and the warm processes, then the network with the run in it;
        the stop reason. The samplers' last reads come before the network goes."""
        cfg = self.cfg
        parts.ctl = self._ctl = ControlServer(control_path(run_dir), self._on_report,
                                              self._control_key, guard=cfg.guard)
        # Imports torch once while the network is built (or since the command began);
        # each agent of this machine's hosts is a fork of it.
        parts.starter = starter = self._warm or self._warm_starter(run_dir)
        # And one on each other server, over ssh, for that server's agents.
        if self._access is not None and self.forks_agents:
            from controller.remote import server_warms

            parts.warms = server_warms(self.spec, self._access, run_dir.name, cfg, self.say)
        with Network(self.spec, log=self.say, caps=caps, access=self._access,
                     spawner=starter.popen_in_netns if starter else None) as net:
            self._net = net  # its impairment record goes into meta.json at the end
            self._network_up(net, parts)
            from controller.driver import NetworkDriver

            assert self.events is not None
            self.driver = NetworkDriver(cfg, net, parts.ctl, self.events, self.say)
            ctx = RoleContext(cfg, net.spec, run_dir, sys.executable)
            self.runner = RoleRunner(ctx, lambda c: self._start(net, c, run_dir),
                                     self.say, self.events)
            try:
                return self._run_agents(net, self.runner)
            finally:
                # Teardown from here: a signal now is noted, never raised, so the
                # network's teardown and the summary run to the end.
                self._stops.disarm()
                self.runner.stop_sessions()
                # The samplers' last reads while the shaped points still stand.
                self._finish_samplers(parts.sampler, parts.class_sampler)

    def _network_up(self, net: Network, parts: _Parts) -> None:
        """Once the network stands: its record (and the other servers') in meta.json, time
        zero of the run, the congestion control, the samplers started."""
        assert self.run_dir is not None and self.events is not None
        cfg = self.cfg
        parts.meta["impairment"] = net.impairment_record()
        if net.cluster is not None:
            # The run directories and control connections on the other servers.
            from controller.remote import RemoteAgents

            assert parts.ctl is not None
            remote = RemoteAgents(net.cluster, self.run_dir, parts.ctl.path, self.say,
                                  parts.warms)
            remote.start(net.cluster.clocks, parts.meta, self.run_dir / "meta.json")
            self._remote = remote
        rundir.write_json(self.run_dir / "meta.json", parts.meta)
        # Time zero of the experiment proper: after any wait for the network lock.
        setup_s = time.monotonic() - parts.t_start
        parts.t_start = time.monotonic()
        self.events.emit("run_start", workers=cfg.net.workers, setup_s=setup_s)
        net.set_congestion_control(cfg.net.congestion)
        parts.sampler = LinkSampler(net)
        parts.sampler.start()
        if (period_ms := class_sample_ms(cfg, net.cluster is not None)) > 0:
            parts.class_sampler = ClassSampler(net, period_ms / 1000)
            parts.class_sampler.start()

    def _teardown(self, run_dir: Path, parts: _Parts, stop_reason: str) -> None:
        """Once the network is down, whatever ended the run: the driver and samplers
        stopped, the servers' files gathered, the control socket and warm processes
        closed, leftovers removed, the controller's events ended."""
        if self.driver is not None:
            self.driver.stop()
        self._finish_samplers(parts.sampler, parts.class_sampler)
        if (class_sampler := parts.class_sampler) is not None:
            rundir.best_effort(lambda: class_sampler.write(run_dir / "classes.parquet"),
                               "classes.parquet", self.say)
        rundir.best_effort(lambda: self._gather_remote(parts.meta), "gathering from the "
                           "servers", self.say)
        if parts.ctl is not None:
            parts.ctl.close()
        if (starter := parts.starter) is not None:
            # Waited for after the tables: its exit overlaps them.
            rundir.best_effort(starter.hang_up, "warm process", self.say)
        if parts.warms is not None:
            for line in parts.warms.close():
                self.say(line)
        # Also when a signal cut the control server's start short (ctl unset).
        rundir.best_effort(lambda: rundir.remove_leftovers(run_dir), "cleanup", self.say)
        self.log.close_bar()
        events = self.events
        assert events is not None
        rundir.best_effort(lambda: events.emit("run_end", reason=stop_reason),
                           "run_end event", self.say)
        rundir.best_effort(events.close, "controller events", self.say)

    def _close_last(self, run_dir: Path, starter: WarmStarter | None) -> None:
        """The warm process ended (its log kept when it could not preload) and run.log
        closed: after everything else, even a failed record."""
        if starter is not None:
            warm_log = run_dir / "warm.log"
            rundir.best_effort(lambda: starter.close(keep_log=warm_log), "warm process",
                               self.say)
            if starter.log_kept is not None:
                self.say(f"the warm process could not preload the agents' imports "
                         f"(each agent imports them itself); it said why in {warm_log}")
        rundir.best_effort(self.log.close, "run.log", lambda _: None)

    def _warm_starter(self, run_dir: Path) -> WarmStarter | None:
        """The warm process this run's local processes fork from (started now, so that it
        imports while the network is built), or None: each starts a fresh interpreter."""
        if not self.forks_agents:
            return None
        return warm_for_agents(self.cfg.run.allocator, self.cfg.workload.name)

    def headline(self) -> str:
        """What the run's first status line says about it."""
        cfg = self.cfg
        return (f"{self.spec.shape}, {cfg.net.workers} workers, {cfg.net.bottleneck_mbps} "
                f"Mbit/s bottleneck, {cfg.workload.name}, compress={cfg.compress.name}")

    def _control_key(self, node: str) -> bytes | None:
        """The key a control-socket peer must prove: the agents of this run's roles only."""
        known = any(h.name == node and h.role for h in self.spec.hosts)
        return auth.node_key(self._master, node) if known else None

    def _gather_remote(self, meta: dict[str, Any]) -> None:
        """Once the network is down: every server's events and files into the run
        directory, on this machine's clock; the offsets and any lost server in meta.json."""
        remote, self._remote = self._remote, None
        if remote is not None:
            cluster = self._net.cluster if self._net is not None else None
            meta["cluster"] = remote.finish(cluster.clocks if cluster is not None else {})

    def _server_lost(self) -> str:
        return self._remote.lost() if self._remote is not None else ""

    def _stopping(self, lost: str) -> str:
        """A lost server as the stop reason, said in run.log."""
        self.say(f"{lost}: stopping")
        return lost

    def _start(self, net: Network, cmd: RoleCommand, run_dir: Path
               ) -> subprocess.Popen[Any]:
        path = cmd.log_path(run_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        env = agent_environment(os.environ, str(rundir.REPO_ROOT), self.cfg.run.allocator)
        # Before it listens: a flood's surplus is the kernel's to drop, not the agent's.
        kernel_admission.install(net, cmd.host, cmd.listens, self.cfg.guard, self.say)
        self.say(f"start {cmd.host}: {' '.join(cmd.argv)}")
        argv = list(cmd.argv)
        if self._remote is not None and self._remote.is_remote(cmd.host):
            argv = self._remote.argv_for(cmd.host, argv, env, os.environ)
        with open(path, "ab") as log:  # the child keeps its own copy
            # A new session: a terminal's Ctrl-C reaches only the controller, which then
            # stops the agents itself and keeps their last events. Its key goes down its
            # stdin, a pipe only we hold: the pipe stays open, and when this process dies
            # the agent sees EOF and ends too (agents.net.auth).
            p = net.popen(cmd.host, argv, stdin=subprocess.PIPE, stdout=log,
                          stderr=subprocess.STDOUT, cwd=str(rundir.REPO_ROOT), env=env,
                          start_new_session=True)
        if self._ctl is not None:
            # Its control connection comes from its own process (SO_PEERCRED), or from the
            # ssh that forwards its server's: either keeps a slot of its own in a flood.
            forwarder = (self._remote.control_pid(cmd.host)
                         if self._remote is not None and self._remote.is_remote(cmd.host)
                         else p.pid)
            self._ctl.expect(pid_source(forwarder, os.getuid()))
        assert p.stdin is not None
        p.stdin.write(auth.bundle_for(self._master, cmd.host, cmd.links).encode())
        p.stdin.flush()
        return p

    def _run_agents(self, net: Network, runner: RoleRunner) -> str:
        """Every host's role, in phases; the driver; the session roles; then the wait
        for the roles that end the run."""
        cfg = self.cfg
        runner.start_agents()
        self._started = True
        self.log.start_bar(cfg.run.iterations, cfg.run.name)
        assert self.driver is not None
        self.driver.start()
        runner.start_sessions(net)
        reason = runner.wait(cfg.run.timeout_s, watch=lambda: network_broken(
            self._server_lost, net, SERVER_GRACE_S if self._remote is not None else 0.0))
        # A server that died takes its agents with it: that is the reason, not theirs. Its
        # ssh sessions may end before its control connection does (a busy machine), and the
        # runner then named one of its agents first.
        if (lost := self._server_lost()) and lost != reason:
            return self._stopping(lost)
        return lost or reason

    def _finish_samplers(self, *samplers: PeriodicSampler | None) -> None:
        """Each sampler's last read and stop (idempotent); a read that failed is noted in
        run.log, once: its samples end there, and so may the windows they cover."""
        for s in samplers:
            if s is None or s.stop_event.is_set():
                continue
            s.finish()
            if s.error is not None:
                self.say(f"warning: {s.name} stopped early: {s.error}")

    def _finalize(self, run_dir: Path, sampler: LinkSampler | None, meta: dict[str, Any],
                  wall_s: float, interrupted: bool, stop_reason: str) -> None:
        """The run's record (:meth:`_write_record`), then its report."""
        self._write_record(run_dir, sampler, meta, wall_s, interrupted, stop_reason)
        if self.report:
            write_report(run_dir, self.say, self.quiet)

    def _write_record(self, run_dir: Path, sampler: LinkSampler | None, meta: dict[str, Any],
                      wall_s: float, interrupted: bool, stop_reason: str) -> None:
        """``controller.record.write_record``: tables, summary, meta.json, timelines."""
        links = sampler.frame() if sampler is not None else links_frame([])
        impairment = self._net.impairment_record() if self._net is not None else None
        write_record(run_dir, self.cfg, links, meta, impairment, wall_s, interrupted,
                     stop_reason, self.say)


@dataclass
class _Parts:
    """What a run has started so far, for its teardown (None: not started)."""

    meta: dict[str, Any]  # meta.json as last written
    t_start: float  # monotonic: the command's start, then time zero once the network stands
    sampler: LinkSampler | None = None
    class_sampler: ClassSampler | None = None
    ctl: ControlServer | None = None
    starter: WarmStarter | None = None
    warms: ServerWarms | None = None
