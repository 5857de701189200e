"""Cap agent processes' CPU with a cgroup, for tests that make the agents the bottleneck.

cgroup v2's ``cpu.max`` where the v2 hierarchy has the cpu controller; otherwise the v1
cpu controller's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, the same CFS bandwidth
limit under its older name (this machine mounts cpu on v1). :func:`cap_when_connected`
moves a run's agents in once each host holds a TCP connection on the run's port (a worker's
to the PS, a stage's to the pipeline's PS, an MoE host's in the mesh), so their start
(importing torch) runs at full speed and only the training is capped.
:func:`cap_rank_after_event` does the same for a ``gradbed torchrun`` rank once its
instrumented script has logged an event, since a rank's host also holds torchrun's
rendezvous connections before the rank has imported torch.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

V2_ROOT = Path("/sys/fs/cgroup")
V2_UNIFIED = Path("/sys/fs/cgroup/unified")
V1_CPU = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def _v2_root() -> Path | None:
    for root in (V2_ROOT, V2_UNIFIED):
        ctl = root / "cgroup.controllers"
        if ctl.exists() and "cpu" in ctl.read_text().split():
            return root
    return None


def cpu_cap_kind() -> str | None:
    """``"v2"``, ``"v1"`` or None (no cgroup CPU bandwidth control here)."""
    if _v2_root() is not None:
        return "v2"
    if (V1_CPU / "cpu.cfs_quota_us").exists():
        return "v1"
    return None


class CpuCap:
    """A cgroup whose processes together get at most ``cores`` CPUs. A context manager:
    on exit its processes go back to the parent and the cgroup is removed."""

    def __init__(self, name: str, cores: float) -> None:
        kind = cpu_cap_kind()
        if kind is None:
            raise RuntimeError("no cgroup CPU controller (cgroup v2 cpu.max or v1 cpu)")
        self.kind = kind
        self.parent = _v2_root() if kind == "v2" else V1_CPU
        assert self.parent is not None
        self.path = self.parent / name
        self.quota_us = max(1000, round(cores * PERIOD_US))
        self.pids: list[int] = []

    def __enter__(self) -> CpuCap:
        self.path.mkdir(exist_ok=True)
        if self.kind == "v2":
            (self.path / "cpu.max").write_text(f"{self.quota_us} {PERIOD_US}")
        else:
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(self.quota_us))
        return self

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))
        self.pids.append(pid)

    def lift(self) -> None:
        """No limit any more; the processes stay in the cgroup (its cpu.stat still counts)."""
        if self.kind == "v2":
            (self.path / "cpu.max").write_text(f"max {PERIOD_US}")
        else:
            (self.path / "cpu.cfs_quota_us").write_text("-1")

    def throttled_us(self) -> int:
        """Time the cgroup's processes waited for their quota (cpu.stat)."""
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        return int(stat.get("throttled_usec", int(stat.get("throttled_time", 0)) // 1000))

    def __exit__(self, *exc: object) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                (self.parent / "cgroup.procs").write_text(pid)
            except OSError:
                pass  # it exited meanwhile
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def _connected_to(pid: int, port: int) -> bool:
    """Whether the network namespace of process ``pid`` (its Mininet host) holds an
    established TCP connection with either end on ``port``: a client of a listener on
    ``port`` (a worker to the PS), or that listener's side of one (the first MoE host, which
    only accepts)."""
    try:
        lines = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    for ln in lines:
        f = ln.split()
        if len(f) > 3 and f[3] == "01" and port in (int(f[1].split(":")[1], 16),
                                                    int(f[2].split(":")[1], 16)):
            return True
    return False


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (kv.decode(errors="replace").partition("=") for kv in raw.split(b"\0") if kv)
    return {k: v for k, _, v in pairs}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def cap_when_connected(cap: CpuCap, marker: str, module: str, port: int, count: int,
                       stop: threading.Event, timeout_s: float = 120.0) -> threading.Thread:
    """Start a thread that moves every process running ``module`` whose command line
    contains ``marker`` (the run's output folder) into ``cap`` once it is connected to
    ``port``, until ``count`` were moved or ``stop`` is set."""

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        moved: set[int] = set()
        while len(moved) < count and not stop.is_set() and time.monotonic() < deadline:
            for d in os.listdir("/proc"):
                if not d.isdigit() or int(d) in moved:
                    continue
                cmd = _cmdline(int(d))
                if module in cmd and marker in cmd and _connected_to(int(d), port):
                    try:
                        cap.add(int(d))
                        moved.add(int(d))
                    except OSError:
                        pass
            stop.wait(0.05)

    t = threading.Thread(target=watch, name="cpu-cap", daemon=True)
    t.start()
    return t


def cap_rank_after_event(cap: CpuCap, out: Path, host: str, event: str, lift: str,
                         stop: threading.Event, timeout_s: float = 120.0
                         ) -> tuple[threading.Thread, list[int]]:
    """Start a thread that moves the ``gradbed torchrun`` rank on ``host`` of a run under
    ``out`` (the process with ``RANK`` in its environment, not torchrun's agent) into
    ``cap`` as soon as the run's ``events/HOST.jsonl`` holds an ``event`` (the
    instrumentation's ``ddp_iter``): by then the rank has imported torch and joined its
    process group. Once the log holds the line ``lift`` (a fragment of the last bucket's
    event) the cap is lifted, so the rank's exit (torch's teardown) runs at full speed.
    The list it returns receives the CLOCK_MONOTONIC times of the move and of the lift,
    so a test can check which of the rank's iterations ran capped."""
    times_ns: list[int] = []
    needle = f'"event": "{event}"'

    def find() -> tuple[int, Path] | None:
        for d in filter(str.isdigit, os.listdir("/proc")):
            env = _environ(int(d))
            run_dir = env.get("GRADBED_RUN_DIR", "")
            if env.get("GRADBED_HOST") == host and "RANK" in env \
                    and run_dir.startswith(str(out)):
                return int(d), Path(run_dir) / "events" / f"{host}.jsonl"
        return None

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        found = None
        while found is None and not stop.is_set() and time.monotonic() < deadline:
            found = find()
            stop.wait(0.05)
        while found is not None and not stop.is_set() and time.monotonic() < deadline:
            try:
                text = found[1].read_text(errors="replace")
            except OSError:
                text = ""  # not written yet
            if not times_ns and needle in text:
                cap.add(found[0])
                times_ns.append(time.monotonic_ns())
            if times_ns and lift in text:
                cap.lift()
                times_ns.append(time.monotonic_ns())
                return
            stop.wait(0.01)

    t = threading.Thread(target=watch, name="cpu-cap-rank", daemon=True)
    t.start()
    return t, times_ns


def capped_run(name: str, module: str, port: int, count: int, config: str,
               overrides: list[str], out: Path) -> Path:
    """``gradbed run CONFIG`` with the ``count`` processes of ``module`` sharing a fifth of
    a core (cgroup ``name``) from their connection to ``port`` on; the run must complete,
    every one of them be capped and the cap bite. Returns the run directory."""
    from tests.support.mininet_run import gradbed_run

    stop = threading.Event()
    with CpuCap(name, cores=0.2) as cap:
        watcher = cap_when_connected(cap, str(out), module, port, count, stop, timeout_s=900)
        try:
            # The timeout leaves room for the machine-wide network lock (600 s).
            run_dir, proc = gradbed_run(config, overrides, out, timeout_s=900)
        finally:
            stop.set()
            watcher.join(timeout=5)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert len(cap.pids) == count, f"capped {cap.pids}"
        assert cap.throttled_us() > 0, "the cap never bit"
    return run_dir


def assert_agent_limited(run_dir: Path, who: str) -> None:
    """A capped run's summary reads agent-limited with its busy fraction, and its report
    says so in words naming ``who`` held the data (``analysis.report.regime``)."""
    import re
    import tomllib

    from analysis.report import regime
    from tests.support.mininet_run import summary

    run_summary = summary(run_dir)
    why = run_summary["agent_limited_why"]
    assert run_summary["agent_limited"] is True, why
    assert re.match(r"agent-limited: the (gbh\d\.(up|down)|links .*) (was|were) busy 0\.\d\d",
                    why), why
    words = regime(run_summary, tomllib.loads((run_dir / "config.toml").read_text()))
    assert "<b>Agent-limited run.</b>" in words, words
    assert f"describe gradbed&#x27;s {who} on this machine" in words, words
