"""A ``gradbed torchrun`` run: :class:`controller.run.Experiment` (the network, its driver,
trace replay, link and class samplers, the run directory) with the torchrun role on every
training host, and what only such a run needs around it:

- each host's torchrun starts with the variables of :mod:`controller.roles.torchrun`, as the user who ran sudo
  (``setpriv``; never as root), in the directory gradbed was started from;
- the ranks' connections are sampled with sock_diag from the start (:mod:`.sockdiag`);
- rank 0's output is shown live; a host whose torchrun fails ends the run naming the rank;
  a host whose connections move no bytes for ``torchrun.stall_s`` ends it too (one that
  never connected is named as never reaching rendezvous / ``init_process_group``): the
  wait and its stop reasons are :mod:`.wait`;
- at the end: ``tcp.parquet`` (every sample of every connection), per-rank exit codes,
  the bytes proof (:mod:`.proof`), all in ``summary.json``'s ``torchrun`` section, and
  the variables and interpreter in ``meta.json``.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import pandas as pd

from agents.core import config as cfgmod
from controller import run_as, rundir
from controller.roles import RoleCommand
from controller.roles.torchrun import (
    HOST_ENV,
    RankPlan,
    admission_rules,
    check_gpus,
    check_script,
    check_shaping,
    rank_exit_codes,
    rank_plans,
    run_env,
    torchrun_spec,
    training_hosts,
)
from controller.run import Experiment
from controller.runner import RoleRunner
from controller.torchrun import proof
from controller.torchrun.servers import (
    RankServers,
    ServerUser,
    ServerWatch,
    forwarded_env,
    invoking_user_name,
    server_argv,
    start_watches,
)
from controller.torchrun.sockdiag import ConnSampler, interface_bytes
from controller.torchrun.stop import stop_trees
from controller.torchrun.wait import RanksWait, ranks_text, read_log
from controller.warm import WarmProcess, WarmStarter
from topo.build import Network
from topo.shapes import shape_spec
from topo.spec import NetSpec

STOP_GRACE_S = 5.0


class TorchrunExperiment(Experiment):
    """``TorchrunExperiment(cfg).run()``: the config's shape with ranks on its training
    hosts; ``cfg.torchrun.script`` must name the script (absolute or from the cwd)."""

    # No gradbed agent runs: the ranks are torchrun's own fresh interpreters, with the
    # user's interpreter and environment. Only torchrun's agents may fork (_warm_starter).
    forks_agents = False

    def __init__(self, cfg: cfgmod.ExperimentConfig, out_root: Path = Path("runs"),
                 argv: list[str] | None = None, progress: bool = True, quiet: bool = False,
                 spec: NetSpec | None = None, gpus: int = 0, report: bool = True) -> None:
        script = check_script(cfg.torchrun.script)
        check_shaping(cfg)
        python = cfg.torchrun.python or sys.executable
        cfg = cfgmod.from_dict({**cfg.to_dict(), "torchrun": {
            **cfg.torchrun.__dict__, "script": str(script), "python": python}})
        spec = torchrun_spec(spec if spec is not None else shape_spec(cfg))
        check_gpus(cfg, len(training_hosts(spec)), gpus)
        super().__init__(cfg, out_root, argv, progress, quiet, spec, report=report)
        self.cwd = Path.cwd()
        self.plans: dict[str, RankPlan] = {}
        self.sampler: ConnSampler | None = None
        self.result: dict[str, Any] = {}
        # The training hosts of other servers (None: all here), their users there, and the
        # watch on each of those servers (controller.torchrun.servers).
        self._servers: RankServers | None = None
        self._users: dict[str, ServerUser | None] = {}
        self._watches: list[ServerWatch] = []
        self.forked: dict[str, bool] = {}  # per host: its torchrun a fork of the warm process

    def _warm_starter(self, run_dir: Path) -> WarmStarter | None:
        """One process that imports torch while the network is built; each host's torchrun
        agent is a fork of it (controller.warm) instead of an interpreter that imports torch
        (about 3 s of CPU per host, all at once) before it starts its ranks. The ranks are
        torchrun's own fresh interpreters either way. Under sudo the warm process runs as
        the invoking user (setpriv, with that user's variables), so its forks and their
        ranks do too, as a fresh start through setpriv would.

        None where a fork could not stand for the command: another interpreter
        (torchrun.python), GRADBED_WARM=0, or NCCL. Each NCCL host gets its own
        ``CUDA_VISIBLE_DEVICES`` and NCCL variables, and a fork stands for a fresh start
        only for variables that nothing reads while torch loads (``free_env``): a CUDA
        build's import loads the CUDA libraries, whose reading of those variables was
        never checked (that needs a GPU per emulated host), and a fork of a process that
        had touched CUDA fails in CUDA ("Cannot re-initialize CUDA in forked subprocess").
        A NCCL run loses only each agent's import: its ranks are fresh either way."""
        tr = self.cfg.torchrun
        if (os.environ.get("GRADBED_WARM", "1") == "0" or tr.python != sys.executable
                or tr.backend == "nccl"):
            return None
        user = run_as.invoking()
        return WarmStarter({**os.environ, **run_env(run_dir / "logs" / "ranks"),
                            **(user.env() if user is not None else {})},
                           free_env=HOST_ENV, user=user)

    def headline(self) -> str:
        tr = self.cfg.torchrun
        hosts = training_hosts(self.spec)
        return (f"torchrun {Path(tr.script).name} on {len(hosts)} hosts of the "
                f"{self.spec.shape} ({hosts[0].name}..{hosts[-1].name}), "
                f"{tr.nproc_per_node} per host, {tr.backend}")

    # -- starting a host's torchrun ---------------------------------------------------

    def _start(self, net: Network, cmd: RoleCommand, run_dir: Path
               ) -> subprocess.Popen[Any]:
        if not self.plans:
            self.plans = self._plans(net, run_dir)
        plan = self.plans[cmd.host]
        if self._servers is not None and cmd.host in self._servers.where:
            return self._start_remote(net, cmd, plan, run_dir)
        log_dir = run_dir / "logs" / "ranks" / cmd.host
        log_dir.mkdir(parents=True, exist_ok=True)
        rundir.hand_over(log_dir.parent)
        # gradbed.ddp.instrument in a rank (run as the invoking user) adds its own events file.
        (run_dir / "events").mkdir(exist_ok=True)
        rundir.hand_over(run_dir / "events", recursive=False)
        env = {**os.environ, **plan.env}
        argv = list(cmd.argv)
        user = run_as.invoking()
        if user is not None:  # under sudo: the ranks run as the user, never as root
            env |= user.env()
            argv = [*user.argv(), *argv]  # or a fork of the user's warm process
        path = cmd.log_path(run_dir)
        # The terminal gets one short line; run.log the whole command with its variables.
        self.say(f"start {cmd.host}: torchrun node {plan.node_rank}, {ranks_text(plan)}")
        self.log.note(f"$ {' '.join(f'{k}={v}' for k, v in plan.env.items())} "
                      f"{' '.join(argv)}  # in {cmd.host}")
        with open(path, "ab") as log:
            proc = net.popen(cmd.host, argv, stdin=subprocess.DEVNULL, stdout=log,
                             stderr=subprocess.STDOUT, cwd=str(self.cwd), env=env,
                             start_new_session=True)
        self.forked[cmd.host] = isinstance(proc, WarmProcess)
        return proc

    def _plans(self, net: Network, run_dir: Path) -> dict[str, RankPlan]:
        """Every host's plan; a host of another server names that server's run directory
        (its log folders, error files and events are gathered from there at the end)."""
        def plans(log_dir: Path) -> dict[str, RankPlan]:
            return {p.host: p for p in rank_plans(self.cfg, net.spec, self.cfg.torchrun.python,
                                                  Path(self.cfg.torchrun.script), log_dir)}

        out = plans(run_dir / "logs" / "ranks")
        if self._servers is not None:
            there = plans(self._servers.log_dir())
            out |= {h: there[h] for h in self._servers.where}
        return out

    def _start_remote(self, net: Network, cmd: RoleCommand, plan: RankPlan, run_dir: Path
                      ) -> subprocess.Popen[Any]:
        """``cmd``'s torchrun on its host's server (controller.torchrun.servers); its
        output comes back over ssh into ``logs/HOST.log`` as it is written."""
        assert self._servers is not None
        server = self._servers.where[cmd.host]
        argv = server_argv(plan, str(self.cwd), self._servers.pid_file(cmd.host),
                           self._users.get(server), forwarded_env(os.environ))
        self.say(f"start {cmd.host}: torchrun node {plan.node_rank}, {ranks_text(plan)}, "
                 f"on {server}")
        self.log.note(f"$ {shlex.join(argv)}  # in {cmd.host}, on {server}")
        path = cmd.log_path(run_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as log:
            return net.popen(cmd.host, argv, stdin=subprocess.DEVNULL, stdout=log,
                             stderr=subprocess.STDOUT, cwd=str(self.cwd),
                             start_new_session=True)

    def _open_servers(self, net: Network, hosts: list[str]) -> None:
        """For the hosts of other servers: start their servers' watches, and check and
        prepare those servers (TorchrunError naming what one lacks)."""
        remote = self._remote
        if remote is None or net.cluster is None:
            return
        cluster = net.cluster
        where = {h: remote.where[h] for h in hosts if remote.is_remote(h)}
        self._servers = RankServers(where, lambda s: cluster.access.argv(cluster.ips[s]),
                                    remote.remote_dir, self.say)
        assert self.sampler is not None
        # The watches start while the servers are checked (each waits on its own ssh);
        # _run_agents waits for them before any rank starts.
        self._watches = start_watches(
            self._servers, cluster, {h: (net.pid(h), _intf(net.spec, h)) for h in where},
            self.sampler, self.say)
        tr = self.cfg.torchrun
        self._users = self._servers.prepare(
            {"torchrun.script": tr.script, "torchrun.python": tr.python, "cwd": str(self.cwd)},
            invoking_user_name())

    # -- the wait -----------------------------------------------------------------------

    def _run_agents(self, net: Network, runner: RoleRunner) -> str:
        assert self.run_dir is not None
        hosts = [h.name for h in training_hosts(net.spec)]
        here = [h for h in hosts if self._remote is None or not self._remote.is_remote(h)]
        # Open before any rank starts: the destroy broadcast of every connection is seen.
        self.sampler = ConnSampler({h: (net.pid(h), net.ip(h)) for h in here},
                                   store_port=self.cfg.torchrun.port,
                                   fed={h: net.ip(h) for h in hosts if h not in here})
        self.sampler.start()
        tail: _Tail | None = None
        # Unset until the wait returns: a run that Ctrl-C or an error cut short is no
        # "completed" run, so its missing bytes are no bypass to report.
        reason = ""
        try:
            self._open_servers(net, hosts)
            self._admit_training_hosts_only(net)
            # Every watch samples before any rank starts: no destroy message is missed.
            for w in self._watches:
                w.wait_ready()
            self.sampler.mark_start()
            runner.start_agents()
            if self.progress:
                tail = _Tail(runner.procs[0][1].log_path(self.run_dir), sys.stdout)
                tail.start()
            assert self.driver is not None
            self.driver.start()
            runner.start_sessions(net)
            wait = RanksWait(self.cfg, self.run_dir, self.plans, self.sampler,
                             self._servers.where if self._servers is not None else {},
                             self._watches, self._server_lost, self.say)
            reason = wait([(c, p) for _, c, p in runner.procs])
            return reason
        finally:
            # Trace replay ends with the ranks, before the network goes (the base class
            # stops the driver only after the teardown).
            if self.driver is not None:
                self.driver.stop()
            stopped = self._stop_ranks(runner)
            if tail is not None:
                tail.stop()
            self._collect(net, runner, hosts, reason, stopped)

    def _admit_training_hosts_only(self, net: Network) -> None:
        """Only the training hosts may open connections to a training host: its stores
        and gloo's listeners are torch's (roles.torchrun.admission_rules)."""
        from concurrent.futures import ThreadPoolExecutor

        rules = admission_rules(net.spec, self.cfg.guard)
        if not rules:
            self.say("no admission rules at the training hosts (guard.kernel_admission = false)")
            return
        for host, cmds in rules.items():
            for c in cmds:
                self.say(f"$ {shlex.join(c)}  # in {host}")
        # One shell per host, all hosts at once: on another server each command would
        # cost an ssh round trip (a second each on a loaded machine), one after another.
        with ThreadPoolExecutor(max_workers=len(rules)) as pool:
            for f in [pool.submit(net.run, host, ["sh", "-c", " && ".join(map(shlex.join, cmds))])
                      for host, cmds in rules.items()]:
                f.result()

    def _stop_ranks(self, runner: RoleRunner) -> set[str]:
        """Every torchrun still running and every process under it stopped
        (controller.torchrun.stop): on another server there, over ssh (what runs here for
        such a host is only its ssh), then here. Returns the hosts stopped so."""
        stopped = {c.host for _, c, p in runner.procs if p.poll() is None}
        if self._servers is not None:
            lost = self._remote.lost_servers() if self._remote is not None else set()
            for line in self._servers.stop(STOP_GRACE_S, skip=lost):
                self.say(f"ranks stopped on {line}")

        def reap() -> None:
            for _, _, p in runner.procs:
                p.poll()

        pids = [p.pid for _, _, p in runner.procs if p.poll() is None]
        if pids:
            stop_trees(pids, STOP_GRACE_S, reap)
        return stopped

    # -- the record ---------------------------------------------------------------------

    def _collect(self, net: Network, runner: RoleRunner, hosts: list[str],
                 reason: str, stopped: set[str]) -> None:
        """Before the network goes: interface counters, the last sock_diag messages,
        tcp.parquet, exit codes and the bytes proof (into ``self.result``). A rank of a
        host gradbed ``stopped`` that torchrun's report does not name ended by the
        SIGTERM it was sent (torchrun's own status then says nothing about it)."""
        assert self.run_dir is not None and self.sampler is not None
        time.sleep(0.2)  # the kernel's last destroy messages
        iface: dict[str, tuple[int, int]] = {}
        remote = self._servers.where if self._servers is not None else {}
        for h in hosts:
            if h in remote:
                continue
            try:
                iface[h] = interface_bytes(net.pid(h), str(_intf(net.spec, h)))
            except OSError as e:
                self.say(f"warning: {h}: interface counters not read: {e}")
        # Each server's watch reads its last destroy messages and counters as it ends.
        for w in self._watches:
            w.stop()
            iface |= w.iface
            if w.error and self.sampler.error is None:
                self.sampler.error = w.error
        self.sampler.stop()
        rows = pd.DataFrame(self.sampler.rows)
        rows.to_parquet(self.run_dir / "tcp.parquet", index=False)
        per_host = proof.host_bytes(self.sampler.final_connections(),
                                    {h: net.ip(h) for h in hosts}, self.cfg.torchrun.port)
        codes: dict[str, int | None] = {}
        for _, c, p in runner.procs:
            log = read_log(self.run_dir / "logs" / f"{c.host}.log")
            status = -signal.SIGTERM if c.host in stopped else p.returncode
            for r, code in rank_exit_codes(self.plans[c.host], status, log).items():
                codes[str(r)] = code
        bypass = proof.bypass_cause(
            per_host, {h: tx for h, (_, tx) in iface.items()},
            {h: p.ranks for h, p in self.plans.items()}) if reason == "completed" else None
        if bypass:
            self.say(f"failed: {bypass}")
        self.result = {
            "script": self.cfg.torchrun.script, "python": self.cfg.torchrun.python,
            "hosts": {p.host: {"ip": p.ip, "node_rank": p.node_rank, "ranks": list(p.ranks)}
                      for p in self.plans.values()},
            "exit_codes": codes, "bypass": bypass,
            "sampler_error": self.sampler.error,
            "bytes": proof.bytes_summary(per_host, iface, self.cfg.torchrun.nproc_per_node),
        }

    def _write_record(self, run_dir: Path, sampler: Any, meta: dict[str, Any],
                      wall_s: float, interrupted: bool, stop_reason: str) -> None:
        """The record of every run, with the summary's and meta.json's ``torchrun``
        sections (the report, written after, reads the hosts' table there)."""
        if self.result.get("bypass"):
            stop_reason = f"failed: {self.result['bypass']}"
            self.stop_reason = stop_reason  # the exit status follows it (status 1)
        super()._write_record(run_dir, sampler, meta, wall_s, interrupted, stop_reason)
        self.result["exit_status"] = self.exit_status
        self.result["points_busy_utilization"] = points_busy(run_dir / "links.parquet")
        summary = json.loads((run_dir / "summary.json").read_text())
        summary["torchrun"] = self.result
        summary["agent_limited"], summary["agent_limited_why"] = agent_limited(
            run_dir, self.spec, sum(len(p.ranks) for p in self.plans.values()),
            int(self.cfg.run.warmup_iterations))
        rundir.write_json(run_dir / "summary.json", summary)
        meta_now = json.loads((run_dir / "meta.json").read_text())
        meta_now["torchrun"] = {
            "python": self.cfg.torchrun.python, "script": self.cfg.torchrun.script,
            "cwd": str(self.cwd),
            "run_as": list(rundir.invoking_user() or (os.geteuid(), os.getegid())),
            "hosts": {p.host: {"argv": list(p.argv), "env": dict(p.env),
                               "forked": self.forked.get(p.host, False)}
                      for p in self.plans.values()}}
        rundir.write_json(run_dir / "meta.json", meta_now)


def points_busy(links_path: Path) -> dict[str, float | None]:
    """Each sampled shaping point's busy-span utilisation (analysis.metrics defines it)."""
    import math

    from analysis.metrics import busy_utilization

    try:
        links = pd.read_parquet(links_path)
    except (OSError, ValueError):
        return {}
    links["t_s"] = (links["ts_ns"] - links["ts_ns"].min()) / 1e9 if len(links) else 0.0
    out: dict[str, float | None] = {}
    for point in sorted(links["direction"].unique()) if len(links) else []:
        u = busy_utilization(links, str(point))
        out[str(point)] = None if math.isnan(u) else round(u, 4)
    return out


def agent_limited(run_dir: Path, spec: NetSpec, world: int, warmup: int
                  ) -> tuple[bool | None, str]:
    """The run's ``agent_limited`` (controller.summary.torchrun_agent_limited) from its
    events (an instrumented script's buckets) and HTB class samples."""
    from analysis.load import load_events
    from controller.summary import read_classes, torchrun_agent_limited

    return torchrun_agent_limited(load_events(run_dir, allow_empty=True),
                                  read_classes(run_dir / "classes.parquet"), world,
                                  hop_delay_ms(spec), warmup)


def hop_delay_ms(spec: NetSpec) -> float:
    """The one-way delay of the slowest path between two training hosts: the largest delay
    of a training host's uplink plus the largest of one's downlink (a ring's step waits
    on its slowest hop)."""
    names = set(spec.point_names())

    def worst(side: str) -> float:
        return max((spec.point(f"{h.name}.{side}").link.delay_ms
                    for h in training_hosts(spec) if f"{h.name}.{side}" in names),
                   default=0.0)

    return worst("up") + worst("down")


def _intf(spec: NetSpec, host: str) -> str:
    from controller.roles.torchrun import interface

    return interface(spec, host)


class _Tail(threading.Thread):
    """Shows a growing log file live (rank 0's host) on ``out``."""

    def __init__(self, path: Path, out: IO[str]) -> None:
        super().__init__(name="rank0-tail", daemon=True)
        self.path, self.out = path, out
        self._done = threading.Event()

    def run(self) -> None:
        pos = 0
        while True:
            stopping = self._done.wait(0.2)
            try:
                with open(self.path, "rb") as f:
                    f.seek(pos)
                    chunk = f.read()
            except OSError:
                chunk = b""
            if chunk:
                pos += len(chunk)
                self.out.write(chunk.decode(errors="replace"))
                self.out.flush()
            if stopping:
                return

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=2)
