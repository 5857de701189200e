"""Runs one experiment end to end: the only place that owns OS state for a run.

``Experiment(cfg).run()`` makes the run directory, builds the star in Mininet,
sets the congestion control, starts the PS and the workers inside their hosts,
samples the bottleneck's ``tc -s`` counters every 100 ms, replays bandwidth
traces and applies rate shaping (``controller.driver``), shows progress, and
tears everything down in ``finally``. Ctrl-C (or SIGTERM) at any point still
leaves a loadable run directory (events converted to Parquet, ``links.parquet``,
``summary.json`` with ``interrupted: true``) and no Mininet state.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import pandas as pd

from agents import auth
from agents.control import control_path
from agents.core import config as cfgmod
from agents.core.events import EventLog, now_ns
from analysis.load import load_events
from controller import rundir
from controller.agent_env import agent_environment
from controller.background import BackgroundTraffic, commands
from controller.control import ControlServer
from controller.summary import summarize
from topo.build import StarNetwork
from topo.probe import probe
from topo.spec import LinkSpec, StarSpec

LINK_SAMPLE_S = 0.1


def star_spec(cfg: cfgmod.ExperimentConfig) -> StarSpec:
    """The topology a config asks for (pure: no root needed)."""
    n = cfg.net
    def bottleneck(rate_mbps: float) -> LinkSpec:
        return LinkSpec(rate_mbps=rate_mbps, queue_bytes=n.queue_bytes, delay_ms=n.delay_ms,
                        loss_pct=n.loss_pct)

    return StarSpec(workers=n.workers,
                    worker_link=LinkSpec(rate_mbps=n.worker_link_mbps),
                    bottleneck_up=bottleneck(n.bottleneck_mbps),
                    bottleneck_down=bottleneck(n.down_mbps),
                    offload=n.offload, extra_hosts=n.background_hosts,
                    ack_first=n.ack_first)


def plan_commands(cfg: cfgmod.ExperimentConfig, caps: dict[str, Any]) -> list[str]:
    """What ``gradbed run --dry-run`` prints: every qdisc command the build would run
    (the same builders ``StarNetwork`` uses) and every agent it would start. Pure: no
    root, nothing touched. Raises CapabilityError where the real run would."""
    from dataclasses import replace

    from topo import qdisc
    from topo.build import impairments, require_impairments
    from topo.netfilter import delay_queues, rule_commands

    spec = star_spec(cfg)
    sw = spec.switch_name
    mech = require_impairments(spec, caps)
    netem = bool(caps.get("netem"))
    out = [f"# star: {spec.workers} workers on {sw}, ps at {spec.ip('ps')}",
           f"# congestion control in every host: {cfg.net.congestion}",
           f"# delay by {mech['delay']}, loss by {mech['loss']}"]
    where = [("ps-eth0 (in ps)", "ps-eth0", spec.bottleneck_down, 1, False),
             (f"{sw}-eth{spec.switch_port('ps')}", f"{sw}-eth{spec.switch_port('ps')}",
              spec.bottleneck_up, 1, False)]
    for w in spec.worker_names() + spec.extra_host_names():
        where.append((f"{w}-eth0 (in {w})", f"{w}-eth0", spec.worker_link,
                      spec.sender_gso_segs(w), spec.ack_first))
        port = f"{sw}-eth{spec.switch_port(w)}"
        where.append((port, port, spec.worker_link, 1, False))
    for label, dev, link, segs, ack_first in where:
        out.append(f"# {label}")
        if not netem:  # delay and loss go to the receiving hosts (below)
            link = replace(link, delay_ms=0.0, loss_pct=0.0)
        for argv in qdisc.offload_commands(dev, spec.offload, segs) + qdisc.shaping_commands(
                dev, link, caps, offload=spec.offload, ack_first=ack_first):
            out.append("$ " + " ".join(argv))
    if not netem:
        for host, imps in impairments(spec).items():
            out.append(f"# delay and loss arriving at {host}")
            queues = delay_queues(imps)
            if queues:
                out.append("$ python -m topo.delayline "
                           + " ".join(f"--queue {q}:{d:g}" for q, d in queues)
                           + f"   # in {host}")
            for argv in rule_commands(imps):
                out.append("$ " + " ".join(argv) + f"   # in {host}")
    py = "python"
    out.append(f"$ {py} -m agents.ps --run-dir RUN   # in ps")
    for k in range(spec.workers):
        out.append(f"$ {py} -m agents.worker --run-dir RUN --worker {k} --ps {spec.ip('ps')} "
                   f"--port {cfg.net.ps_port}   # in w{k}")
    for c in commands(cfg, spec, Path("RUN")):
        out.append(f"$ {' '.join(c.argv)}   # in {c.host}, background traffic")
    if cfg.trace.up or cfg.trace.down:
        out.append(f"# then trace replay: up={cfg.trace.up or '-'} down={cfg.trace.down or '-'}"
                   f" every {cfg.trace.granularity_ms} ms with tc class change")
    if cfg.shaping.method != "none":
        out.append(f"# then link/N caps by {cfg.shaping.method}: "
                   f"{cfg.net.bottleneck_mbps / cfg.net.workers:g} Mbit/s per worker")
    return out


class LinkSampler(threading.Thread):
    """Samples the bottleneck's qdisc counters in both directions every 100 ms."""

    def __init__(self, net: StarNetwork, period_s: float = LINK_SAMPLE_S) -> None:
        super().__init__(name="link-sampler", daemon=True)
        self.net = net
        self.period_s = period_s
        self.rows: list[dict[str, Any]] = []
        self.stop_event = threading.Event()
        self.error: str | None = None

    def sample(self) -> None:
        for d in ("up", "down"):
            st = self.net.bottleneck_stats(d)  # type: ignore[arg-type]
            dev = self.net.bottleneck_dev(d)  # type: ignore[arg-type]
            self.rows.append({"ts_ns": now_ns(), "direction": d, "dev": dev,
                              "sent_bytes": st.sent_bytes, "sent_pkts": st.sent_pkts,
                              "drops": st.drops, "overlimits": st.overlimits,
                              "backlog_bytes": st.backlog_bytes,
                              "backlog_pkts": st.backlog_pkts,
                              "rate_mbps": self.net.rate_mbps(dev)})

    def run(self) -> None:
        next_t = time.monotonic()
        while not self.stop_event.is_set():
            try:
                self.sample()
            except Exception as e:  # the network is going away; keep what we have
                self.error = str(e)
                return
            next_t += self.period_s
            self.stop_event.wait(max(0.0, next_t - time.monotonic()))

    def frame(self) -> pd.DataFrame:
        return links_frame(list(self.rows))


LINK_COLUMNS = ["ts_ns", "direction", "dev", "sent_bytes", "sent_pkts", "drops", "overlimits",
                "backlog_bytes", "backlog_pkts", "rate_mbps"]


def links_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=LINK_COLUMNS)


class Experiment:
    def __init__(self, cfg: cfgmod.ExperimentConfig, out_root: Path = Path("runs"),
                 argv: list[str] | None = None, progress: bool = True,
                 quiet: bool = False) -> None:
        self.cfg = cfg
        self.out_root = out_root
        self.argv = argv
        self.progress = progress and not quiet
        self.quiet = quiet
        self.run_dir: Path | None = None
        self._logf: IO[str] | None = None
        self._bar: Any = None
        self._ps_state: dict[str, Any] = {"iter": -1, "done": False}
        self.driver: Any = None
        self.background: BackgroundTraffic | None = None
        # The run's master key lives in this process only; agents get theirs on stdin.
        self._master = auth.new_master()
        self._net: StarNetwork | None = None

    # -- logging --------------------------------------------------------------------

    def say(self, line: str) -> None:
        # Status lines (not the echoed tc commands) are shown live to the user too.
        if self.progress and not line.startswith("$ "):
            if self._bar is not None:
                self._bar.write(line, file=sys.stderr)
            else:
                print(line, file=sys.stderr, flush=True)
        if self._logf is not None:
            self._logf.write(f"{time.strftime('%H:%M:%S')} {line}\n")
            self._logf.flush()
            if line.startswith("$ ") and self.events is not None:
                self.events.emit("tc", cmd=line[2:])

    def _on_report(self, msg: dict[str, Any]) -> None:
        """Reports from agents over the control socket (runs on its thread)."""
        kind, node = msg.get("type"), msg.get("node")
        if node == "ps" and kind == "iter_done":
            self._ps_state["iter"] = int(msg["iter"])
            if self._bar is not None:
                post = {"workers": msg.get("workers")}
                if msg.get("accuracy") is not None:
                    self._ps_state["accuracy"] = msg["accuracy"]
                if "accuracy" in self._ps_state:
                    post["acc"] = f"{self._ps_state['accuracy']:.3f}"
                self._bar.set_postfix(post, refresh=False)
                self._bar.update(int(msg["iter"]) + 1 - self._bar.n)
        elif node == "ps" and kind == "ready":
            self._ps_state["ready"] = True
        elif node == "ps" and kind == "done":
            self._ps_state["done"] = True
            self._ps_state["reason"] = msg.get("reason", "")
        if self.driver is not None:
            self.driver.on_report(msg)

    # -- the run --------------------------------------------------------------------

    def run(self) -> Path:
        cfg = self.cfg
        started_ns = now_ns()
        t_start = time.monotonic()
        run_dir = rundir.create(self.out_root, cfg.run.name)
        self.run_dir = run_dir
        self._logf = open(run_dir / "run.log", "a", buffering=1, encoding="utf-8")
        self.events: EventLog | None = EventLog.for_node(run_dir, run_dir.name, "controller")
        caps = probe()
        rundir.write_atomic(run_dir / "config.toml", cfgmod.dumps(cfg))
        meta = rundir.meta(run_dir, caps, started_ns, self.argv)
        rundir.write_json(run_dir / "meta.json", meta)
        self.say(f"run {run_dir.name}: {cfg.net.workers} workers, "
                 f"{cfg.net.bottleneck_mbps} Mbit/s bottleneck, {cfg.workload.name}, "
                 f"compress={cfg.compress.name}")
        interrupted = False
        stop_reason = ""
        sampler: LinkSampler | None = None
        ctl = ControlServer(control_path(run_dir), self._on_report, self._control_key)
        old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        assert self.events is not None
        self.say("building the network")
        try:
            with StarNetwork(star_spec(cfg), log=self.say, caps=caps) as net:
                self._net = net  # its impairment record goes into meta.json at the end
                meta["impairment"] = net.impairment_record()
                rundir.write_json(run_dir / "meta.json", meta)
                # Time zero of the experiment proper: after any wait for the network lock.
                setup_s = time.monotonic() - t_start
                t_start = time.monotonic()
                self.events.emit("run_start", workers=cfg.net.workers, setup_s=setup_s)
                net.set_congestion_control(cfg.net.congestion)
                sampler = LinkSampler(net)
                sampler.start()
                from controller.driver import NetworkDriver

                self.driver = NetworkDriver(cfg, net, ctl, self.events, self.say)
                self.background = BackgroundTraffic(cfg, net.spec, run_dir, self.say)
                try:
                    stop_reason = self._run_agents(net, run_dir)
                finally:
                    self._stop_background()
        except KeyboardInterrupt:
            interrupted = True
            stop_reason = "interrupted"
        finally:
            # Finish writing whatever happens: a second Ctrl-C must not cut this short.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, old_term)
            try:
                if self.driver is not None:
                    self.driver.stop()
                if sampler is not None:
                    sampler.stop_event.set()
                    sampler.join(timeout=2)
                ctl.close()
                if self._bar is not None:
                    self._bar.close()
                self.events.emit("run_end", reason=stop_reason)
                self.events.close()
                self._finalize(run_dir, sampler, meta, time.monotonic() - t_start,
                               interrupted, stop_reason)
            finally:
                signal.signal(signal.SIGINT, signal.default_int_handler)
                if self._logf is not None:
                    self._logf.close()
        return run_dir

    def _control_key(self, node: str) -> bytes | None:
        """The key a control-socket peer must prove: agents of this run only."""
        known = node == "ps" or (node.startswith("w") and node[1:].isdigit()
                                 and int(node[1:]) < self.cfg.net.workers)
        return auth.node_key(self._master, node) if known else None

    def _start(self, net: StarNetwork, host: str, argv: list[str], run_dir: Path
               ) -> subprocess.Popen[Any]:
        log = open(run_dir / "logs" / f"{host}.log", "ab")
        env = agent_environment(os.environ, str(rundir.REPO_ROOT), self.cfg.run.allocator)
        self.say(f"start {host}: {' '.join(argv)}")
        # A new session: a terminal's Ctrl-C reaches only the controller, which then
        # stops the agents itself and keeps their last events. Its key goes down its
        # stdin, a pipe only we hold: the pipe stays open, and when this process dies
        # the agent sees EOF and ends too (agents.auth).
        p = net.popen(host, argv, stdin=subprocess.PIPE, stdout=log,
                      stderr=subprocess.STDOUT, cwd=str(rundir.REPO_ROOT), env=env,
                      start_new_session=True)
        assert p.stdin is not None
        p.stdin.write(auth.bundle_for(self._master, host).encode())
        p.stdin.flush()
        return p

    def _run_agents(self, net: StarNetwork, run_dir: Path) -> str:
        cfg = self.cfg
        py = sys.executable
        ps = self._start(net, "ps", [py, "-m", "agents.ps", "--run-dir", str(run_dir)], run_dir)
        deadline = time.monotonic() + 60
        while not self._ps_state.get("ready"):
            if ps.poll() is not None:
                raise RuntimeError(f"PS exited with status {ps.returncode} before it was "
                                   f"ready; see {run_dir / 'logs' / 'ps.log'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"PS not ready after 60 s; see {run_dir / 'logs/ps.log'}")
            time.sleep(0.05)
        workers = {}
        for k in range(cfg.net.workers):
            workers[k] = self._start(net, f"w{k}", [
                py, "-m", "agents.worker", "--run-dir", str(run_dir), "--worker", str(k),
                "--ps", net.ip("ps"), "--port", str(cfg.net.ps_port)], run_dir)
        if self.progress:
            from tqdm import tqdm

            self._bar = tqdm(total=cfg.run.iterations, desc=cfg.run.name, unit="it",
                             dynamic_ncols=True, file=sys.stderr)
        assert self.driver is not None
        self.driver.start()
        if self.background is not None:
            self.background.start(net)
        deadline = time.monotonic() + cfg.run.timeout_s
        reported: set[int] = set()
        while ps.poll() is None:
            if time.monotonic() > deadline:
                self.say(f"timeout after {cfg.run.timeout_s} s: stopping")
                return f"timeout after {cfg.run.timeout_s} s"
            for k, p in workers.items():
                if p.poll() not in (None, 0) and k not in reported:
                    reported.add(k)
                    self.say(f"w{k} exited with status {p.returncode}; "
                             f"see logs/w{k}.log")
            time.sleep(0.1)
        # The PS is done; give workers a moment to read its BYE and exit on their own.
        end = time.monotonic() + 10
        for p in workers.values():
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if ps.returncode != 0:
            return f"PS exited with status {ps.returncode}; see logs/ps.log"
        return str(self._ps_state.get("reason") or "completed")

    def _stop_background(self) -> None:
        """End the background flows and log one ``background`` event per host."""
        if self.background is None or not self.background.cmds:
            return
        for report in self.background.stop():  # bulk flows; a flowgen source logs its own
            assert self.events is not None
            self.events.emit("background", **report)
            if "error" in report:
                self.say(f"background {report['host']}: {report['error']}")
            else:
                self.say(f"background {report['host']}: {report['bytes'] / 1e6:.1f} MB, "
                         f"{report['mbps']:.1f} Mbit/s over {report['seconds']:.1f} s")

    def _finalize(self, run_dir: Path, sampler: LinkSampler | None, meta: dict[str, Any],
                  wall_s: float, interrupted: bool, stop_reason: str) -> None:
        rundir.convert_events(run_dir)
        links = sampler.frame() if sampler is not None else links_frame([])
        tmp = run_dir / ".links.parquet.tmp"
        links.to_parquet(tmp, index=False)
        os.replace(tmp, run_dir / "links.parquet")
        events = load_events(run_dir, allow_empty=True)
        summary = summarize(events, links, self.cfg.to_dict(), wall_s, interrupted, stop_reason)
        rundir.write_json(run_dir / "summary.json", summary)
        meta = {**meta, "ended_ns": now_ns(), "interrupted": interrupted,
                "stop_reason": stop_reason}
        if self._net is not None:
            # Torn down by now: the record holds what each delay line did, and whether
            # one died (its link then dropped every packet).
            meta["impairment"] = self._net.impairment_record()
            for host in meta["impairment"]["hosts"]:
                if host.get("delay_line_died"):
                    self.say(f"warning: the delay line in {host['host']} died "
                             f"({host['delay_line_died']}); its link dropped every packet")
        rundir.write_json(run_dir / "meta.json", meta)
        try:
            from analysis.report import write_report

            write_report([run_dir], run_dir / "report")
        except Exception as e:  # plots are a convenience; the data is what must survive
            self.say(f"warning: report not written: {e}")
            if not self.quiet:
                print(f"warning: report not written: {e}", file=sys.stderr)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
