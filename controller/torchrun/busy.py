"""Whether a host's torchrun and its ranks are still working before they reach
``init_process_group``, from the CPU time their processes use.

The stall check (``torchrun.stall_s``) reads the bytes a host's connections move. Before a
rank's first collective there are none to read: torchrun's agent imports torch, then each
rank imports torch and the script's own modules, which on a loaded 2-core machine takes
10-20 s of wall time (3 s of CPU). A host whose processes use CPU is importing or
computing, not waiting on the network, so its stall clock restarts. A rank asleep or
blocked before ``init_process_group`` uses none: its host stalls after ``stall_s`` as before.
torchrun's agent alone, polling its ranks, uses about 0.3 % of a core, far below
:data:`BUSY_CPU_FRACTION`.

:class:`BusyClock` is pure (readings in, the last busy time out); :func:`tree_cpu_s` and
:func:`descendants` read ``/proc``, one pass each.
"""

from __future__ import annotations

import os

#: A host's processes count as working while they use at least this fraction of one core
#: over a :data:`BUSY_WINDOW_S` window. An import gets about 1/6 of a core at load 12 on
#: 2 cores; torchrun's agent waiting on its ranks about 0.003.
BUSY_CPU_FRACTION = 0.05
#: The window (s) over which the CPU fraction is measured: the clock ticks of /proc are
#: 10 ms, so a second resolves 0.05 of a core to 5 ticks.
BUSY_WINDOW_S = 1.0


class BusyClock:
    """Per host, the last time (``now_ns``) its processes were working: at least
    ``fraction`` of a core over a window of ``window_s``. Fed by :meth:`update` with the
    host's total CPU seconds; a host never fed was never busy (``last_busy_ns`` 0)."""

    def __init__(self, window_s: float = BUSY_WINDOW_S,
                 fraction: float = BUSY_CPU_FRACTION) -> None:
        if window_s <= 0 or not 0 < fraction <= 1:
            raise ValueError(f"window_s must be > 0 and fraction in (0, 1], got "
                             f"{window_s}, {fraction}")
        self.window_ns = int(window_s * 1e9)
        self.fraction = fraction
        self._start: dict[str, tuple[float, int]] = {}
        self.last_busy_ns: dict[str, int] = {}

    def update(self, host: str, cpu_s: float, now_ns: int) -> None:
        """One reading: ``cpu_s``, the CPU seconds the host's processes have used so far."""
        start = self._start.get(host)
        if start is None or cpu_s < start[0]:  # first reading, or a process gone
            self._start[host] = (cpu_s, now_ns)
            return
        elapsed_ns = now_ns - start[1]
        if elapsed_ns < self.window_ns:
            return
        if (cpu_s - start[0]) >= self.fraction * elapsed_ns / 1e9:
            self.last_busy_ns[host] = now_ns
        self._start[host] = (cpu_s, now_ns)

    def busy_since(self, host: str) -> int:
        return self.last_busy_ns.get(host, 0)


def _proc_table() -> dict[int, tuple[int, float]]:
    """Every process's (parent pid, CPU seconds used so far: user + system), from one pass
    over ``/proc`` (a process that exits between the pass and its read is left out)."""
    tick = os.sysconf("SC_CLK_TCK")
    table: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            # After the command: state, ppid, ..., utime (field 14) and stime (15), 1-based.
            table[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
        except (OSError, IndexError, ValueError):
            continue
    return table


def _children(table: dict[int, tuple[int, float]]) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    return children


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first), from /proc's parent links."""
    children = _children(_proc_table())
    out, todo = [], list(children.get(pid, []))
    while todo:
        q = todo.pop(0)
        out.append(q)
        todo += children.get(q, [])
    return out


def tree_cpu_s(roots: dict[str, int]) -> dict[str, float]:
    """Per name, the CPU seconds (user + system) used so far by the process ``roots[name]``
    and every process below it, from one pass over ``/proc``."""
    table = _proc_table()
    children = _children(table)
    out: dict[str, float] = {}
    for name, root in roots.items():
        total, todo = 0.0, [root]
        while todo:
            pid = todo.pop()
            total += table[pid][1] if pid in table else 0.0
            todo += children.get(pid, [])
        out[name] = total
    return out
