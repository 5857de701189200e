"""Agent processes forked from one warm interpreter: emulated runs, loopback tests, benchmarks.

A run starts its agents (``python -m agents.dp.ps``, ``agents.dp.worker``,
``agents.pipeline.stage``, ``agents.pipeline.stage_ps``, ``agents.moe.expert``) as real
processes talking real TCP. Most of what such a process costs before it does anything is
the interpreter importing torch (1.3-3 s of CPU on a 2-core machine, per agent, all of
them at once at a run's start). :class:`WarmStarter` starts each agent instead as a fork
of a *warm* process (``python -m controller.warm``, one per run or test session) that has
imported torch, numpy and cryptography (for a run, also what its agents import of the
project and its workload's data set reader, never an agent's own module nor any data:
:func:`_preload`); the child enters the
emulated host's network namespace when it has one (``setns``, what ``nsenter -n`` does),
starts a new session when asked, and runs the agent's module as ``__main__`` with the
agent's argv, cwd, environment and stdio, exactly as ``python -m`` would
(``runpy.run_module``), and exits through the normal interpreter exit. Every agent is still
its own process with its own pid, sockets, signals, exit status and command line (the
child writes its argv over the warm process's, so ``ps``, ``gradbed cleanup`` and
``/proc/PID/cmdline`` see ``python -m agents.dp.worker ...``); what is shared is only the
import work done before the fork.

``gradbed run`` starts its warm process (:func:`warm_for_agents`) as soon as its config is
loaded, so that torch's import overlaps the command's checks, the controller's own imports
and the network's build; closed before any agent was asked for, it is killed at once.

The warm process is started with the agents' own environment (``controller.agent_env``:
``GLIBC_TUNABLES`` and ``OMP_NUM_THREADS`` are read when the interpreter and torch load,
so they must be the warm process's own). A request whose environment differs from it, a
command that is not ``sys.executable -m MODULE ...``, or one that asks for a stderr pipe
gets a plain :class:`subprocess.Popen` (a fresh interpreter) instead, and so does every
request when ``GRADBED_WARM=0``. ``GRADBED_WARM=0`` is how to compare against, or rule out,
the warm start.

Under sudo, a torchrun run's warm process runs as the invoking user (``WarmStarter``'s
``user``: started through ``setpriv`` as a fresh rank would be, keeping only
``CAP_SYS_ADMIN``, which ``setns`` needs), so that what forks from it is never root; each
child joins its host's namespace, then drops every capability before it runs anything.

The protocol: one ``SOCK_SEQPACKET`` socket pair; the client sends one JSON request per
packet (``spawn``, with the child's stdin, stdout and stderr as three passed file
descriptors and, for a host's agent, the host's namespace as a fourth, which the client
opens as root; or ``signal``) and gets one JSON reply each (``{"pid": ...}``, or
``{"cold": why}`` for a ``cwd`` the warm process's user cannot enter: the client then
starts a fresh interpreter); the warm process holds a pidfd
per child, reaps each as it exits and sends ``{"exited": pid, "status": ...}``. When the
client goes (its end closed, or the controller killed), the warm process kills every child
it still has and exits: nothing outlives the run.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:  # the warm process itself never needs it
    from controller.run_as import RunAs

REPO = Path(__file__).resolve().parents[1]
MAX_PACKET = 1 << 20
# The warm process's own command line ends with this many bytes of padding: the room each
# child has to write its agent's argv over it (an agent's argv is a few hundred bytes).
ARGV_ROOM_BYTES = 4096
CLONE_NEWNET = 0x40000000
# Variables that may change in the test process after the warm process started and that
# nothing it imported reads at import time (the child still gets the test's value): pytest's
# per-test name; what scikit-learn sets when imported (for Intel's OpenMP, which torch's
# libgomp build does not load); the inductor cache torch sets when it first compiles;
# cuBLAS's workspace, which an agent run inside the test process sets for itself
# (agents.workloads.device, run.deterministic) and cuBLAS reads at its first handle.
_ENV_IGNORED = ("PYTEST_CURRENT_TEST", "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK",
                "TORCHINDUCTOR_CACHE_DIR", "CUBLAS_WORKSPACE_CONFIG")


# -- the warm process ------------------------------------------------------------------

def _serve(sock: socket.socket, workload: str = "") -> None:
    """The warm process: import, then fork a child per request until the client goes."""
    argv_area = warm_up(workload)
    children: dict[int, int] = {}  # pidfd -> pid
    _tell(sock, {"ready": os.getpid()})
    while True:
        waiting: list[Any] = [sock, *children]
        readable, _, _ = select.select(waiting, [], [])
        for fd in readable:
            if fd is sock:
                try:
                    msg, fds, _, _ = socket.recv_fds(sock, MAX_PACKET, 4)
                except ConnectionError:  # a shutdown with a reply unread reads as a reset
                    msg, fds = b"", []
                if not msg:  # the client went: leave nothing behind
                    for pidfd in children:
                        _try_signal(pidfd, signal.SIGKILL)
                    os._exit(0)
                req = json.loads(msg)
                if req["op"] == "spawn" and not os.access(req["cwd"], os.X_OK):
                    # A user's warm process (WarmStarter's user) cannot enter a folder
                    # that root could: a fresh start (chdir as root, then setpriv) can.
                    for f in fds:
                        os.close(f)
                    _tell(sock, {"cold": f"uid {os.getuid()} cannot enter {req['cwd']}"})
                elif req["op"] == "spawn":
                    pid = os.fork()
                    if pid == 0:
                        _become(req, fds, sock, list(children), argv_area)  # no return
                    for f in fds:
                        os.close(f)
                    children[os.pidfd_open(pid)] = pid
                    _tell(sock, {"pid": pid})
                else:  # signal: through the pidfd, so a reaped pid is never hit
                    found = next((p for p, c in children.items() if c == req["pid"]), None)
                    ok = found is not None and _try_signal(found, req["sig"])
                    _tell(sock, {"ok": ok})
            else:
                pidfd = int(fd)
                pid = children.pop(pidfd)
                _, status = os.waitpid(pid, 0)
                os.close(pidfd)
                _tell(sock, {"exited": pid, "status": status})


def warm_up(workload: str) -> tuple[int, int]:
    """What a warm process does before its first fork (this machine's, and each server's,
    ``controller.warm_remote``): import torch, numpy and cryptography and, for a
    ``workload``, what its agents import (:func:`_preload`), then freeze what the imports
    made. Returns where its command line lies (:func:`_argv_area`)."""
    import numpy  # noqa: F401  (imported for the children: the point of this process)
    import torch  # noqa: F401
    from cryptography.hazmat.primitives import poly1305  # noqa: F401

    if workload:
        _preload(workload)
    # What the imports made stays shared with the children: a child's collector would
    # otherwise write to every one of those objects' headers and copy all their pages.
    gc.freeze()
    return _argv_area()


#: ``workload`` for a warm process that serves agents of any workload (the loopback tests'
#: and benchmarks' one per process, :func:`spawn`): every workload's ``warm_imports``.
EVERY_WORKLOAD = "*"
#: What every agent of a run imports of the project before it works (its wire, handshake,
#: compressors, config and events): imported once here instead of in each agent.
AGENT_IMPORTS = ("agents.core.config", "agents.core.events", "agents.net.wire",
                 "agents.net.handshake", "agents.net.control", "agents.compress")


def _preload(workload: str) -> None:
    """Import what the agents of a run of ``workload`` import before they work: the
    modules of :data:`AGENT_IMPORTS`, the workloads' registry, and what the workload
    names in ``warm_imports`` (its data set's reader). No data is loaded: that stays each
    agent's own. A failure is logged, not raised: the agent that needs the module then
    fails on it itself, in its own log, as without the warm process."""
    import importlib
    import traceback

    try:
        for module in AGENT_IMPORTS:
            importlib.import_module(module)
        from agents.workloads.base import WORKLOADS

        for name in WORKLOADS.names() if workload == EVERY_WORKLOAD else [workload]:
            WORKLOADS.get(name).warm_imports()
    except Exception:  # noqa: BLE001 - any failure is the agent's to report
        print(f"warm process: preloading for workload {workload!r} failed (the agents "
              f"import it themselves):\n{traceback.format_exc()}", file=sys.stderr, flush=True)


def _tell(sock: socket.socket, reply: dict[str, Any]) -> None:
    try:
        sock.send(json.dumps(reply).encode())
    except ConnectionError:  # the client went; the next read sees it and cleans up
        pass


def _try_signal(pidfd: int, sig: int) -> bool:
    try:
        signal.pidfd_send_signal(pidfd, sig)
        return True
    except ProcessLookupError:
        return False


def _argv_area() -> tuple[int, int]:
    """Where this process's command line lies in its memory (``arg_start``, ``arg_end``
    of ``/proc/self/stat``): what ``/proc/PID/cmdline`` and ``ps`` read."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[45]), int(fields[46])  # fields 48 and 49; the list starts at 3


def _write_cmdline(argv: list[str], area: tuple[int, int]) -> None:
    """Put ``argv`` where the kernel reads this process's command line, NUL-separated and
    padded with NULs (cut to the room there is: the module name comes first)."""
    start, end = area
    raw = b"".join(a.encode() + b"\0" for a in argv)[: end - start - 1]
    ctypes.memmove(start, raw.ljust(end - start, b"\0"), end - start)


def _enter_netns(pid: int) -> None:
    """Join process ``pid``'s network namespace (an emulated host's), as ``nsenter -n``."""
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _setns(fd, f"pid {pid}")
    finally:
        os.close(fd)


def _setns(fd: int, whose: str) -> None:
    """Join the network namespace that ``fd`` (``/proc/PID/ns/net``, opened) stands for."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns into the network namespace of {whose}: {os.strerror(err)}")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4


def _drop_capabilities() -> None:
    """Give up every capability (ambient, inheritable, permitted, effective), as a process
    that ``setpriv`` started as the user without ``--ambient-caps`` has none: what a user's
    warm process held to enter the hosts' namespaces (setns) must not reach the user's
    torchrun, nor the ranks it starts."""
    libc = ctypes.CDLL(None, use_errno=True)
    none = (_CapData * 2)()  # version 3: two 32-bit words of each set, all zero
    if (libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0
            or libc.capset(ctypes.byref(_CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)),
                           none) != 0):
        err = ctypes.get_errno()
        raise OSError(err, f"dropping the capabilities: {os.strerror(err)}")


def _become(req: dict[str, Any], fds: list[int], sock: socket.socket,
            pidfds: list[int], argv_area: tuple[int, int]) -> None:
    """In the child: take the request's namespace, session, stdio, cwd, environment and
    argv, and run the module as ``__main__``. ``fds``: stdin, stdout, stderr and, when the
    request says ``netns_fd``, the namespace to join (opened by the client, which may
    read what this process may not: a user's warm process). A child of a warm process
    that is not root gives up every capability before it runs anything. A ``SystemExit``
    or an uncaught exception leaves through the interpreter's own exit (exit code,
    message, traceback, atexit), as ``python -m``."""
    import runpy

    sock.close()
    for pidfd in pidfds:
        os.close(pidfd)
    netns = fds[3] if req.get("netns_fd") else None
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    for fd in fds[:3]:
        if fd > 2:
            os.close(fd)
    try:
        if netns is not None:
            _setns(netns, f"host pid {req.get('netns_pid')}")
            os.close(netns)
        elif req.get("netns_pid"):
            _enter_netns(int(req["netns_pid"]))
        if req.get("new_session"):
            os.setsid()
        if os.getuid() != 0:
            _drop_capabilities()
    except OSError as e:  # the host went before its agent started: say so, as nsenter would
        print(f"warm start: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    _write_cmdline([req["executable"], "-m", req["module"], *req["args"]], argv_area)
    os.chdir(req["cwd"])
    sys.path[0] = os.getcwd()  # what ``python -m`` puts first
    os.environ.clear()
    os.environ.update(req["env"])
    sys.argv = [req["module"], *req["args"]]
    runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)


# -- the client (the test process) -----------------------------------------------------

class WarmStarter:
    """One warm process and the agents forked from it.

    env: the environment the warm process starts with, and so the one a request must carry
    to be forked (the agents' own; default this process's), but for ``free_env``: variables
    the forked program reads only once it runs, never while torch loads (the child gets the
    request's values, as every variable; torchrun's per-host ones). The warm process imports
    torch while the caller goes on (building the network, say): the first request waits
    for it. workload: a run's ``workload.name``; the warm process then also imports what
    that run's agents import (:func:`_preload`; :data:`EVERY_WORKLOAD`: what the agents of
    any workload import). Empty: torch, numpy and cryptography only. user: run the warm
    process, and so every child, as this user (``sudo gradbed torchrun``: the ranks never
    run as root); it then forks only commands that ``user.argv()`` starts (what the same
    command would be started fresh as), with that prefix taken off. It keeps
    ``CAP_SYS_ADMIN`` to enter the hosts' namespaces (setns, through a descriptor the
    client opens) and each child drops it, and every other capability, before it runs.
    """

    def __init__(self, env: Mapping[str, str] | None = None, workload: str = "",
                 free_env: Collection[str] = (), user: RunAs | None = None) -> None:
        start_env = dict(os.environ if env is None else env)
        self.free_env = frozenset(free_env)
        self.prefix = user.argv() if user is not None else []
        launch = user.argv(keep_caps=("sys_admin",)) if user is not None else []
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The warm process's stderr (what it says when a preload fails): a file with no
        # name, so that no run, not even a SIGKILLed caller's, leaves one in /tmp; the
        # caller keeps what it says in its run directory (close(keep_log=...)).
        self.log: IO[bytes] = tempfile.TemporaryFile(prefix="gradbed-warm-")
        self.env = self._env(start_env)
        self.proc = subprocess.Popen(
            [*launch, sys.executable, "-m", "controller.warm", str(theirs.fileno()),
             workload or "-", "-" * ARGV_ROOM_BYTES], cwd=REPO, env=start_env,
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=self.log,
            # A terminal's Ctrl-C or hangup is for the caller, which stops the agents
            # itself; the warm process must outlive it to report their exits.
            start_new_session=True)
        theirs.close()
        self.log_kept: Path | None = None  # where close() kept what the log says
        self.said = ""  # what the log said when close() ended the process
        self.ready = False
        self.gone = False  # the warm process ended: its children are asked directly
        self.lock = threading.Lock()  # one request and its reply at a time
        self.cond = threading.Condition()
        self.replies: list[dict[str, Any]] = []
        self.exited: dict[int, int] = {}
        atexit.register(self.close)

    def _wait_ready(self) -> None:
        self.sock.settimeout(120)
        try:
            ready = json.loads(self.sock.recv(MAX_PACKET) or b"{}")
        except TimeoutError:
            ready = {}
        if "ready" not in ready:
            raise RuntimeError(f"the warm process did not start: {self.log_text()}")
        self.sock.settimeout(None)
        self.ready = True
        threading.Thread(target=self._read, name="warm-reader", daemon=True).start()

    def _env(self, env: Mapping[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items()
                if k not in _ENV_IGNORED and k not in self.free_env}

    def _read(self) -> None:
        while True:
            try:
                msg = self.sock.recv(MAX_PACKET)
            except OSError:
                msg = b""
            with self.cond:
                if not msg:
                    self.gone = True
                    self.replies.append({"error": "the warm process is gone; it said: "
                                                  f"{self.log_text()[-2000:]!r}"})
                    self.cond.notify_all()
                    return
                m = json.loads(msg)
                if "exited" in m:
                    self.exited[m["exited"]] = m["status"]
                else:
                    self.replies.append(m)
                self.cond.notify_all()

    def request(self, req: dict[str, Any], fds: list[int] | None = None) -> dict[str, Any]:
        with self.lock:
            if not self.ready:
                self._wait_ready()
            socket.send_fds(self.sock, [json.dumps(req).encode()], fds or [])
            with self.cond:
                if not self.cond.wait_for(lambda: self.replies, timeout=60):
                    raise RuntimeError(f"the warm process did not answer {req['op']}")
                reply = self.replies.pop(0)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def can_fork(self, argv: Sequence[str], env: Mapping[str, str], stderr: Any) -> bool:
        """Whether ``argv`` with ``env`` may be a fork of this warm process (the module
        docstring says when not; a user's warm process: ``argv`` starts with its
        :attr:`prefix`)."""
        n = len(self.prefix)
        return (os.environ.get("GRADBED_WARM", "1") != "0" and list(argv[:n]) == self.prefix
                and len(argv) >= n + 3 and argv[n] == sys.executable and argv[n + 1] == "-m"
                and stderr != subprocess.PIPE and self._env(env) == self.env)

    def spawn(self, argv: Sequence[str], *, cwd: Path | str, stdin: Any = None,
              stdout: Any = None, stderr: Any = None, env: Mapping[str, str] | None = None,
              netns_pid: int | None = None, start_new_session: bool = False
              ) -> WarmProcess | None:
        """Fork ``argv`` (``[*prefix, sys.executable, "-m", module, *args]``) from the warm
        process, in ``netns_pid``'s network namespace when given; None when it may not be
        (:meth:`can_fork`, or a user's warm process cannot enter ``cwd``): the caller then
        starts a fresh interpreter. ``stdin``, ``stdout`` and ``stderr`` take what
        :class:`subprocess.Popen` takes for them
        (``PIPE`` but not for stderr, ``DEVNULL``, ``STDOUT`` for stderr, a file, or None
        to inherit)."""
        env = dict(os.environ if env is None else env)
        if not self.can_fork(argv, env, stderr):
            return None
        opened: list[int] = []  # the child's ends, closed here once passed
        mine_in, fd_in = _stdio(stdin, 0, opened)
        mine_out, fd_out = _stdio(stdout, 1, opened)
        fd_err = fd_out if stderr == subprocess.STDOUT else _stdio(stderr, 2, opened)[1]
        fds = [fd_in, fd_out, fd_err]
        if netns_pid is not None:
            try:  # opened here: a user's warm process may not open a root host's
                fds.append(os.open(f"/proc/{netns_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC))
                opened.append(fds[3])
            except OSError:
                pass  # the host is gone: the child's setns by pid says so in its log
        python = argv[len(self.prefix):]
        try:
            reply = self.request({"op": "spawn", "executable": python[0], "module": python[2],
                                  "args": list(python[3:]), "cwd": str(cwd), "env": env,
                                  "netns_pid": netns_pid, "netns_fd": len(fds) == 4,
                                  "new_session": start_new_session}, fds)
        finally:
            for fd in opened:
                os.close(fd)
        if "pid" not in reply:  # cold: a fresh interpreter instead
            for f in (mine_in, mine_out):
                if f is not None:
                    f.close()
            return None
        return WarmProcess(self, reply["pid"], list(argv), mine_in, mine_out)

    def popen_in_netns(self, argv: Sequence[str], netns_pid: int, **kw: Any
                       ) -> WarmProcess | None:
        """``topo.build.Network``'s spawner: :meth:`spawn` for a host's agent, or None
        (a fresh process) for what a fork cannot stand for."""
        if not set(kw) <= {"stdin", "stdout", "stderr", "cwd", "env", "start_new_session"}:
            return None
        return self.spawn(argv, cwd=kw.get("cwd") or os.getcwd(), stdin=kw.get("stdin"),
                          stdout=kw.get("stdout"), stderr=kw.get("stderr"),
                          env=kw.get("env"), netns_pid=netns_pid,
                          start_new_session=bool(kw.get("start_new_session")))

    def log_text(self) -> str:
        """What the warm process has written to its stderr so far."""
        try:
            return os.pread(self.log.fileno(), 1 << 20, 0).decode("utf-8", "replace")
        except (OSError, ValueError):  # closed already
            return ""

    def hang_up(self) -> None:
        """Tell the warm process to end (it kills any child it still has, then exits) and
        return at once: its exit, the teardown of a torch-sized process, then overlaps
        what the caller does next; :meth:`close` waits for it."""
        try:  # shutdown, not just close: it wakes our reader thread's recv, and the
            # warm process reads EOF, kills what is left and exits
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if not self.ready and self.proc.poll() is None:
            # Never asked for an agent, so it has no child: killed now rather than waited
            # for until its imports are done (a command that ends on a bad file or folder).
            self.proc.kill()

    def close(self, keep_log: Path | None = None) -> None:
        """End the warm process (:meth:`hang_up`) and wait for it; it kills any child it
        still has. ``keep_log``: where to keep what its log says (a run's
        ``RUN/warm.log``), written only when it says something (a preload failed);
        without it, the log goes with the process."""
        self.hang_up()
        self.sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        text = self.log_text()
        if not self.log.closed:
            self.said = text
        if text and keep_log is not None and self.log_kept is None:
            # O_EXCL | O_NOFOLLOW: never through a link planted in a user's run directory.
            fd = os.open(keep_log, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with open(fd, "w", encoding="utf-8") as f:
                f.write(text)
            self.log_kept = keep_log
        self.log.close()


class WarmProcess:
    """The :class:`subprocess.Popen` surface the loopback tests use (``pid``, ``stdin``,
    ``stdout``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``,
    ``returncode``) for a child of the warm process."""

    def __init__(self, warm: WarmStarter, pid: int, args: list[str], stdin: IO[bytes] | None,
                 stdout: IO[bytes] | None) -> None:
        self._warm = warm
        self.pid = pid
        self.args = args
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with self._warm.cond:
                status = self._warm.exited.get(self.pid)
            if status is not None:
                self.returncode = os.waitstatus_to_exitcode(status)
            elif self._warm.gone and not _alive(self.pid):
                # Its parent died before it: the exit status went to init, unknown here.
                self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._warm.cond:
            if not self._warm.cond.wait_for(
                    lambda: self.pid in self._warm.exited or self._warm.gone, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:  # an orphan: polled until it is gone
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        if self._warm.gone:  # an orphan: no pidfd left to aim through
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass
            return
        self._warm.request({"op": "signal", "pid": self.pid, "sig": int(sig)})

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:  # a zombie is not alive
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def warm_for_agents(allocator: str, workload: str) -> WarmStarter | None:
    """The warm process for one run's agents, started now (its imports run while the
    caller goes on); None when ``GRADBED_WARM=0`` (every agent a fresh interpreter).
    ``allocator``: the run's ``run.allocator``, which sets the agents' environment;
    ``workload``: its ``workload.name`` (what the agents import, :func:`_preload`)."""
    if os.environ.get("GRADBED_WARM", "1") == "0":
        return None
    from controller.agent_env import agent_environment

    return WarmStarter(agent_environment(os.environ, str(REPO), allocator), workload)


_WARM: list[WarmStarter] = []


def _stdio(spec: Any, target: int, opened: list[int]) -> tuple[IO[bytes] | None, int]:
    """For one of Popen's stdio arguments (``target`` 0, 1 or 2): our end of a pipe (or
    None) and the file descriptor to pass to the child. Descriptors opened here are added
    to ``opened``, to be closed once passed."""
    if spec is None:
        return None, target
    if spec == subprocess.PIPE:
        r, w = os.pipe()
        mine, theirs = (w, r) if target == 0 else (r, w)
        opened.append(theirs)
        return open(mine, "wb" if target == 0 else "rb"), theirs
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        opened.append(fd)
        return None, fd
    return None, spec if isinstance(spec, int) else spec.fileno()


def spawn(argv: list[str], *, cwd: Path | str, stdin: Any = None, stdout: Any = None,
          stderr: Any = None) -> subprocess.Popen[bytes] | WarmProcess:
    """A loopback agent: ``argv`` (``[sys.executable, "-m", module, *args]``) forked from
    this process's one warm process (started at the first call), or a fresh interpreter
    when it may not be (see the module docstring)."""
    if os.environ.get("GRADBED_WARM", "1") != "0" and not _WARM:
        _WARM.append(WarmStarter(workload=EVERY_WORKLOAD))
    proc = _WARM[0].spawn(argv, cwd=cwd, stdin=stdin, stdout=stdout,
                          stderr=stderr) if _WARM else None
    if proc is None:
        return subprocess.Popen(argv, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr)
    return proc


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])), "" if sys.argv[2] == "-" else sys.argv[2])
