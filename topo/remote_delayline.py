"""The NFQUEUE delay line of a host on another server (``topo.netfilter.HostImpairment``).

The delay line must run where its queues are: in the host's network namespace, on the
server that owns the host. On this machine ``HostImpairment`` starts it with ``nsenter``
and watches it through a folder of its own (the ready mark, its stats, its stderr) and
``/proc``. :class:`ServerDelayLine` does the same on another server over the run's ssh:

- the folder is made there (``mktemp -d`` under :data:`DELAY_ROOT`) and read there (``cat``), then removed;
- one ssh session starts the delay line in the host's namespace there, says its pid (the
  server's), says ``ready`` once the delay line wrote its ready mark, and then waits for
  it: the session ends exactly when the delay line does, with its exit status, so
  :meth:`poll` is the delay line's liveness as seen from here;
- a signal is sent there (``kill``), and its CPU time read from that server's ``/proc``.

A delay line whose controller was killed is removed by the server's own cleanup
(``topo.cleanup`` kills ``python -m topo.delayline`` in a host's namespace).
"""

from __future__ import annotations

import select
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SSH_TIMEOUT_S = 60.0
READY = "ready"
# Each server's delay-line folders: /run is local to each machine (and private to each
# fake server of scripts/fake_cluster.sh), so what is left there is that server's.
DELAY_ROOT = "/run/gradbed/delay"


class DelayLineNotStarted(RuntimeError):
    """The delay line on the server ended, or did not get ready in time."""


class ServerDelayLine:
    """A delay line in the namespace of the process ``netns_pid`` (the host's shell, a pid
    of the server), on the server ``via`` reaches (the ssh prefix: ``ssh ... root@ip``).
    Quacks like the ``Popen`` that ``HostImpairment`` holds on this machine."""

    def __init__(self, via: Sequence[str], server: str, netns_pid: int) -> None:
        self.via = list(via)
        self.server = server
        self.netns_pid = netns_pid
        self.pid = 0  # the delay line's pid on the server, once started
        self.dir = ""
        self._session: subprocess.Popen[str] | None = None

    def _ssh(self, command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.via, command], capture_output=True, text=True,
                              timeout=SSH_TIMEOUT_S, check=False)

    def mkdtemp(self) -> str:
        """A fresh folder on the server for the ready mark, the stats and stderr."""
        p = self._ssh(f"mkdir -p {DELAY_ROOT} && mktemp -d {DELAY_ROOT}/gbdelay-XXXXXXXX")
        if p.returncode != 0 or not p.stdout.strip():
            raise DelayLineNotStarted(f"on {self.server}: mktemp failed (exit "
                                      f"{p.returncode}): {p.stderr.strip()}")
        self.dir = p.stdout.strip()
        return self.dir

    def start(self, argv: Sequence[str], ready_path: str, timeout_s: float) -> None:
        """Run ``argv`` (``python -m topo.delayline ...``) in the host's namespace there,
        its stderr into the folder; return once ``ready_path`` exists there."""
        d, ready = shlex.quote(self.dir), shlex.quote(ready_path)
        inner = shlex.join(["nsenter", "-t", str(self.netns_pid), "-n", "--", "env",
                            f"PYTHONPATH={REPO}", *argv])
        # nsenter execs the delay line, so $! is the delay line's pid.
        script = (f"cd {shlex.quote(str(REPO))} || exit 1; {inner} 2>{d}/stderr & "
                  "line=$!; echo $line; "
                  f"while ! test -e {ready}; do kill -0 $line 2>/dev/null || "
                  "{ wait $line; exit $?; }; sleep 0.01; done; "
                  f"echo {READY}; wait $line")
        self._session = subprocess.Popen([*self.via, script], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         text=True, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        first = self._line(deadline)
        self.pid = int(first) if first.isdigit() else 0
        if self._line(deadline) != READY:  # it died, or is not ready in time
            self.kill()
            raise DelayLineNotStarted(f"on {self.server}: the delay line did not start "
                                      f"(exit {self.poll()}): {self.read('stderr')}")

    def _line(self, deadline: float) -> str:
        """The session's next line, or "" at its end or the deadline."""
        assert self._session is not None and self._session.stdout is not None
        left = deadline - time.monotonic()
        ready, _, _ = select.select([self._session.stdout], [], [], max(left, 0.0))
        return self._session.stdout.readline().strip() if ready else ""

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        return None if self._session is None else self._session.poll()

    def send_signal(self, sig: int) -> None:
        if self.pid and self.poll() is None:
            self._ssh(f"kill -{int(sig)} {self.pid} 2>/dev/null")

    def wait(self, timeout: float | None = None) -> int:
        assert self._session is not None
        return self._session.wait(timeout=timeout)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
        if self._session is not None and self._session.poll() is None:
            self._session.kill()

    def read(self, name: str) -> str | None:
        """A file of the folder there, or None."""
        if not self.dir:
            return None
        p = self._ssh(f"cat {shlex.quote(self.dir + '/' + name)}")
        return p.stdout if p.returncode == 0 else None

    def cpu_s(self) -> float | None:
        """User plus system CPU seconds of the live delay line (the server's ``/proc``)."""
        p = self._ssh(f"cat /proc/{self.pid}/stat && getconf CLK_TCK") if self.pid else None
        if p is None or p.returncode != 0:
            return None
        stat, ticks = p.stdout.rsplit("\n", 2)[:2]
        fields = stat.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / int(ticks)

    def remove(self) -> None:
        if self.dir:
            self._ssh(f"rm -rf {shlex.quote(self.dir)}")
            self.dir = ""


def remove_folders() -> list[str]:
    """On a server, under its network lock: the delay-line folders a killed run left in
    :data:`DELAY_ROOT` (their delay lines are ``topo.cleanup``'s); one line per folder."""
    root = Path(DELAY_ROOT)
    gone = sorted(str(d) for d in root.glob("gbdelay-*") if d.is_dir())
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    return [f"removed delay-line folder {d}" for d in gone]
