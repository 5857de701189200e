"""Remove what a crashed gradbed run left behind, and nothing else; safe to repeat.

``mininet.clean.cleanup()`` (``mn -c``) kills every ``mnexec`` and controller process
and deletes every ``*-eth*`` link on the machine, which would take down unrelated
emulations. gradbed's names are distinctive, so this removes only:

- agent processes (``python -m agents.<name>``, the delay line ``python -m topo.delayline``) inside a non-root namespace, and Mininet host shells of gradbed's
  host names (``bash ... mininet:ps``, ``mininet:w3``, ``mininet:bg0``, ``mininet:gbsw0``);
  killing a host's shell frees its unnamed network namespace and the veths inside it;
- links in the root namespace named like gradbed's bridge (``gbsw<N>``), its ports
  (``gbsw<N>-eth<K>``) or host ends that never reached their namespace (``w3-eth0``);
- ``gbprobe-*`` network namespaces of a probe that was killed midway.

Returns one line per removed thing; an empty list means nothing was there.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable

HOST_NAME = r"(?:ps|w\d+|bg\d+|sink\d+|gbh\d+)"
SWITCH_NAME = r"gbsw\d+"
_LINK_RE = re.compile(rf"^(?:{SWITCH_NAME}(?:-eth\d+)?|{HOST_NAME}-eth\d+)$")
_SHELL_RE = re.compile(rf"^mininet:(?:{HOST_NAME}|{SWITCH_NAME})$")
_PROBE_NS_RE = re.compile(r"^gbprobe-\d+$")


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


# The background-traffic servers' ports: controller.background.BASE_PORT + host index.
BACKGROUND_PORTS = (15201, 15201 + 64)


def is_gradbed_process(argv: list[str]) -> str | None:
    """Why ``argv`` is a gradbed leftover (a short description), or None."""
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m" and (argv[i + 1].startswith("agents.")
                            or argv[i + 1] in ("topo.delayline", "torch.distributed.run")):
            return f"agent {argv[i + 1]}"
    if argv and os.path.basename(argv[0]) == "iperf3" and "-p" in argv[:-1]:
        # Background traffic (controller/background.py) uses ports from BASE_PORT; like an
        # agent, one is ours only inside an emulated host (leftover_processes checks).
        port = argv[argv.index("-p") + 1]
        if port.isdigit() and BACKGROUND_PORTS[0] <= int(port) < BACKGROUND_PORTS[1]:
            return f"agent iperf3 (background, port {port})"
    if argv and os.path.basename(argv[0]) == "bash" and any(_SHELL_RE.match(a) for a in argv):
        return "mininet host shell " + next(a for a in argv if _SHELL_RE.match(a))
    return None


def _netns(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def leftover_processes() -> list[tuple[int, str]]:
    """gradbed agents inside emulated hosts, and gradbed's Mininet host shells.

    An agent in the root namespace is not ours to kill: unit tests and loopback runs start
    agents there, while every emulated run starts them inside a host's namespace.
    """
    me = os.getpid()
    root_ns = _netns("self")
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        why = is_gradbed_process(_cmdline(int(entry)))
        if why is None:
            continue
        if why.startswith("agent") and _netns(entry) in (root_ns, None):
            continue
        found.append((int(entry), why))
    return found


def is_gradbed_link(name: str) -> bool:
    return bool(_LINK_RE.match(name))


def _root_links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                         check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@", 1)[0])
    return names


def _kill(pids: list[int], grace_s: float = 2.0) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if os.path.exists(f"/proc/{p}") and not _zombie(p)]
        time.sleep(0.05)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


#: The folder of a run's shared ssh connections (``topo.cluster``, ControlMaster) is
#: ``TMP/gbssh-PID-XXXXXXXX``, PID the controller's: a killed controller leaves it
#: behind, and its pid tells :func:`stale_ssh_dirs` whether its owner is gone.
SSH_DIR_PREFIX = "gbssh-"


def ssh_dir_owner(name: str) -> int | None:
    """The controller pid in a shared-ssh folder's name; None for any other name (an
    older run's folder without a pid, whose owner cannot be told)."""
    if not name.startswith(SSH_DIR_PREFIX):
        return None
    pid, sep, _ = name[len(SSH_DIR_PREFIX):].partition("-")
    return int(pid) if sep and pid.isascii() and pid.isdigit() else None


def stale_ssh_dirs(tmp: str | None = None) -> list[str]:
    """The shared-ssh folders whose controller is gone, removed with the ssh processes
    still using them (a connection master persists for a while after its last session,
    and a dead controller's sessions may still run). A folder whose owner lives, or
    whose owner cannot be told, is left alone. Only for the machine that ran the
    controllers: the pid is from this pid namespace. One line per removed folder."""
    import shutil
    import tempfile

    root = tmp or tempfile.gettempdir()
    removed = []
    for name in sorted(os.listdir(root)):
        owner = ssh_dir_owner(name)
        if owner is None or os.path.exists(f"/proc/{owner}"):
            continue
        path = os.path.join(root, name)
        users = [int(e) for e in os.listdir("/proc") if e.isdigit() and any(
            a.startswith("ControlPath=" + path + "/") for a in _cmdline(int(e)))]
        if users:
            _kill(users)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(f"removed {path} (ssh connections of dead controller pid {owner}"
                       f"{f', {len(users)} ssh process(es) stopped' if users else ''})")
    return removed


def cleanup(verbose: bool = False, log: Callable[[str], None] | None = None) -> list[str]:
    """Remove gradbed leftovers; returns what was removed (empty when nothing was there)."""
    removed: list[str] = []

    def note(msg: str) -> None:
        removed.append(msg)
        if verbose and log is not None:
            log(msg)

    procs = leftover_processes()
    # Agents first, so they do not log errors about their vanished network.
    agents = [p for p, why in procs if why.startswith("agent")]
    shells = [p for p, why in procs if not why.startswith("agent")]
    for group in (agents, shells):
        if group:
            _kill(group)
    for pid, why in procs:
        note(f"killed {why} (pid {pid})")

    # Bridges before their ports: deleting a bridge detaches its ports, and deleting one
    # end of a veth deletes its peer, so re-list after each deletion.
    for _ in range(2):
        names = [n for n in _root_links() if is_gradbed_link(n)]
        names.sort(key=lambda n: ("-eth" in n, n))
        for name in names:
            if name not in _root_links():
                continue
            res = subprocess.run(["ip", "link", "del", name], capture_output=True, text=True,
                                 check=False)
            if res.returncode == 0:
                note(f"deleted link {name}")

    ns_out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            check=False).stdout
    for line in ns_out.splitlines():
        name = line.split()[0] if line.split() else ""
        if _PROBE_NS_RE.match(name) and name != f"gbprobe-{os.getpid()}":
            res = subprocess.run(["ip", "netns", "del", name], capture_output=True,
                                 text=True, check=False)
            if res.returncode == 0:
                note(f"deleted netns {name}")
    if verbose and log is not None and not removed:
        log("nothing to clean up")
    return removed
