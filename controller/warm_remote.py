"""A warm process on each other server of a run: that server's agents are forks of it.

On this machine a run's agents are forks of one interpreter that imported torch while
the network was built (``controller.warm``). An agent on another server starts over ssh
(``controller.remote``), and without this module it is a fresh interpreter that imports
torch itself, all of that server's agents at once at the run's start. Here each server
gets one warm process of its own, started over the run's ssh as early as this machine's
(before the network is built), and every agent there becomes a fork of it:

- **The warm process** (``python -m controller.warm_remote serve SOCKET WORKLOAD``, in the
  server's root namespace, in gradbed's folder there, with the agents' environment)
  listens on a ``SOCK_SEQPACKET`` Unix socket at once (a client that comes while torch
  still loads waits in the backlog), then imports what the local warm process imports
  (:func:`controller.warm.warm_up`) and forks a child per request. Its stdin is a pipe
  from its ssh session: when that ends (the run closed it, the controller was killed, the
  connection dropped) it kills every child it has, removes its socket and exits.
- **The client** (``python -m controller.warm_remote run SOCKET -- python -m agents.X
  ...``) is what the agent's ssh session runs in the host's namespace in its place: a
  small interpreter without torch. It hands its own stdin, stdout and stderr (the ssh
  session's), its cwd and environment to the warm process, which forks the agent into
  the client's network namespace (its peer credentials name the client's pid). The client
  passes on SIGTERM, SIGINT and SIGHUP, and ends as the agent ends: with its exit code,
  or killed by the same signal. So ssh, the controller and ``gradbed cleanup`` (which
  kills the client like an agent: its command line names the agent's module) see what
  they saw of a cold agent. When the client goes, the warm process kills its agent.
- **Cold when it must be.** A client that finds no socket, or whose environment differs
  from the warm process's (besides what each ssh session sets itself), execs the agent's
  own command line: a fresh interpreter, as without this module.
"""

from __future__ import annotations

import json
import os
import select
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from controller.warm import (
    _ENV_IGNORED,
    ARGV_ROOM_BYTES,
    MAX_PACKET,
    REPO,
    _become,
    _tell,
    _try_signal,
    warm_up,
)

# Each server's warm sockets: root's own folder there, one socket per run. Not the remote
# run directory, which the run makes afresh after the network is built.
WARM_ROOT = Path("/run/gradbed/warm")
# Signals the client passes on to its agent (what the controller or a user sends).
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# What each ssh session sets for itself (its own client port, terminal) and what its
# shell sets for each command (``_``, the command's path): never a reason to start an
# agent cold.
_SESSION_PREFIXES = ("SSH_",)
_SESSION_NAMES = ("_",)


def socket_path(run_name: str) -> Path:
    return WARM_ROOT / f"{run_name}.sock"


def _comparable(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items()
            if k not in _ENV_IGNORED and k not in _SESSION_NAMES
            and not k.startswith(_SESSION_PREFIXES)}


# -- the warm process on a server -------------------------------------------------------

def serve(path: Path, workload: str) -> None:
    """Listen at ``path``, warm up, then fork an agent per client until stdin closes."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(64)
    try:
        argv_area = warm_up(workload)
        own_env = _comparable(os.environ)
        print("ready", flush=True)
        _loop(listener, argv_area, own_env)
    finally:
        path.unlink(missing_ok=True)


def _loop(listener: socket.socket, argv_area: tuple[int, int], own_env: dict[str, str]
          ) -> None:
    clients: dict[int, socket.socket] = {}  # fd -> the client's connection
    child_of: dict[int, int] = {}  # client fd -> the pidfd of its agent
    pids: dict[int, int] = {}  # pidfd -> pid
    while True:
        waiting: list[Any] = [sys.stdin, listener, *clients.values(), *pids]
        readable, _, _ = select.select(waiting, [], [])
        for r in readable:
            if r is sys.stdin:
                if not os.read(sys.stdin.fileno(), 4096):  # the run, or its ssh, is gone
                    for pidfd in pids:
                        _try_signal(pidfd, signal.SIGKILL)
                    for pidfd in list(pids):  # each client then dies of it as its agent
                        _reaped(pidfd, pids, child_of, clients)
                    return
            elif r is listener:
                conn, _ = listener.accept()
                clients[conn.fileno()] = conn
            elif isinstance(r, socket.socket):
                _on_client(r, clients, child_of, pids, listener, argv_area, own_env)
            else:
                _reaped(r, pids, child_of, clients)


def _reaped(pidfd: int, pids: dict[int, int], child_of: dict[int, int],
            clients: dict[int, socket.socket]) -> None:
    """Reap the agent of ``pidfd`` and tell its client how it ended."""
    pid = pids.pop(pidfd)
    _, status = os.waitpid(pid, 0)
    os.close(pidfd)
    owner = next((c for c, p in child_of.items() if p == pidfd), None)
    if owner is not None:
        del child_of[owner]
        _tell(clients[owner], {"exited": pid, "status": status})


def _on_client(conn: socket.socket, clients: dict[int, socket.socket],
               child_of: dict[int, int], pids: dict[int, int], listener: socket.socket,
               argv_area: tuple[int, int], own_env: dict[str, str]) -> None:
    """One packet from a client: its spawn, a signal for its agent, or its end."""
    fd = conn.fileno()
    try:
        msg, fds, _, _ = socket.recv_fds(conn, MAX_PACKET, 3)
    except ConnectionError:
        msg, fds = b"", []
    if not msg:  # the client went: its agent goes with it, as a cold agent would have
        pidfd = child_of.pop(fd, None)
        if pidfd is not None:
            _try_signal(pidfd, signal.SIGKILL)
        del clients[fd]
        conn.close()
        return
    req = json.loads(msg)
    if req["op"] == "signal":
        pidfd = child_of.get(fd)
        _tell(conn, {"ok": pidfd is not None and _try_signal(pidfd, int(req["sig"]))})
        return
    differs = sorted(k for k in own_env.keys() ^ _comparable(req["env"]).keys()
                     | {k for k, v in own_env.items() if req["env"].get(k, v) != v})
    if differs or fd in child_of:
        for f in fds:
            os.close(f)
        _tell(conn, {"cold": f"environment differs: {', '.join(differs)}" if differs
                     else "one agent per client"})
        return
    # The client runs in the agent's host: its peer credentials name its pid here.
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    client_pid = int.from_bytes(creds[:4], sys.byteorder)
    pid = os.fork()
    if pid == 0:
        listener.close()
        others = [c for c in clients.values() if c is not conn]
        for c in others:
            c.close()
        _become({**req, "netns_pid": client_pid, "new_session": True}, fds, conn,
                list(pids), argv_area)  # no return
    for f in fds:
        os.close(f)
    pidfd = os.pidfd_open(pid)
    pids[pidfd] = pid
    child_of[fd] = pidfd
    _tell(conn, {"pid": pid})


# -- the client, in place of the agent ---------------------------------------------------

def run_client(path: Path, argv: list[str]) -> None:
    """Start ``argv`` (``python -m MODULE ...``) as a fork of the warm process at ``path``
    and end as it ends; exec it cold when there is none, or it may not be forked."""
    if len(argv) < 3 or argv[1] != "-m":
        _cold(argv, "not a python -m command line")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(str(path))
    except OSError as e:
        _cold(argv, f"no warm process at {path} ({e.strerror})")
    req = {"op": "spawn", "executable": argv[0], "module": argv[2], "args": argv[3:],
           "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(conn, [json.dumps(req).encode()], [0, 1, 2])
    reply = _reply(conn)
    if "pid" not in reply:
        conn.close()
        _cold(argv, str(reply.get("cold", "the warm process is gone")))
    for sig in RELAYED:
        signal.signal(sig, lambda s, _f: socket.send_fds(
            conn, [json.dumps({"op": "signal", "sig": s}).encode()], []))
    while True:
        got = _reply(conn)
        if "exited" in got:
            _end_as(int(got["status"]))
        if not got:  # the warm process is gone, and its children with it
            os._exit(1)


def _reply(conn: socket.socket) -> dict[str, Any]:
    while True:
        try:
            msg = conn.recv(MAX_PACKET)
        except InterruptedError:
            continue
        except ConnectionError:
            msg = b""
        return json.loads(msg) if msg else {}


def _cold(argv: list[str], why: str = "") -> None:
    """Become the agent's own interpreter; ``why`` goes to its log."""
    if why:
        print(f"warm start: {why}; starting cold", file=sys.stderr, flush=True)
    os.execv(argv[0], argv)


def _end_as(status: int) -> None:
    """Exit with the agent's exit code, or die of the signal that killed it."""
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        for sig in RELAYED:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)  # a signal that does not kill (SIGCHLD...) falls through
    os._exit(code if code >= 0 else 128 - code)


# -- the controller's side ---------------------------------------------------------------

class ServerWarm:
    """The warm process of one server, started over ssh (``via``: the ssh prefix) now;
    :meth:`wrap` turns an agent's command line into its client's; :meth:`close` ends it
    (and every agent it still has)."""

    def __init__(self, via: Sequence[str], server: str, run_name: str,
                 env: Mapping[str, str], workload: str, log: Any = None) -> None:
        self.server = server
        self.path = socket_path(run_name)
        extra = [f"{k}={v}" for k, v in sorted(env.items())]
        command = shlex.join(["env", "-C", str(REPO), *extra, sys.executable, "-m",
                              "controller.warm_remote", "serve", str(self.path),
                              workload or "-", "-" * ARGV_ROOM_BYTES])
        if log is not None:
            log(f"$ {shlex.join([*via, command[:200] + ' ...'])}")
        # Its stdin is ours alone: closed by close(), or by this process's death.
        self.proc = subprocess.Popen([*via, command], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True)

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` (``python -m MODULE ...``) as this server's client runs it."""
        return [sys.executable, "-m", "controller.warm_remote", "run", str(self.path),
                "--", *argv]

    def close(self) -> str:
        """End the warm process there; what it said on stderr, if it failed."""
        try:
            _, err = self.proc.communicate(timeout=10)  # closes its stdin: the end
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        if self.proc.returncode not in (0, None):
            return (f"{self.server}: the warm process ended with {self.proc.returncode}: "
                    f"{err.decode(errors='replace').strip()[-500:]}")
        return ""


class ServerWarms:
    """The warm processes of a run's other servers, one per server, started at once (their
    imports run while this machine checks and builds the network); none when
    ``GRADBED_WARM=0``. ``ips``: server -> its address; ``env``: what the agents there
    get on top of the server's environment (``controller.remote.remote_env``)."""

    def __init__(self, ips: Mapping[str, str], access: Any, run_name: str,
                 env: Mapping[str, str], workload: str, log: Any = None) -> None:
        on = os.environ.get("GRADBED_WARM", "1") != "0"
        self.by_server = {s: ServerWarm(access.argv(ip), s, run_name, env, workload, log)
                          for s, ip in ips.items()} if on else {}

    def wrap(self, server: str, argv: Sequence[str]) -> list[str]:
        warm = self.by_server.get(server)
        return warm.wrap(argv) if warm is not None else list(argv)

    def close(self) -> list[str]:
        """End them all; a line for each that had failed."""
        said = [w.close() for w in self.by_server.values()]
        self.by_server = {}
        return [s for s in said if s]


def main(argv: list[str]) -> None:
    if argv[:1] == ["serve"] and len(argv) >= 3:
        serve(Path(argv[1]), "" if argv[2] == "-" else argv[2])
    elif argv[:1] == ["run"] and len(argv) >= 4 and argv[2] == "--":
        run_client(Path(argv[1]), argv[3:])
    else:
        sys.exit("usage: python -m controller.warm_remote serve SOCKET WORKLOAD | "
                 "run SOCKET -- python -m MODULE ARGS...")


if __name__ == "__main__":
    main(sys.argv[1:])
