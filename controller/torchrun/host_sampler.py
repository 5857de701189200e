"""The ranks' watch on another server: ``python -m controller.torchrun.host_sampler SPEC``
runs there (over the run's ssh connection) and does, in the namespaces of that server's
training hosts, what :class:`controller.torchrun.sockdiag.ConnSampler` does for the hosts
of the controller's machine: sock_diag dumps and destroy broadcasts, plus each host's
torchrun tree's CPU time (the stall check's "still importing torch") and, at the end, the
host interface's byte counters (the bytes proof).

It writes one JSON object per line on stdout, on that server's CLOCK_MONOTONIC (the
controller moves ``ts_ns`` onto its own with the server's measured offset):

- ``{"ready": true}`` once every host's sockets are open: the controller starts the
  ranks only then, so no connection's destroy message is missed;
- ``{"host": H, "ts_ns": T, "conns": [ConnSample fields...], "cpu_s": C}`` per host and
  sample (``cpu_s`` null until the host's torchrun has written its pid file);
- once its stdin closes (the controller's end of the watch): the last destroy messages
  and the counters, ``{"host": H, ..., "iface": [rx_bytes, tx_bytes]}``, then
  ``{"end": true}``; ``{"error": "..."}`` for anything that stopped it.

It imports neither torch nor pandas: it starts in a fraction of a second.
"""

from __future__ import annotations

import json
import math
import os
import select
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from typing import IO, Any

from agents.core.events import now_ns
from controller.torchrun.busy import tree_cpu_s
from controller.torchrun.sockdiag import ConnSample, HostDiag, interface_bytes
from controller.torchrun.stop import read_pid

PERIOD_S = 0.2


@dataclass(frozen=True)
class WatchedHost:
    """One training host on the server: its namespace's pid there, its interface and the
    file its torchrun's pid is written to (by the command that starts it)."""

    name: str
    netns_pid: int
    dev: str
    pid_file: str


def encode_spec(hosts: Iterable[WatchedHost], period_s: float = PERIOD_S) -> str:
    """The program's one argument (pure)."""
    return json.dumps({"period_s": period_s, "hosts": [asdict(h) for h in hosts]})


def decode_spec(text: str) -> tuple[list[WatchedHost], float]:
    d = json.loads(text)
    return [WatchedHost(**h) for h in d["hosts"]], float(d["period_s"])


def sample_line(host: str, ts_ns: int, conns: Iterable[ConnSample], cpu_s: float | None,
                iface: tuple[int, int] | None = None) -> str:
    """One host's sample as the line the controller reads (pure)."""
    row: dict[str, Any] = {"host": host, "ts_ns": ts_ns,
                           "conns": [asdict(c) for c in conns], "cpu_s": cpu_s}
    if iface is not None:
        row["iface"] = list(iface)
    return json.dumps(row)


#: The longest line the controller reads from a server's watch: a sample of one host
#: with thousands of connections fits; a server that sends endless bytes without a
#: newline is refused instead of filling the controller's memory.
MAX_LINE_CHARS = 4 << 20


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _conn(c: Any) -> ConnSample:
    """One ``conns`` entry as a :class:`ConnSample`; ValueError naming the bad field."""
    if not isinstance(c, dict):
        raise ValueError(f"a connection that is not an object: {str(c)[:80]!r}")
    kinds = {f.name: str(f.type) for f in fields(ConnSample)}
    if unknown := sorted(set(c) - set(kinds)):
        raise ValueError(f"a connection with unknown field(s) {', '.join(unknown)}")
    required = [f.name for f in fields(ConnSample) if f.default is MISSING]
    if missing := sorted(n for n in required if n not in c):
        raise ValueError(f"a connection without {', '.join(missing)}")
    for name, value in c.items():
        ok = {"int": _is_int(value) and value >= 0, "str": isinstance(value, str),
              "bool": isinstance(value, bool),
              "float": isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value)}[kinds[name]]
        if not ok:
            raise ValueError(f"a connection's {name} is {str(value)[:40]!r}, not a "
                             f"{'non-negative int' if kinds[name] == 'int' else kinds[name]}")
    return ConnSample(**c)


def parse_line(line: str) -> dict[str, Any]:
    """A line of the program's output as the controller uses it: ``conns`` as
    :class:`ConnSample`, ``iface`` as a pair of ints; ValueError naming what is wrong
    (pure). The line comes from another machine over the network: every field is
    checked, none is trusted."""
    try:
        row = json.loads(line)
    except ValueError:
        raise ValueError(f"not JSON: {line[:200]!r}") from None
    if not isinstance(row, dict):
        raise ValueError(f"not an object: {line[:200]!r}")
    if "error" in row and not isinstance(row["error"], str):
        raise ValueError(f"an error that is not a string: {line[:200]!r}")
    if "host" not in row:
        return row
    if not isinstance(row["host"], str):
        raise ValueError(f"a sample whose host is not a string: {line[:200]!r}")
    if not _is_int(row.get("ts_ns")) or not isinstance(row.get("conns"), list):
        raise ValueError(f"a sample without ts_ns or conns: {line[:200]!r}")
    try:
        row["conns"] = [_conn(c) for c in row["conns"]]
    except ValueError as e:
        raise ValueError(f"host {row['host']}: {e}: {line[:200]!r}") from None
    cpu = row.get("cpu_s")
    if cpu is not None and not (isinstance(cpu, (int, float)) and not isinstance(cpu, bool)
                                and math.isfinite(cpu) and cpu >= 0):
        raise ValueError(f"host {row['host']}: cpu_s is {str(cpu)[:40]!r}, not a "
                         f"non-negative number: {line[:200]!r}")
    if "iface" in row:
        iface = row["iface"]
        if not (isinstance(iface, list) and len(iface) == 2
                and all(_is_int(v) and v >= 0 for v in iface)):
            raise ValueError(f"host {row['host']}: iface is {str(iface)[:40]!r}, not "
                             f"[rx_bytes, tx_bytes]: {line[:200]!r}")
        row["iface"] = (iface[0], iface[1])
    return row


class _Watch:
    def __init__(self, hosts: list[WatchedHost], out: IO[str]) -> None:
        self.hosts = hosts
        self.out = out
        self.diags = {h.name: HostDiag(h.name, h.netns_pid) for h in hosts}

    def _emit(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()

    def _cpu(self) -> Mapping[str, float]:
        roots = {h.name: pid for h in self.hosts if (pid := read_pid(h.pid_file)) is not None}
        return tree_cpu_s(roots) if roots else {}

    def sample(self) -> None:
        cpu = self._cpu()
        for h in self.hosts:
            d = self.diags[h.name]
            conns = [*d.destroyed(), *d.dump()]
            self._emit(sample_line(h.name, now_ns(), conns, cpu.get(h.name)))

    def final(self) -> None:
        for h in self.hosts:
            iface = interface_bytes(h.netns_pid, h.dev)
            conns = list(self.diags[h.name].destroyed())
            self._emit(sample_line(h.name, now_ns(), conns, None, iface))

    def close(self) -> None:
        for d in self.diags.values():
            d.close()


def watch(hosts: list[WatchedHost], period_s: float, stdin: IO[bytes], out: IO[str]) -> None:
    """Sample every ``period_s`` until ``stdin`` ends, then the final lines."""
    w = _Watch(hosts, out)
    try:
        w._emit(json.dumps({"ready": True}))
        while True:
            w.sample()
            ready, _, _ = select.select([stdin], [], [], period_s)
            if ready and not os.read(stdin.fileno(), 4096):
                break
        time.sleep(0.2)  # the kernel's last destroy messages
        w.final()
        w._emit(json.dumps({"end": True}))
    finally:
        w.close()


def main(argv: list[str]) -> int:
    try:
        hosts, period_s = decode_spec(argv[0])
        watch(hosts, period_s, sys.stdin.buffer, sys.stdout)
    except Exception as e:  # said to the controller, which notes it in the summary
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
