"""A ``gradbed torchrun`` run's training hosts on other servers (``topo.cluster``): what
the controller does on this machine for a host here, done on the host's server over the
run's shared ssh connection.

- **Checks and files** (:func:`check_script`, :meth:`RankServers.prepare`): before any
  rank starts, each server must have the script, the interpreter and the folder gradbed
  was started from, at the same paths, and the invoking user (who ran sudo), by name;
  anything missing is refused naming the server and the path or user. The ranks' log
  folders are made in the run's directory on that server (``controller.remote``) and
  handed to that user (by the server's own uid and gid for that name).
- **Starting** (:func:`server_argv`, pure): torchrun runs in the host's namespace there,
  in the same folder, with the plan's variables, as that user (``setpriv``), its pid
  written to a file so that it can be stopped.
- **Watching** (:class:`ServerWatch`): ``controller.torchrun.host_sampler`` runs on the
  server, in each of its training hosts' namespaces, and streams sock_diag rows, the
  torchrun trees' CPU time and, at the end, the interface counters; the rows go into the
  run's :class:`~controller.torchrun.sockdiag.ConnSampler` on this machine's clock.
- **Stopping** (:meth:`RankServers.stop`): ``controller.torchrun.stop`` on the server
  kills each torchrun's tree there.
- **Files back**: the rank logs and error files are in the server's run directory, which
  ``controller.remote`` gathers into the run directory at the end; torchrun's own output
  (which names the first failing rank) arrives live over ssh into ``logs/HOST.log``.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from controller.roles.torchrun import RankPlan, TorchrunError
from controller.run_as import RunAs, invoking
from controller.torchrun import host_sampler
from controller.torchrun.host_sampler import WatchedHost
from controller.torchrun.sockdiag import ConnSampler
from topo import clocks
from topo.cluster import REPO, Cluster, on_each

#: Variables of the controller's environment that the ranks on another server get too
#: (besides the plan's and the user's): gradbed's own and the usual knobs of torch, its
#: collectives and its thread pools. The rest of this machine's environment (its PATH,
#: terminal, sudo's variables) stays here; a server's ranks get that server's own.
FORWARDED_PREFIXES = ("GRADBED_", "TORCH", "NCCL_", "GLOO_", "OMP_", "MKL_", "CUDA_")
FORWARDED_NAMES = ("PYTHONPATH",)
#: Where each server's torchrun pids are kept, in the run's directory there (removed by
#: the stop, never gathered into the run directory).
PID_DIR = "torchrun-pids"
READY_TIMEOUT_S = 60.0
SSH_TIMEOUT_S = 60.0
MISSING_EXIT = 3


#: The invoking user as one server knows it (the same name, that server's ids).
ServerUser = RunAs


def forwarded_env(env: Mapping[str, str]) -> dict[str, str]:
    """What of ``env`` (the controller's) a rank on another server gets (pure)."""
    return {k: v for k, v in env.items()
            if k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES}


def server_argv(plan: RankPlan, cwd: str, pid_file: str, user: ServerUser | None,
                forwarded: Mapping[str, str]) -> list[str]:
    """The command a server runs in the host's namespace for ``plan`` (pure): write its
    pid to ``pid_file``, then, in ``cwd`` with the variables, as ``user`` (None: as the
    ssh user), the plan's torchrun. ``exec`` keeps one pid from the shell to torchrun."""
    env = {**forwarded, **plan.env}
    run_as: list[str] = []
    if user is not None:
        env |= user.env()
        run_as = user.argv()
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', pid_file, "env", "-C", cwd,
            *(f"{k}={v}" for k, v in sorted(env.items())), *run_as, *plan.argv]


def check_script(paths: Mapping[str, str], user: str, make_dirs: Sequence[str],
                 user_dirs: Sequence[str]) -> str:
    """The shell script that checks a server (pure): each of ``paths`` (what -> path; a
    folder for ``cwd``, a command for ``torchrun.python``, a file otherwise) exists
    there, and ``user`` ("" for none) is known there (it prints ``uid gid home``); then
    it makes ``make_dirs`` and gives ``user_dirs`` to that user. A failure prints
    ``missing WHAT`` and exits :data:`MISSING_EXIT`."""
    lines = ["set -e"]
    for what, path in paths.items():
        # The interpreter may be a name on the PATH (--python python3), as it may here.
        check = (f"command -v {shlex.quote(path)} >/dev/null" if what == "torchrun.python"
                 else f"test {'-d' if what == 'cwd' else '-f'} {shlex.quote(path)}")
        lines.append(f"{check} || "
                     f"{{ echo {shlex.quote('missing ' + what)}; exit {MISSING_EXIT}; }}")
    if user:
        lines.append(f"u=$(getent passwd {shlex.quote(user)}) || "
                     f"{{ echo {shlex.quote('missing user')}; exit {MISSING_EXIT}; }}")
        lines.append('echo "$u" | cut -d: -f3,4,6 | tr : " "')
    if make_dirs:
        lines.append(f"mkdir -p {' '.join(shlex.quote(d) for d in make_dirs)}")
    if user and user_dirs:
        lines.append(f"chown {shlex.quote(user)}: {' '.join(shlex.quote(d) for d in user_dirs)}")
    return "\n".join(lines)


class ServerWatch:
    """``controller.torchrun.host_sampler`` on one server, feeding ``sampler``: started
    by :meth:`start` and :meth:`wait_ready`, ended by :meth:`stop`, which reads its last
    lines. ``offset_ns``: the server's CLOCK_MONOTONIC offset measured at the run's start
    (``topo.clocks``), taken off every stamp. ``iface``: each host's (rx, tx) bytes from its final line; ``cpu``:
    each host's latest (torchrun tree CPU seconds, time on this clock)."""

    def __init__(self, server: str, ssh: Sequence[str], hosts: Sequence[WatchedHost],
                 sampler: ConnSampler, offset_ns: int, log: Callable[[str], None]) -> None:
        self.server = server
        self.hosts = list(hosts)
        self.sampler = sampler
        self.offset_ns = offset_ns
        spec = host_sampler.encode_spec(hosts)
        command = (f"cd {shlex.quote(str(REPO))} && exec {shlex.quote(sys.executable)} -m "
                   f"controller.torchrun.host_sampler {shlex.quote(spec)}")
        self.argv = [*ssh, command]
        log(f"$ {shlex.join(self.argv)}")
        self.iface: dict[str, tuple[int, int]] = {}
        self.cpu: dict[str, tuple[float, int]] = {}
        self.error: str | None = None
        self._ready = threading.Event()
        self._ended = threading.Event()
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, args=(self._proc.stdout,),
                                        name=f"watch-{self.server}", daemon=True)
        self._reader.start()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until the server's sampler has its sockets open; TorchrunError otherwise."""
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.1):
            if self._ended.is_set() or time.monotonic() > deadline:
                raise TorchrunError(f"server {self.server}: the ranks' watch did not start: "
                                    f"{self.error or self._stderr() or 'no answer'}")

    def _read(self, out: IO[str]) -> None:
        try:
            for line in out:
                self._line(line)
        except Exception as e:  # noted in the summary; the run itself goes on
            self.error = f"server {self.server}: {type(e).__name__}: {e}"
        finally:
            self._ended.set()

    def _line(self, line: str) -> None:
        row = host_sampler.parse_line(line)
        if row.get("ready"):
            self._ready.set()
        elif "error" in row:
            self.error = f"server {self.server}: {row['error']}"
        elif "host" in row:
            host = str(row["host"])
            ts = row["ts_ns"] - self.offset_ns
            self.sampler.feed(host, ts, row["conns"])
            if row.get("cpu_s") is not None:
                self.cpu[host] = (float(row["cpu_s"]), ts)
            if "iface" in row:
                self.iface[host] = row["iface"]

    def _stderr(self) -> str:
        p = self._proc
        if p is None or p.poll() is None or p.stderr is None:
            return ""
        return p.stderr.read().strip()[-300:]

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close its stdin; its last lines (destroy messages, counters) are read here."""
        p = self._proc
        if p is None:
            return
        if p.stdin is not None:
            try:
                p.stdin.close()
            except OSError:
                pass
        self._ended.wait(timeout_s)
        try:
            p.wait(timeout=2)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if self._reader is not None:
            self._reader.join(timeout=2)
        missing = [h.name for h in self.hosts if h.name not in self.iface]
        if missing and self.error is None:
            why = self._stderr()  # read once: the pipe is drained by reading it
            self.error = (f"server {self.server}: no final counters for {', '.join(missing)}"
                          f"{': ' + why if why else ''}")


class RankServers:
    """The servers of a run's remote training hosts: ``ssh(server)`` gives the command
    prefix that reaches one (the run's shared connection); ``where``: host -> server."""

    def __init__(self, where: Mapping[str, str], ssh: Callable[[str], list[str]],
                 remote_dir: Path, log: Callable[[str], None]) -> None:
        self.where = dict(where)
        self.servers = sorted(set(where.values()))
        self._ssh = ssh
        self.remote_dir = remote_dir
        self.log = log

    def pid_file(self, host: str) -> str:
        return str(self.remote_dir / PID_DIR / host)

    def log_dir(self) -> Path:
        """Where the ranks' log folders are on every server (RUN/logs/ranks there)."""
        return self.remote_dir / "logs" / "ranks"

    def _run(self, server: str, script: str, timeout_s: float = SSH_TIMEOUT_S
             ) -> subprocess.CompletedProcess[str]:
        argv = [*self._ssh(server), script]
        self.log(f"$ {shlex.join(argv)}")
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                              check=False)

    def _on_each(self, fn: Callable[[str], Any]) -> dict[str, Any]:
        return on_each(self.servers, fn)

    def prepare(self, paths: Mapping[str, str], user: str) -> dict[str, ServerUser | None]:
        """Check every server (:func:`check_script`) and make its hosts' log folders;
        each server's ids of ``user`` ("" = the ranks run as the ssh user). Raises
        TorchrunError naming the server and what it lacks."""
        def one(server: str) -> ServerUser | None:
            hosts = [h for h, s in self.where.items() if s == server]
            logs = [str(self.log_dir() / h) for h in hosts]
            events = str(self.remote_dir / "events")
            script = check_script(paths, user, [*logs, events, str(self.remote_dir / PID_DIR)],
                                  [str(self.log_dir().parent), str(self.log_dir()), *logs,
                                   events])
            p = self._run(server, script)
            if p.returncode == MISSING_EXIT:
                what = p.stdout.strip().splitlines()[-1].removeprefix("missing ")
                if what == "user":
                    raise TorchrunError(
                        f"server {server}: no user {user} there (the ranks run as the user "
                        "who ran sudo, never as root; make that user on every server)")
                raise TorchrunError(f"server {server}: {what} {paths[what]}: not there "
                                    "(every server needs it at the same path)")
            if p.returncode != 0:
                raise TorchrunError(f"server {server}: the ranks' check failed (exit "
                                    f"{p.returncode}): {p.stderr.strip()[-300:]}")
            if not user:
                return None
            uid, gid, home = p.stdout.split()[-3:]
            return ServerUser(user, int(uid), int(gid), home)

        return self._on_each(one)

    def stop(self, grace_s: float) -> list[str]:
        """Every torchrun tree of every server stopped there (SIGTERM, SIGKILL after
        ``grace_s``) and its pid file removed; one line per server."""
        def one(server: str) -> str:
            files = " ".join(shlex.quote(self.pid_file(h))
                             for h, s in self.where.items() if s == server)
            command = (f"cd {shlex.quote(str(REPO))} && {shlex.quote(sys.executable)} -m "
                       f"controller.torchrun.stop {grace_s:g} {files}; "
                       f"rmdir {shlex.quote(str(self.remote_dir / PID_DIR))} 2>/dev/null; true")
            try:
                p = self._run(server, command, timeout_s=3 * grace_s + SSH_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                return f"{server}: the ranks' stop timed out"
            return f"{server}: {(p.stdout or p.stderr).strip()[-300:]}"

        return list(self._on_each(one).values())


def invoking_user_name() -> str:
    """The name of the user who ran sudo ("" when not under sudo): the servers know the
    user by name, each with its own ids."""
    user = invoking()
    return user.name if user is not None else ""


def start_watches(servers: RankServers, cluster: Cluster,
                  hosts: Mapping[str, tuple[int, str]], sampler: ConnSampler,
                  log: Callable[[str], None]) -> list[ServerWatch]:
    """One started :class:`ServerWatch` per server of ``servers``, over the cluster's
    shared ssh, for ``hosts`` (host -> (its namespace's pid there, its interface)), its
    stamps moved by the server's offset measured at the start (0 if none was)."""
    out = []
    for server in servers.servers:
        start = clocks.from_record(dict(cluster.clocks.get("start", {}).get(server, {})))
        watched = [WatchedHost(h, pid, dev, servers.pid_file(h))
                   for h, (pid, dev) in hosts.items() if servers.where[h] == server]
        w = ServerWatch(server, cluster.access.argv(cluster.ips[server]), watched, sampler,
                        start.offset_ns if start is not None else 0, log)
        w.start()
        out.append(w)
    return out
