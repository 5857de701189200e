"""How far another server's CLOCK_MONOTONIC is from this machine's: repeated ping-pong over
one session, keeping the sample with the smallest round trip (Cristian's algorithm).

For a sample sent at local ``t0``, stamped remotely at ``r`` and answered at local ``t1``,
the remote stamp was taken somewhere in ``[t0, t1]``, so ``offset = r - (t0 + t1) / 2``
is off by at most half the round trip ``(t1 - t0) / 2``: the smallest round trip gives the
tightest bound. :func:`best_offset` is the pure part; :func:`measure` runs it over any
command that reaches the server (``ssh ...``).
"""

from __future__ import annotations

import shlex
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

# The remote end: one CLOCK_MONOTONIC stamp (ns) per line read.
REMOTE_STAMPER = ("import sys, time\n"
                  "while sys.stdin.readline():\n"
                  "    print(time.clock_gettime_ns(time.CLOCK_MONOTONIC), flush=True)")
SAMPLES = 20


@dataclass(frozen=True)
class ClockOffset:
    """remote CLOCK_MONOTONIC - local CLOCK_MONOTONIC, within +- ``error_ns``, as measured
    at local time ``at_ns`` (the best sample's midpoint)."""

    offset_ns: int
    error_ns: int
    samples: int
    at_ns: int = 0

    def describe(self) -> dict[str, float | int | str]:
        return {"offset_s": self.offset_ns / 1e9, "error_s": self.error_ns / 1e9,
                "samples": self.samples, "offset_ns": self.offset_ns,
                "error_ns": self.error_ns, "at_ns": self.at_ns}


def best_offset(samples: Sequence[tuple[int, int, int]]) -> ClockOffset:
    """The offset from the sample ``(t0_ns, remote_ns, t1_ns)`` with the smallest round
    trip; its error is half that round trip."""
    if not samples:
        raise ValueError("no clock samples")
    for t0, _, t1 in samples:
        if t1 < t0:
            raise ValueError(f"sample answered before it was sent: t0={t0}, t1={t1}")
    t0, r, t1 = min(samples, key=lambda s: s[2] - s[0])
    return ClockOffset(offset_ns=r - (t0 + t1) // 2, error_ns=(t1 - t0 + 1) // 2,
                       samples=len(samples), at_ns=(t0 + t1) // 2)


def offset_at(start: ClockOffset, end: ClockOffset | None, remote_ns: int) -> int:
    """The offset to subtract from a remote stamp ``remote_ns``: the start's, moving
    linearly to the end's over the run when both were measured (the two clocks' rates
    differ slightly on real servers; a time namespace's offset is constant)."""
    if end is None or end.at_ns <= start.at_ns:
        return start.offset_ns
    local_ns = remote_ns - start.offset_ns
    frac = (local_ns - start.at_ns) / (end.at_ns - start.at_ns)
    frac = min(1.0, max(0.0, frac))
    return start.offset_ns + round(frac * (end.offset_ns - start.offset_ns))


def from_record(rec: dict[str, float | int | str]) -> ClockOffset | None:
    """The offset ``ClockOffset.describe`` wrote (None for a failed measurement)."""
    if "offset_ns" not in rec:
        return None
    return ClockOffset(offset_ns=int(rec["offset_ns"]), error_ns=int(rec["error_ns"]),
                       samples=int(rec["samples"]), at_ns=int(rec.get("at_ns", 0)))


def measure(via: Sequence[str], samples: int = SAMPLES, python: str = "python3",
            timeout_s: float = 30.0) -> ClockOffset:
    """Ping-pong ``samples`` times with a stamper started by ``via`` (a command that runs
    one command line on the server, e.g. ``ssh root@SERVER``)."""
    cmd = [*via, f"{python} -u -c {shlex.quote(REMOTE_STAMPER)}"]
    with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as p:
        assert p.stdin is not None and p.stdout is not None
        got: list[tuple[int, int, int]] = []
        deadline = time.monotonic() + timeout_s
        try:
            for _ in range(samples):
                t0 = time.monotonic_ns()
                try:
                    p.stdin.write("\n")
                    p.stdin.flush()
                except BrokenPipeError:
                    line = ""  # the far end is gone: said below, with its stderr
                else:
                    line = p.stdout.readline()
                t1 = time.monotonic_ns()
                if not line.strip().isdigit() or time.monotonic() > deadline:
                    err = p.stderr.read() if p.poll() is not None and p.stderr else ""
                    raise OSError(f"clock ping-pong over {' '.join(via)} failed: "
                                  f"{line.strip() or err.strip() or 'no answer'}")
                got.append((t0, int(line), t1))
        finally:
            try:
                p.stdin.close()
            except BrokenPipeError:
                pass  # the far end exited first; the error above says so
            p.wait(timeout=timeout_s)
    return best_offset(got)
