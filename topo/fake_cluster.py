"""Fake servers on this machine, for the cluster tests and ``benchmarks/cluster_fidelity.py``:
``scripts/fake_cluster.sh`` (the one definition a user can read and run by hand) made and
removed around a block.

Each server is a network namespace on the root bridge ``gbfc0`` with its own sshd, its own
``/run``, its own pid namespace and a CLOCK_MONOTONIC offset of N * 1000 s; the ssh key is
made for the cluster and removed with it. ``fake_cluster`` holds a lock of its own (not the network lock:
a test may build a network while its servers are up), so two users never share ``gbfc0``.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from topo.lock import NetLock

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "fake_cluster.sh"
LOCK_PATH = "/run/gradbed/fake_cluster.lock"
SUBNET = "10.99.0"
BRIDGE = "gbfc0"
MONO_STEP_S = 1000


@dataclass(frozen=True)
class FakeCluster:
    """Servers ``SUBNET.1 .. SUBNET.n``, reached with ``ssh -F ssh_config``."""

    state: Path
    n: int

    @property
    def servers(self) -> list[str]:
        return [f"{SUBNET}.{i}" for i in range(1, self.n + 1)]

    @property
    def ssh_config(self) -> Path:
        return self.state / "ssh_config"

    @property
    def key_path(self) -> Path:
        return self.state / "id_ed25519"

    def sshd_pid(self, server: str) -> int:
        """The pid, in this machine's pid namespace, of ``server``'s sshd (pid 1 of the
        server's own): the child of the launcher (``unshare``, which waits for it)."""
        i = self.servers.index(server) + 1
        launcher = (self.state / f"s{i}" / "launcher.pid").read_text().strip()
        out = subprocess.run(["pgrep", "-P", launcher], capture_output=True, text=True,
                             check=True).stdout.split()
        return int(out[0])

    def ssh(self, server: str, command: str, timeout_s: float = 30.0
            ) -> subprocess.CompletedProcess[str]:
        """Run ``command`` on ``server`` over its sshd; raises on a non-zero exit."""
        return subprocess.run(["ssh", "-F", str(self.ssh_config), server, command],
                              capture_output=True, text=True, timeout=timeout_s, check=True)


def _script(*args: str) -> None:
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"fake_cluster.sh {' '.join(args)} failed ({proc.returncode}):\n"
                           f"{proc.stdout}{proc.stderr}")


@contextmanager
def fake_cluster(state: Path, n: int = 2) -> Iterator[FakeCluster]:
    """``n`` fake servers for the block, removed (keys included) when it ends."""
    with NetLock(LOCK_PATH, timeout_s=600):
        _script("down", str(state))  # what a killed test left behind
        try:
            _script("up", str(state), str(n))
            yield FakeCluster(state, n)
        finally:
            _script("down", str(state))


def leftovers(state: Path) -> list[str]:
    """What ``fake_cluster`` must not leave: its namespaces, bridge, veths, state files."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True,
                           text=True).stdout
    out = [f"netns {ln.split()[0]}" for ln in netns.splitlines() if ln.startswith("gbfc-")]
    out += [f"link {ln.split(':')[1].strip().split('@')[0]}" for ln in links.splitlines()
            if ln.split(":")[1].strip().startswith(("gbfc", BRIDGE))]
    if state.exists():
        out.append(f"state {state}")
    return out
