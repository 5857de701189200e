"""The agents of a run on other servers (Mininet Cluster Edition, ``topo.cluster``): their
run directory there, the control plane that reaches them, the watch on each server, and
the gathering of what they wrote into the one run directory.

- **A run directory per server.** An agent on another server writes where it runs:
  ``REMOTE_ROOT/RUN_NAME`` there (``/run`` is local to each machine, and private to each
  fake server of ``scripts/fake_cluster.sh``), holding the run's ``config.toml``. Its
  command line names that directory instead of the controller's (:meth:`argv_for`);
  its output comes back over ssh into the controller's ``logs/``.
- **The control plane.** One ssh connection per server, separate from the emulated links
  (it runs over the servers' own network), forwards the remote ``control.sock`` to the
  controller's (``ssh -R path:path``). An agent there speaks to the controller exactly as
  one here does, through the same authenticated handshake (``agents.net.handshake``); ssh
  adds its own key-only login. The same connection is the watch: when it ends, the server
  is lost (:meth:`lost`), within ssh's keep-alive (3 x 5 s) for a server that vanished and
  at once for one whose sshd died.
- **Gathering.** At the end, each server's directory comes back over ssh (``tar``); its
  events are moved onto the controller's clock (:func:`align_line`: every CLOCK_MONOTONIC
  field of the schema, ``agents.core.events.clock_fields``, minus the server's measured
  offset, ``topo.clocks``), its other files (the PS's final weights) copied as they are,
  and the directory there removed. ``meta.json`` records the servers, the placement and
  the offsets (:meth:`record`); ``gradbed cleanup`` uses that record to reach the servers
  of a run whose controller was killed (:func:`cleanup_run`).
"""

from __future__ import annotations

import io
import json
import os
import select
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from agents.core.config import ExperimentConfig
from agents.core.events import clock_fields
from controller.agent_env import agent_environment
from controller.rundir import write_json
from controller.warm_remote import ServerWarms
from topo import clocks
from topo.cluster import REPO, Cluster, SshAccess, on_each, server_ip
from topo.placement import LOCAL, servers_used
from topo.spec import NetSpec

T = TypeVar("T")

# Each server's run directories: /run is a tmpfs on every Linux server (events are small)
# and private to each fake server; not /run/gradbed/runs, the controller's run registry.
REMOTE_ROOT = Path("/run/gradbed/remote")
# The controller's record of each run's servers, for ``gradbed cleanup`` after a killed
# controller. Root's own folder, never the run directory: a user who can write there must
# not choose what root runs ssh with (an ssh_config's ProxyCommand is a command).
RECORD_DIR = Path("/run/gradbed/clusters")
READY_TIMEOUT_S = 30.0
SSH_TIMEOUT_S = 120.0
# What stays on the server: the copy of the config it was sent and the forwarded socket.
NOT_GATHERED = ("config.toml", "control.sock")
# Variables the controller's own environment passes on to the agents of other servers
# besides what controller.agent_env sets: gradbed's own switches (strict events...).
FORWARDED_PREFIX = "GRADBED_"


def remote_env(agent_env: Mapping[str, str], base: Mapping[str, str]) -> dict[str, str]:
    """What an agent on another server gets on top of that server's own environment: what
    ``agent_environment`` added to or changed in ``base``, and gradbed's own variables;
    never the rest of this machine's environment (its PATH, HOME, terminal)."""
    return {k: v for k, v in agent_env.items()
            if base.get(k) != v or k.startswith(FORWARDED_PREFIX)}


def server_warms(spec: NetSpec, access: SshAccess, run_name: str,
                 cfg: ExperimentConfig, log: Callable[[str], None]) -> ServerWarms:
    """A warm process on each other server of ``spec``, started now, with the environment
    that server's agents get (``controller.warm_remote``)."""
    env = agent_environment(os.environ, str(REPO), cfg.run.allocator)
    ips = {s: server_ip(s) for s in servers_used(spec) if s != LOCAL}
    return ServerWarms(ips, access, run_name, remote_env(env, os.environ),
                       cfg.workload.name, log)


def align_line(line: str, offset_ns: Callable[[int], int]) -> str:
    """One JSONL event written on another server, with every CLOCK_MONOTONIC field moved
    onto the controller's clock (``stamp - offset_ns(stamp)``); other lines unchanged."""
    try:
        row = json.loads(line)
    except ValueError:
        return line  # a line cut by a killed writer: the loaders skip it as they would here
    if not isinstance(row, dict):
        return line
    for field in clock_fields(str(row.get("event", ""))):
        value = row.get(field)
        if isinstance(value, int) and value > 0:
            row[field] = value - offset_ns(value)
    return json.dumps(row)


class RemoteAgents:
    """The remote side of one run: ``prepare()`` before the agents start, ``lost()`` while
    they run, ``gather(clocks)`` and ``close()`` once the network is down."""

    def __init__(self, cluster: Cluster, run_dir: Path, local_socket: Path,
                 log: Callable[[str], None], warms: ServerWarms | None = None) -> None:
        self.where = dict(cluster.where)
        self.servers = list(cluster.remote)
        self.ips = dict(cluster.ips)
        # Own connections (no shared ControlMaster): the network's is closed at its
        # teardown, before the gathering.
        self.access = replace(cluster.access, control_dir="")
        self.run_dir = run_dir
        self.remote_dir = REMOTE_ROOT / run_dir.name
        self.local_socket = local_socket
        self.log = log
        self._links: dict[str, subprocess.Popen[bytes]] = {}
        self._lost: dict[str, str] = {}
        # Each server's warm process (controller.warm_remote): its agents fork from it.
        self.warms = warms

    def is_remote(self, host: str) -> bool:
        return self.where.get(host, LOCAL) != LOCAL

    def control_pid(self, host: str) -> int:
        """The ssh process that forwards ``host``'s server's control connections here: what
        the control socket's ``SO_PEERCRED`` says of every agent of that server."""
        return self._links[self.where[host]].pid

    def ssh(self, server: str, command: str, stdin: bytes | None = None,
            timeout_s: float = SSH_TIMEOUT_S) -> subprocess.CompletedProcess[bytes]:
        argv = [*self.access.argv(self.ips[server]), command]
        self.log(f"$ {shlex.join(argv)}")
        return subprocess.run(argv, input=stdin, capture_output=True, timeout=timeout_s,
                              check=False)

    # -- start ---------------------------------------------------------------------

    def start(self, clock_record: Mapping[str, Any], meta: dict[str, Any],
              meta_path: Path) -> None:
        """Recorded first (``meta["cluster"]`` written to ``meta_path``, and where
        ``gradbed cleanup`` finds the servers), then :meth:`prepare`."""
        meta["cluster"] = self.record(clock_record)
        write_json(meta_path, meta)
        self.register(clock_record)
        self.prepare()

    def prepare(self) -> None:
        """On every server: a fresh run directory holding the run's config, and the control
        connection forwarding its ``control.sock`` here (waited for, so an agent started
        next finds the socket)."""
        config = (self.run_dir / "config.toml").read_bytes()
        d = shlex.quote(str(self.remote_dir))
        made = on_each(self.servers, lambda s: self.ssh(
            s, f"rm -rf {d} && mkdir -p {d}/events && cat > {d}/config.toml", stdin=config))
        for s, p in made.items():
            if p.returncode != 0:
                raise RuntimeError(f"server {s}: could not make {self.remote_dir} (exit "
                                   f"{p.returncode}): {p.stderr.decode(errors='replace')}")
        for s in self.servers:
            self._links[s] = self._forward(s)
        for s, proc in self._links.items():
            self._wait_forwarded(s, proc)

    def _forward(self, server: str) -> subprocess.Popen[bytes]:
        remote_sock = self.remote_dir / "control.sock"
        # The remote command says "ready" once the forwarded socket exists, then holds the
        # session open on its stdin, a pipe only this process holds: a killed controller
        # ends it, and the socket goes with it.
        wait = (f"while ! test -S {shlex.quote(str(remote_sock))}; do sleep 0.05; done; "
                "echo ready; exec cat >/dev/null")
        ssh = self.access.argv(self.ips[server])
        argv = [*ssh[:-1], "-o", "ExitOnForwardFailure=yes", "-o", "StreamLocalBindUnlink=yes",
                "-R", f"{remote_sock}:{self.local_socket}", ssh[-1], wait]
        self.log(f"$ {shlex.join(argv)}")
        return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)

    def _wait_forwarded(self, server: str, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 0.2)
            if ready:
                if proc.stdout.readline().strip() == b"ready":
                    self.log(f"control socket of {server}: forwarded to {self.local_socket}")
                    return
                break
            if proc.poll() is not None:
                break
        raise RuntimeError(f"server {server}: the control connection did not come up: "
                           f"{self._ended(proc) or 'no answer'}")

    def argv_for(self, host: str, argv: Sequence[str], env: Mapping[str, str],
                 base_env: Mapping[str, str]) -> list[str]:
        """``argv`` as ``host``'s server runs it: the run directory (an argument that is it,
        or a path below it) is that server's, started in gradbed's folder there with the
        agent's environment (:func:`remote_env`)."""
        local = str(self.run_dir)

        def mapped(a: str) -> str:
            if a == local or a.startswith(local + "/"):
                return str(self.remote_dir) + a[len(local):]
            return a

        extra = [f"{k}={v}" for k, v in sorted(remote_env(env, base_env).items())]
        agent = [mapped(a) for a in argv]
        if self.warms is not None:
            agent = self.warms.wrap(self.where[host], agent)
        return ["env", "-C", str(REPO), *extra, *agent]

    # -- while it runs ---------------------------------------------------------------

    def lost(self) -> str:
        """``server lost: SERVER (why)`` for the first server whose control connection
        ended; "" while every one is up."""
        for s, proc in self._links.items():
            if s not in self._lost and proc.poll() is not None:
                self._lost[s] = self._ended(proc) or f"exit {proc.returncode}"
        if not self._lost:
            return ""
        s, why = next(iter(self._lost.items()))
        return f"server lost: {s} (its control connection ended: {why})"

    def lost_servers(self) -> set[str]:
        """The servers found lost so far (:meth:`lost`)."""
        self.lost()
        return set(self._lost)

    @staticmethod
    def _ended(proc: subprocess.Popen[bytes]) -> str:
        if proc.poll() is None or proc.stderr is None:
            return ""
        return proc.stderr.read().decode(errors="replace").strip()[-300:]

    # -- the end ---------------------------------------------------------------------

    def finish(self, clock_record: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
        """Once the network is down: the control connections ended, every server's files
        gathered (a line each), the record unregistered; what meta.json now says about
        the servers, with their offsets and any lost one."""
        self.close()
        try:
            for line in self.gather(clock_record):
                self.log(line)
        finally:
            self.unregister()
        return self.record(clock_record)

    def close(self) -> None:
        """End the control connections (the remote sockets go with them)."""
        for proc in self._links.values():
            if proc.poll() is None and proc.stdin is not None:
                proc.stdin.close()
        for proc in self._links.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._links.clear()

    def gather(self, clock_record: Mapping[str, Mapping[str, Any]]) -> list[str]:
        """Every server's run directory into this one, its events aligned with the
        server's offsets (``clock_record``: ``Cluster.clocks``), then removed there. One
        line per server; a server that cannot be reached is said, not raised."""
        return list(on_each(self.servers,
                             lambda s: self._gather_one(s, clock_record)).values())

    def _gather_one(self, server: str, clock_record: Mapping[str, Mapping[str, Any]]) -> str:
        d = shlex.quote(str(self.remote_dir))
        try:
            p = self.ssh(server, f"tar -C {d} -cf - {_excluded()} . && rm -rf {d}")
        except subprocess.TimeoutExpired:
            return f"{server}: not gathered (ssh timed out)"
        if p.returncode != 0:
            return (f"{server}: not gathered (exit {p.returncode}): "
                    f"{p.stderr.decode(errors='replace').strip()[-300:]}")
        start = clocks.from_record(dict(clock_record.get("start", {}).get(server, {})))
        end = clocks.from_record(dict(clock_record.get("end", {}).get(server, {})))
        if start is None:
            return f"{server}: not gathered (no clock offset was measured)"
        files = unpack_aligned(p.stdout, self.run_dir, lambda ns: clocks.offset_at(start, end,
                                                                                  ns))
        return (f"{server}: gathered {len(files)} file(s), events moved by "
                f"{-start.offset_ns / 1e9:+.6f} s (+- {start.error_ns / 1e6:.3f} ms)")

    def record(self, clock_record: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """What ``meta.json`` says about the servers (and ``gradbed cleanup`` reads)."""
        out: dict[str, Any] = {
            "servers": self.ips, "placement": self.where, "remote_dir": str(self.remote_dir),
            "ssh": {"user": self.access.user, "key_path": self.access.key_path,
                    "ssh_config": self.access.ssh_config},
            "events_aligned": "each CLOCK_MONOTONIC field of an event written on another "
                              "server minus that server's offset (interpolated from start "
                              "to end); error within the offset's error_s"}
        if clock_record is not None:
            out["clocks"] = clock_record
        if self._lost:
            out["lost"] = dict(self._lost)
        return out

    def register(self, clock_record: Mapping[str, Any]) -> None:
        """Keep :meth:`record` where ``gradbed cleanup`` trusts it (:data:`RECORD_DIR`)."""
        RECORD_DIR.mkdir(parents=True, exist_ok=True)
        path = RECORD_DIR / f"{self.run_dir.name}.json"
        path.write_text(json.dumps({**self.record(clock_record),
                                    "run_dir": str(self.run_dir)}))

    def unregister(self) -> None:
        (RECORD_DIR / f"{self.run_dir.name}.json").unlink(missing_ok=True)


def registered(run_dir: Path) -> dict[str, Any] | None:
    """The servers' record :meth:`RemoteAgents.register` kept for ``run_dir`` (None: a run
    on this machine only, or one whose record is gone)."""
    try:
        rec = json.loads((RECORD_DIR / f"{run_dir.name}.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or rec.get("run_dir") != str(run_dir):
        return None
    return rec


def unpack_aligned(tar_bytes: bytes, run_dir: Path,
                   offset_ns: Callable[[int], int]) -> list[Path]:
    """Unpack a server's run directory (a tar stream) into ``run_dir``: ``events/*.jsonl``
    aligned line by line (:func:`align_line`), everything else as it is; a file the
    controller already has is left alone (its own logs). Returns the files written."""
    out: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="gbgather-") as tmp, \
            tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        members = [m for m in tar.getmembers() if _plain(m)]
        tar.extractall(tmp, members=members)  # noqa: S202  (checked by _plain)
        for src in sorted(Path(tmp).rglob("*")):
            if not src.is_file():
                continue
            rel = src.relative_to(tmp)
            dst = run_dir / rel
            if dst.exists() or dst.is_symlink() or not _inside(dst.parent, run_dir):
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            if rel.parent == Path("events") and rel.suffix == ".jsonl":
                lines = src.read_text(encoding="utf-8", errors="replace").splitlines()
                dst.write_text("".join(align_line(ln, offset_ns) + "\n" for ln in lines),
                               encoding="utf-8")
            else:
                shutil.copyfile(src, dst)
            out.append(dst)
    return out


def cleanup_run(run_dir: Path, record: Mapping[str, Any], wait_s: float = 30.0) -> list[str]:
    """What a killed controller left on a run's other servers (``meta.json``'s
    ``cluster`` record): gradbed's agents, shells and links there (``topo.cleanup``, under
    that server's own network lock, waited for up to ``wait_s``: another run in progress
    there keeps its network, and the line names it), and the run's directory there, its
    events gathered first (aligned with the offsets measured at the run's start, the only
    ones a killed run has)."""
    ssh = record.get("ssh", {})
    access = SshAccess(user=str(ssh.get("user", "root")), key_path=str(ssh.get("key_path", "")),
                       ssh_config=str(ssh.get("ssh_config", "")))
    raw_dir = str(record.get("remote_dir", ""))
    remote_dir = shlex.quote(raw_dir)
    clock_start = record.get("clocks", {}).get("start", {})
    servers = {s: str(ip) for s, ip in dict(record.get("servers", {})).items() if s != LOCAL}

    def clean_one(server: str) -> list[str]:
        argv = access.argv(servers[server])
        cleaned = _clean_locked(server, argv, wait_s, raw_dir)
        if any(ln.startswith(f"{server}: not cleaned") for ln in cleaned):
            return cleaned
        got = subprocess.run([*argv, f"test -d {remote_dir} || exit 0; tar -C {remote_dir} "
                                     f"-cf - {_excluded()} . && rm -rf {remote_dir}"],
                             capture_output=True, timeout=SSH_TIMEOUT_S, check=False)
        start = clocks.from_record(dict(clock_start.get(server, {})))
        if got.returncode == 0 and got.stdout:
            files = unpack_aligned(got.stdout, run_dir, _fixed(start))
            cleaned.append(f"{server}: gathered {len(files)} file(s) and removed "
                           f"{record.get('remote_dir')}")
        return cleaned

    # Each server under its own lock, all at once: one server's wait or round trips do
    # not hold up the others'.
    return [ln for lines in on_each(list(servers), clean_one).values() for ln in lines]


# Run on a server by ``gradbed cleanup``: under that server's network lock, the run's
# torchrun trees and ranks' watch (controller.torchrun.stop.stop_run: its ranks run in
# sessions of their own, which topo.cleanup's kill of torchrun would leave orphaned),
# then topo.cleanup.
_LOCKED_CLEANUP = """import sys
from controller.torchrun.stop import stop_run
from topo.cleanup import cleanup
from topo.lock import LockTimeout, NetLock
from topo.remote_delayline import remove_folders
try:
    with NetLock(timeout_s=float(sys.argv[1])):
        print("network lock taken")
        print("\\n".join(stop_run(sys.argv[2], 5.0) + cleanup() + remove_folders()))
except LockTimeout as exc:
    print(exc)
    sys.exit(3)
"""
BUSY_EXIT = 3


def _clean_locked(server: str, ssh_argv: Sequence[str], wait_s: float, remote_dir: str
                  ) -> list[str]:
    """``topo.cleanup`` on ``server`` under its network lock, after the torchrun trees of
    the run whose directory there is ``remote_dir``; one line per thing done, prefixed
    with the server; ``SERVER: not cleaned: ...`` when it could not be."""
    clean = subprocess.run(
        [*ssh_argv, f"cd {shlex.quote(str(REPO))} && {shlex.quote(sys.executable)} -c "
                    f"{shlex.quote(_LOCKED_CLEANUP)} {wait_s:g} {shlex.quote(remote_dir)}"],
        capture_output=True, text=True, timeout=wait_s + SSH_TIMEOUT_S, check=False)
    if clean.returncode == BUSY_EXIT:
        return [f"{server}: not cleaned: another run holds its network lock "
                f"({clean.stdout.strip()[-300:]})"]
    if clean.returncode != 0:
        return [f"{server}: not cleaned: cleanup failed (exit {clean.returncode}): "
                f"{clean.stderr.strip()[-300:]}"]
    return [f"{server}: {ln}" for ln in clean.stdout.splitlines() if ln.strip()]


def _fixed(start: clocks.ClockOffset | None) -> Callable[[int], int]:
    """The start's offset for every stamp (0 when none was measured)."""
    offset_ns = start.offset_ns if start is not None else 0
    return lambda _ns: offset_ns


def _plain(member: tarfile.TarInfo) -> bool:
    """A regular file or folder inside the archive (what a server's run directory holds);
    never a link, a device or a path leaving it."""
    parts = Path(member.name).parts
    return (member.isfile() or member.isdir()) and not Path(member.name).is_absolute() \
        and ".." not in parts


def _inside(folder: Path, run_dir: Path) -> bool:
    """Whether ``folder`` (or where it would be made) stays inside ``run_dir`` once links
    are followed: root never writes through a link a user left in a run directory."""
    return folder.resolve().is_relative_to(run_dir.resolve())


def _excluded() -> str:
    """tar's options that leave :data:`NOT_GATHERED` on the server."""
    return " ".join(f"--exclude=./{n}" for n in NOT_GATHERED)
