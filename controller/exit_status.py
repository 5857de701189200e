"""What a gradbed command's exit status means: one table, used by every command.

A script or a sweep that checks ``$?`` must tell a completed run from one that timed out,
lost its PS or never started; ``summary.json``'s ``stop_reason`` says why a run ended and
:func:`status_for` turns it into the status. The stop reasons that carry a class are made
here too (:func:`timeout_reason`, :func:`signal_reason`, :func:`failed_start_reason`), so
the words the runner writes and the words this module reads are defined once.

=====  ==========================================================================
0      completed (with ``run.on_agent_death = "continue"``, the agents lost on the
       way are listed in the summary's ``workers_lost``)
1      failed otherwise: an error the rest of the table does not name (the model
       became non-finite, the controller itself failed mid-run); ``stop_reason``
       says what
2      config or usage error (nothing was started)
3      failed start: the network or an agent did not come up
4      an agent or rank lost (exited, killed, or declared lost), and the run stopped
5      timed out (``run.timeout_s``)
6      a server lost (a run over several servers; its control connection ended)
128+n  killed by signal n (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP); the run directory
       is still complete
=====  ==========================================================================
"""

from __future__ import annotations

import re
import signal

COMPLETED = 0
FAILED = 1
USAGE = 2
FAILED_START = 3
AGENT_LOST = 4
TIMED_OUT = 5
SERVER_LOST = 6
SIGNAL_BASE = 128

#: (status, meaning) in the order the help and the docs show them.
TABLE: tuple[tuple[str, str], ...] = (
    ("0", "completed (with run.on_agent_death = \"continue\", lost agents are listed in "
          "the summary)"),
    ("1", "failed otherwise (the summary's stop_reason says what)"),
    ("2", "config or usage error; nothing was started"),
    ("3", "failed start: the network or an agent did not come up"),
    ("4", "an agent or rank lost, and the run stopped"),
    ("5", "timed out (run.timeout_s)"),
    ("6", "a server lost (a run over several servers; its control connection ended)"),
    ("128+n", "killed by signal n (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP); the run "
              "directory is complete"),
)

TIMEOUT_PREFIX = "timeout after"
INTERRUPTED = "interrupted"
FAILED_START_PREFIX = "failed to start:"
SERVER_LOST_PREFIX = "server lost"
FAILED_PREFIX = "failed:"
#: A controller that died without a word (SIGKILL); ``gradbed cleanup`` writes this.
CONTROLLER_KILLED = "controller killed"
# How the runner and the agents say that an agent is gone: an ending role's process
# exited ("ps exited with status -9"), the PS dropped a worker under "stop" ("worker 1
# died: ...", "no active workers"), a role was declared lost, or a torchrun rank stalled.
_AGENT_LOST = re.compile(r"exited with status|\bdied\b|\blost\b|\bstalled\b|no active workers")
_SIGNAL = re.compile(r"^interrupted by (SIG[A-Z0-9]+)")


def timeout_reason(timeout_s: float) -> str:
    return f"{TIMEOUT_PREFIX} {timeout_s:g} s"


def signal_reason(signum: int) -> str:
    """``interrupted by SIGTERM``: the stop reason of a run a signal ended."""
    return f"{INTERRUPTED} by {signal.Signals(signum).name}"


def failed_start_reason(error: str) -> str:
    return f"{FAILED_START_PREFIX} {error}"


def status_for(stop_reason: str) -> int:
    """The exit status of a run whose summary says ``stop_reason`` (the table above)."""
    reason = stop_reason.strip()
    if reason in ("", "completed"):
        return COMPLETED
    if reason.startswith(TIMEOUT_PREFIX):
        return TIMED_OUT
    if reason.startswith(INTERRUPTED):
        m = _SIGNAL.match(reason)
        signum = signal.Signals[m.group(1)] if m and m.group(1) in signal.Signals.__members__ \
            else signal.SIGINT  # a bare "interrupted" is Ctrl-C (older runs wrote only that)
        return SIGNAL_BASE + int(signum)
    if reason == CONTROLLER_KILLED:
        return SIGNAL_BASE + int(signal.SIGKILL)
    if reason.startswith(FAILED_START_PREFIX):
        return FAILED_START
    if reason.startswith(SERVER_LOST_PREFIX):
        return SERVER_LOST
    if reason.startswith(FAILED_PREFIX):
        return FAILED  # the controller's own error, whatever words its message has
    if _AGENT_LOST.search(reason):
        return AGENT_LOST
    return FAILED


def help_text() -> str:
    """The table as ``gradbed run -h`` shows it."""
    width = max(len(s) for s, _ in TABLE)
    return "exit status:\n" + "\n".join(f"  {s:<{width}}  {m}" for s, m in TABLE)
