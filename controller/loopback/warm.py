"""Agent processes forked from one warm interpreter, for loopback runs (tests, benchmarks).

A loopback test starts its agents (``python -m agents.dp.ps``, ``agents.dp.worker``,
``agents.pipeline.stage``, ``agents.pipeline.stage_ps``, ``agents.moe.expert``) as real processes talking real TCP.
Most of what such a process costs is the interpreter importing torch (1.3-3 s of CPU on
the 2-core test machine, against tens of milliseconds of training in a transparency run),
and the suite starts about 90 of them. :func:`spawn` starts each one instead as a fork of
a *warm* process (``python -m controller.loopback.warm``, one per test session) that has imported
torch, numpy and cryptography and nothing of the project; the child then runs the
agent's module as ``__main__`` with the test's argv, cwd, environment and stdio, exactly
as ``python -m`` would (``runpy.run_module``), and exits through the normal interpreter
exit. Every agent is still its own process with its own pid, sockets, signals and exit
status; what is shared is only the import work done before the fork.

:func:`spawn` falls back to a plain :class:`subprocess.Popen` (a fresh interpreter) when
``GRADBED_TEST_WARM=0``, when the command is not ``sys.executable -m MODULE ...`` or asks
for a stderr pipe, or when the test's environment differs from the one the warm process
was started with (a variable read at import time would otherwise be missed; see
``_ENV_IGNORED``). The Mininet tests and the CLI tests always start fresh interpreters.

The protocol: one ``SOCK_SEQPACKET`` socket pair; the client sends one JSON request per
packet (``spawn``, with the child's stdin, stdout and stderr as three passed file
descriptors, or ``signal``) and gets one JSON reply each; the warm process holds a pidfd
per child, reaps each as it exits and sends ``{"exited": pid, "status": ...}``.
"""

from __future__ import annotations

import atexit
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
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[2]
MAX_PACKET = 1 << 20
# Variables that may change in the test process after the warm process started and that
# nothing it imported reads at import time (the child still gets the test's value): pytest's
# per-test name; what scikit-learn sets when imported (for Intel's OpenMP, which torch's
# libgomp build does not load); the inductor cache torch sets when it first compiles.
_ENV_IGNORED = ("PYTEST_CURRENT_TEST", "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK",
                "TORCHINDUCTOR_CACHE_DIR")


# -- the warm process ------------------------------------------------------------------

def _serve(sock: socket.socket) -> None:
    """The warm process: import, then fork a child per request until the client goes."""
    import numpy  # noqa: F401  (imported for the children: the point of this process)
    import torch  # noqa: F401
    from cryptography.hazmat.primitives import poly1305  # noqa: F401

    # What the imports made stays shared with the children: a child's collector would
    # otherwise write to every one of those objects' headers and copy all their pages.
    gc.freeze()
    children: dict[int, int] = {}  # pidfd -> pid
    sock.send(json.dumps({"ready": os.getpid()}).encode())
    while True:
        waiting: list[Any] = [sock, *children]
        readable, _, _ = select.select(waiting, [], [])
        for fd in readable:
            if fd is sock:
                msg, fds, _, _ = socket.recv_fds(sock, MAX_PACKET, 3)
                if not msg:  # the client went: leave nothing behind
                    for pidfd in children:
                        _try_signal(pidfd, signal.SIGKILL)
                    os._exit(0)
                req = json.loads(msg)
                if req["op"] == "spawn":
                    pid = os.fork()
                    if pid == 0:
                        _become(req, fds, sock, list(children))  # does not return
                    for f in fds:
                        os.close(f)
                    children[os.pidfd_open(pid)] = pid
                    sock.send(json.dumps({"pid": pid}).encode())
                else:  # signal: through the pidfd, so a reaped pid is never hit
                    found = next((p for p, c in children.items() if c == req["pid"]), None)
                    ok = found is not None and _try_signal(found, req["sig"])
                    sock.send(json.dumps({"ok": ok}).encode())
            else:
                pidfd = int(fd)
                pid = children.pop(pidfd)
                _, status = os.waitpid(pid, 0)
                os.close(pidfd)
                sock.send(json.dumps({"exited": pid, "status": status}).encode())


def _try_signal(pidfd: int, sig: int) -> bool:
    try:
        signal.pidfd_send_signal(pidfd, sig)
        return True
    except ProcessLookupError:
        return False


def _become(req: dict[str, Any], fds: list[int], sock: socket.socket,
            pidfds: list[int]) -> None:
    """In the child: take the request's stdio, cwd, environment and argv, and run the
    module as ``__main__``. A ``SystemExit`` or an uncaught exception leaves through the
    interpreter's own exit (exit code, message, traceback, atexit), as ``python -m``."""
    import runpy

    sock.close()
    for pidfd in pidfds:
        os.close(pidfd)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(req["cwd"])
    sys.path[0] = os.getcwd()  # what ``python -m`` puts first
    os.environ.clear()
    os.environ.update(req["env"])
    sys.argv = [req["module"], *req["args"]]
    runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)


# -- the client (the test process) -----------------------------------------------------

class _Warm:
    """The test process's end: one warm process, started at the first :func:`spawn`."""

    def __init__(self) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = Path(tempfile.gettempdir()) / f"gradbed-warm-{os.getpid()}.log"
        self.env = self._env(os.environ)
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "controller.loopback.warm", str(theirs.fileno())], cwd=REPO,
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=err)
        theirs.close()
        self.sock.settimeout(120)
        ready = json.loads(self.sock.recv(MAX_PACKET) or b"{}")
        if "ready" not in ready:
            raise RuntimeError(f"the warm process did not start: {self.log.read_text()}")
        self.sock.settimeout(None)
        self.lock = threading.Lock()  # one request and its reply at a time
        self.cond = threading.Condition()
        self.replies: list[dict[str, Any]] = []
        self.exited: dict[int, int] = {}
        threading.Thread(target=self._read, name="warm-reader", daemon=True).start()
        atexit.register(self.close)

    @staticmethod
    def _env(env: Any) -> dict[str, str]:
        return {k: v for k, v in env.items() if k not in _ENV_IGNORED}

    def _read(self) -> None:
        while True:
            try:
                msg = self.sock.recv(MAX_PACKET)
            except OSError:
                msg = b""
            with self.cond:
                if not msg:
                    self.replies.append({"error": "the warm process is gone "
                                                  f"(its log: {self.log})"})
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
            socket.send_fds(self.sock, [json.dumps(req).encode()], fds or [])
            with self.cond:
                if not self.cond.wait_for(lambda: self.replies, timeout=60):
                    raise RuntimeError(f"the warm process did not answer {req['op']}")
                reply = self.replies.pop(0)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def close(self) -> None:
        try:  # shutdown, not just close: it wakes our reader thread's recv, and the
            # warm process reads EOF, kills what is left and exits
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.log.exists() and self.log.stat().st_size == 0:  # kept only if it says why
            self.log.unlink()


class WarmProcess:
    """The :class:`subprocess.Popen` surface the loopback tests use (``pid``, ``stdin``,
    ``stdout``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``,
    ``returncode``) for a child of the warm process."""

    def __init__(self, warm: _Warm, pid: int, args: list[str], stdin: IO[bytes] | None,
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
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._warm.cond:
            if not self._warm.cond.wait_for(lambda: self.pid in self._warm.exited, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        rc = self.poll()
        assert rc is not None
        return rc

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            self._warm.request({"op": "signal", "pid": self.pid, "sig": int(sig)})

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_WARM: list[_Warm] = []


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
    """Start ``argv`` (``[sys.executable, "-m", module, *args]``) as a child of the warm
    process, or as a fresh interpreter (see the module docstring). ``stdin``, ``stdout``
    and ``stderr`` take what :class:`subprocess.Popen` takes for them (``PIPE`` but not
    for stderr, ``DEVNULL``, ``STDOUT`` for stderr, a file, or None to inherit)."""
    warm_ok = (os.environ.get("GRADBED_TEST_WARM", "1") != "0" and len(argv) >= 3
               and argv[0] == sys.executable and argv[1] == "-m" and stderr != subprocess.PIPE)
    if warm_ok and _WARM and _WARM[0].env != _WARM[0]._env(os.environ):
        warm_ok = False
    if not warm_ok:
        return subprocess.Popen(argv, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr)
    if not _WARM:
        _WARM.append(_Warm())
    warm = _WARM[0]
    opened: list[int] = []  # the child's ends, closed here once passed
    mine_in, fd_in = _stdio(stdin, 0, opened)
    mine_out, fd_out = _stdio(stdout, 1, opened)
    fd_err = fd_out if stderr == subprocess.STDOUT else _stdio(stderr, 2, opened)[1]
    try:
        reply = warm.request({"op": "spawn", "module": argv[2], "args": argv[3:],
                              "cwd": str(cwd), "env": dict(os.environ)},
                             [fd_in, fd_out, fd_err])
    finally:
        for fd in opened:
            os.close(fd)
    return WarmProcess(warm, reply["pid"], argv, mine_in, mine_out)


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))
