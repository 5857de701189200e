"""Run tc, ip, ethtool and sysctl, echoing every command and raising on every failure.

This is the edge where gradbed's traffic control touches the kernel. It fixes two habits
of Mininet's ``TCIntf`` (STYLE.md): a failed ``tc`` there is logged and forgotten, and
commands run through an interactive shell (``host.cmd``) that hides exit codes. Here each
command runs with ``subprocess`` (inside a Mininet host via ``nsenter -t PID -n``), is
echoed as ``$ tc class change ...`` to a log callback (the controller copies it into the
run log, as Mahimahi opens each log with its command line), and a non-zero exit raises
``TcError`` with the command, exit code and stderr. ``dry_run=True`` records and echoes
the commands without running them, like tcconfig's ``--tc-command``.

``run_all`` feeds a namespace's consecutive ``tc`` (or ``ip``) commands to one
``tc -batch -`` (``ip -batch -``) process: a star's build is ~40 commands, each one a
``nsenter`` and a ``tc`` process (~10 ms apiece on a loaded 2-core machine), and every
Mininet test builds a network. Each command is still echoed on its own line, the batch
stops at the first that fails (as the one-by-one loop did) and the ``TcError`` names that
command, read from iproute2's ``Command failed -:LINE``.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

LogFn = Callable[[str], None]

# A tc/ip/ethtool call that takes this long is wedged (e.g. a namespace being torn down).
COMMAND_TIMEOUT_S = 20.0


class TcError(RuntimeError):
    """A traffic-control command failed; carries argv, exit code, stderr and namespace."""

    def __init__(self, argv: Sequence[str], returncode: int, stderr: str, where: str) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr.strip()
        self.where = where
        super().__init__(f"command failed in {where} (exit {returncode}): "
                         f"{shlex.join(self.argv)}: {self.stderr or '(no stderr)'}")


# Marks, on stderr, which command of a batch run on another server failed.
FAILED_MARK = "gradbed-failed-command "
# The programs whose commands go to one ``-batch -`` process per run of them.
BATCHED = ("tc", "ip")
# iproute2's batch mode names the line that failed on stderr, then stops.
_BATCH_FAILED = re.compile(r"^Command failed -:(\d+)$", re.MULTILINE)
# Characters a batch line would read differently from an argv (comments, quoting, line
# ends): a command with one of them in an argument runs on its own.
_NOT_IN_BATCH = set("#\n\\\"'")


def batchable(argv: Sequence[str]) -> str | None:
    """The program whose ``-batch`` can run ``argv`` (``tc`` or ``ip``), or None: global
    options (``tc -s ...``) and arguments with quotes, ``#`` or line ends run alone."""
    if len(argv) < 2 or argv[0] not in BATCHED or argv[1].startswith("-"):
        return None
    if any(c in _NOT_IN_BATCH for a in argv for c in a):
        return None
    return argv[0]


def batches(commands: Sequence[Sequence[str]]) -> list[tuple[str | None, list[list[str]]]]:
    """``commands`` cut into runs, in order: (program, its consecutive batchable commands)
    or (None, [one command that runs alone]). Pure."""
    out: list[tuple[str | None, list[list[str]]]] = []
    for argv in commands:
        prog = batchable(argv)
        if prog is not None and out and out[-1][0] == prog:
            out[-1][1].append(list(argv))
        else:
            out.append((prog, [list(argv)]))
    return out


@dataclass
class Tc:
    """Runs commands in one network namespace (root, or the one of process ``netns_pid``).

    log: receives one line per command, ``$ tc ...`` (plus ``  # in <host>`` when the
        command runs inside a host). None echoes nothing.
    dry_run: record and echo, but do not run; queries then return "".
    host: the host's name, used only in echoes and errors.
    via: a command that runs the rest on another server (``ssh ... root@SERVER``,
        ``topo.cluster``); () = this machine. The command goes to it as one quoted line.
    server: that server's name, used only in echoes and errors.
    """

    log: LogFn | None = None
    dry_run: bool = False
    netns_pid: int | None = None
    host: str | None = None
    via: tuple[str, ...] = ()
    server: str = ""
    # Shared between a Tc and the copies made by ``in_netns`` so a dry run of a whole
    # topology is one ordered list.
    recorded: list[list[str]] = field(default_factory=list)

    def in_netns(self, pid: int, host: str) -> Tc:
        """The same log, dry-run mode and record, aimed at the namespace of ``pid``."""
        return Tc(log=self.log, dry_run=self.dry_run, netns_pid=pid, host=host,
                  via=self.via, server=self.server, recorded=self.recorded)

    def on_server(self, via: Sequence[str], server: str) -> Tc:
        """The same namespace, log and record, on another server reached by ``via``."""
        return Tc(log=self.log, dry_run=self.dry_run, netns_pid=self.netns_pid,
                  host=self.host, via=tuple(via), server=server, recorded=self.recorded)

    @property
    def where(self) -> str:
        ns = "root namespace" if self.netns_pid is None else (
            f"host {self.host} (pid {self.netns_pid})")
        return f"{ns} on {self.server}" if self.via else ns

    def full_argv(self, argv: Sequence[str]) -> list[str]:
        inner = list(argv) if self.netns_pid is None else [
            "nsenter", "-t", str(self.netns_pid), "-n", "--", *argv]
        return [*self.via, shlex.join(inner)] if self.via else inner

    def run(self, argv: Sequence[str], *, echo: bool = True) -> str:
        """Run one command and return its stdout; raise TcError on a non-zero exit.

        echo=False is for read-only queries sampled every 100 ms (``tc -s qdisc show``),
        which would otherwise drown the commands that change state.
        """
        if not argv:
            raise ValueError("empty command")
        if echo:
            self.echo(argv)
        if self.dry_run:
            return ""
        try:
            proc = subprocess.run(self.full_argv(argv), capture_output=True, text=True,
                                  timeout=COMMAND_TIMEOUT_S, check=False)
        except FileNotFoundError as exc:
            raise TcError(argv, 127, f"{exc.filename}: not found", self.where) from exc
        except subprocess.TimeoutExpired as exc:
            raise TcError(argv, -1, f"timed out after {COMMAND_TIMEOUT_S:g} s",
                          self.where) from exc
        if proc.returncode != 0:
            raise TcError(argv, proc.returncode, proc.stderr, self.where)
        return proc.stdout

    def echo(self, argv: Sequence[str], how: str = "") -> None:
        """Record and log ``argv`` as a command of this namespace (``how``: a note on
        how it is carried out when that is not the binary, e.g. ``via netlink``)."""
        self.recorded.append(list(argv))
        if self.log is not None:
            notes = [n for n in (how, "" if self.netns_pid is None
                                 else f"in {self.host or self.netns_pid}",
                                 f"on {self.server}" if self.via else "") if n]
            suffix = f"  # {', '.join(notes)}" if notes else ""
            self.log(f"$ {shlex.join(argv)}{suffix}")

    def run_all(self, commands: Sequence[Sequence[str]]) -> None:
        """Run each command in order, stopping at the first that fails: here, each run of
        consecutive ``tc`` (``ip``) commands as one ``tc -batch -`` (:func:`batches`); on
        another server all of them in one session (one ssh round trip, not one per
        command)."""
        if not self.via or len(commands) < 2:
            for prog, group in batches(commands):
                if prog is None or len(group) < 2:
                    self.run(group[0])
                else:
                    self._run_batch(prog, group)
            return
        for argv in commands:
            self.echo(argv)
        if self.dry_run:
            return
        lines = [f"{shlex.join(Tc(netns_pid=self.netns_pid).full_argv(a))} || "
                 f"{{ rc=$?; printf '\\n{FAILED_MARK}{i}\\n' >&2; exit $rc; }}"
                 for i, a in enumerate(commands)]
        try:
            proc = subprocess.run([*self.via, "\n".join(lines)], capture_output=True,
                                  text=True, timeout=COMMAND_TIMEOUT_S * len(commands),
                                  check=False)
        except subprocess.TimeoutExpired as exc:
            raise TcError(commands[0], -1, "timed out", self.where) from exc
        if proc.returncode != 0:
            failed = [ln for ln in proc.stderr.splitlines() if ln.startswith(FAILED_MARK)]
            i = int(failed[-1][len(FAILED_MARK):]) if failed else 0
            err = "\n".join(ln for ln in proc.stderr.splitlines()
                            if not ln.startswith(FAILED_MARK))
            raise TcError(commands[i], proc.returncode, err, self.where)

    def _run_batch(self, prog: str, group: Sequence[Sequence[str]]) -> None:
        """``group`` (commands of ``prog``) through one ``prog -batch -``; a failure raises
        TcError naming the command of the line iproute2 says failed."""
        for argv in group:
            self.echo(argv)
        if self.dry_run:
            return
        lines = "".join(f"{shlex.join(a[1:])}\n" for a in group)
        try:
            proc = subprocess.run(self.full_argv([prog, "-batch", "-"]), input=lines,
                                  capture_output=True, text=True,
                                  timeout=COMMAND_TIMEOUT_S * len(group), check=False)
        except FileNotFoundError as exc:
            raise TcError(group[0], 127, f"{exc.filename}: not found", self.where) from exc
        except subprocess.TimeoutExpired as exc:
            raise TcError(group[0], -1, "timed out", self.where) from exc
        if proc.returncode != 0:
            failed = _BATCH_FAILED.findall(proc.stderr)
            line = int(failed[-1]) if failed else 1
            err = _BATCH_FAILED.sub("", proc.stderr).strip()
            raise TcError(group[min(max(line, 1), len(group)) - 1], proc.returncode, err,
                          self.where)

    def tc(self, *args: str, echo: bool = True) -> str:
        return self.run(["tc", *args], echo=echo)

    def ip(self, *args: str, echo: bool = True) -> str:
        return self.run(["ip", *args], echo=echo)

    def ethtool(self, *args: str, echo: bool = True) -> str:
        return self.run(["ethtool", *args], echo=echo)
