"""The fake servers the cluster tests run on (``scripts/fake_cluster.sh``): each really is
apart (its own address, sshd, /run and monotonic clock), takes only its key, and leaves
nothing behind. Root; marked ``mininet`` for the lock and the skip without root."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from topo.fake_cluster import MONO_STEP_S, fake_cluster, leftovers

pytestmark = [pytest.mark.mininet,
              pytest.mark.skipif(not Path("/usr/sbin/sshd").exists(),
                                 reason="no sshd: GRADBED_WITH_SSHD=1 scripts/setup.sh")]


# Run on a server: its pid namespace, then the command name of each ancestor of the
# session's shell up to its pid namespace's first process.
_LINEAGE = ("readlink /proc/self/ns/pid; p=$$; while [ \"$p\" -gt 1 ]; do "
            "p=$(cut -d' ' -f4 /proc/$p/stat); cat /proc/$p/comm; done")


def _commands_in(pidns: str) -> list[str]:
    """The command names of every process in pid namespace ``pidns``."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and os.readlink(proc / "ns" / "pid") == pidns:
                out.append((proc / "comm").read_text().strip())
        except OSError:
            continue  # gone meanwhile
    return out


def test_three_servers_are_apart_take_only_their_key_and_leave_nothing(tmp_path: Path):
    state = tmp_path / "cluster"
    with fake_cluster(state, n=3) as c:
        for i, server in enumerate(c.servers, start=1):
            # Its own sshd, first of its own pid namespace: a session descends from it.
            pidns, *lineage = c.ssh(server, _LINEAGE).stdout.split()
            sshd = c.sshd_pid(server)
            assert pidns == os.readlink(f"/proc/{sshd}/ns/pid")
            assert lineage[-1] == "sshd" and Path(f"/proc/{sshd}/comm").read_text() == "sshd\n"
            # Its own address, CLOCK_MONOTONIC (N * 1000 s ahead of this machine's) and
            # /run: a file made there is on no other server and not here.
            before = time.monotonic()
            addr, there, marks = c.ssh(server, (
                "ip -4 -o addr show dev ctl0; python3 -c 'import time; "
                f"print(time.monotonic())'; ls /run/gbfc-mark-* 2>/dev/null | wc -l; "
                f"touch /run/gbfc-mark-{i}")).stdout.splitlines()
            after = time.monotonic()
            assert f"inet {server}/24" in addr
            assert before + i * MONO_STEP_S <= float(there) <= after + i * MONO_STEP_S
            assert marks == "0"
        assert not list(Path("/run").glob("gbfc-mark-*"))
        # Key-only: another key (and no password) is refused.
        other = tmp_path / "other_key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)],
                       check=True)
        refused = subprocess.run(
            ["ssh", "-F", "/dev/null", "-o", f"UserKnownHostsFile={c.state}/known_hosts",
             "-o", f"IdentityFile={other}", "-o", "IdentitiesOnly=yes",
             "-o", "BatchMode=yes", f"root@{c.servers[0]}", "true"],
            capture_output=True, text=True, timeout=30)
        assert refused.returncode == 255 and "Permission denied" in refused.stderr
        # A process a session leaves running goes when the cluster goes.
        c.ssh(c.servers[1], "setsid sleep 600 >/dev/null 2>&1 < /dev/null &")
        ns = os.readlink(f"/proc/{c.sshd_pid(c.servers[1])}/ns/pid")
        assert "sleep" in _commands_in(ns) and "sshd" in _commands_in(ns)
    assert leftovers(state) == []
    assert _commands_in(ns) == []
