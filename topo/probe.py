"""What this kernel can emulate: qdiscs, congestion controls, OVS, Mininet.

DESIGN.md section 3: the machines gradbed targets lack netem, fq, RED, CoDel and OVS, so
nothing may assume them. Each qdisc is tested for real by installing it on a throwaway veth
in a throwaway network namespace (``gbprobe-<pid>``), which is always deleted. The result
goes into every run's ``meta.json`` and decides whether delay/loss are possible at all.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import threading
from typing import Any

# Each qdisc with the smallest arguments the kernel accepts for it.
QDISC_TRIALS: dict[str, list[str]] = {
    "netem": ["netem", "delay", "1ms"],
    "fq": ["fq"],
    "fq_codel": ["fq_codel"],
    "red": ["red", "limit", "400000", "min", "30000", "max", "90000", "avpkt", "1000",
            "burst", "55", "bandwidth", "10mbit"],
    "codel": ["codel"],
    "htb": ["htb", "default", "1"],
    "tbf": ["tbf", "rate", "1mbit", "burst", "10kb", "latency", "50ms"],
    "bfifo": ["bfifo", "limit", "10000"],
}

_cache: dict[str, Any] | None = None
# One probe at a time: ``gradbed run`` starts one on a thread of its own while it checks its
# files (:func:`probe_in_background`), and the run's own call waits for its result.
_lock = threading.Lock()


#: The programs gradbed runs, and what cannot be done or checked without each. A machine
#: may lack any of them (the lent GPU machine had no modprobe, ethtool or iproute2): the
#: probe then says what it could not check instead of failing.
TOOLS: dict[str, str] = {
    "ip": "no namespaces or veths: no qdisc trial, no network",
    "tc": "no qdiscs: no shaping",
    "ethtool": "GSO/TSO/GRO cannot be switched (net.offload); queues are not packet-exact",
    "modprobe": "whether the Open vSwitch datapath module exists (ovs) is not checked",
}


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``argv``; a program that is not installed reads as exit 127, as in a shell."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
    except FileNotFoundError:
        return subprocess.CompletedProcess(argv, 127, "", f"{argv[0]}: command not found")
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"{argv[0]}: timed out after 20 s")


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def probe_qdiscs() -> dict[str, Any]:
    """Try each qdisc (plus ingress and ifb) in a throwaway namespace; needs root."""
    ns = f"gbprobe-{os.getpid()}"
    result: dict[str, Any] = {}
    setup = _run(["ip", "netns", "add", ns])
    if setup.returncode != 0:
        err = f"ip netns add {ns}: {setup.stderr.strip()}"
        return {**dict.fromkeys([*QDISC_TRIALS, "ingress", "ifb"]), "qdisc_probe_error": err}
    try:
        veth = _run(["ip", "-n", ns, "link", "add", "gbp0", "type", "veth", "peer", "name",
                     "gbp1"])
        if veth.returncode != 0:
            err = f"veth in {ns}: {veth.stderr.strip()}"
            return {**dict.fromkeys([*QDISC_TRIALS, "ingress", "ifb"]),
                    "qdisc_probe_error": err}
        _run(["ip", "-n", ns, "link", "set", "gbp0", "up"])
        tc = ["ip", "netns", "exec", ns, "tc"]
        for name, args in QDISC_TRIALS.items():
            ok = _run([*tc, "qdisc", "replace", "dev", "gbp0", "root", *args]).returncode == 0
            result[name] = ok
            if ok:
                _run([*tc, "qdisc", "del", "dev", "gbp0", "root"])
        result["ingress"] = _run([*tc, "qdisc", "add", "dev", "gbp0", "ingress"]).returncode == 0
        result["ifb"] = _run(["ip", "-n", ns, "link", "add", "gbp2", "type",
                              "ifb"]).returncode == 0
        result["tc_json"] = _run([*tc, "-s", "-j", "qdisc", "show", "dev", "gbp0"]
                                 ).stdout.lstrip().startswith("[")
        result.update(probe_netfilter(ns))
    finally:
        # Deleting the namespace deletes the veth and ifb created inside it.
        _run(["ip", "netns", "del", ns])
    return result


# Netfilter pieces that give delay and loss without netem (topo.netfilter), each tried as
# a rule in the throwaway namespace (the rules die with it).
NETFILTER_TRIALS: dict[str, list[str]] = {
    "nfqueue": ["-j", "NFQUEUE", "--queue-num", "0"],
    "xt_statistic": ["-m", "statistic", "--mode", "random", "--probability", "0.01",
                     "-j", "DROP"],
}


NETFILTER_TRIES = 3


def probe_netfilter(ns: str) -> dict[str, Any]:
    """``nfqueue`` and ``xt_statistic``: whether iptables can install each in ``ns``'s raw
    table; ``iptables`` is the binary's version, None when it is missing."""
    try:
        version = _run(["iptables", "-V"]).stdout.strip() or None
    except FileNotFoundError:
        return {**dict.fromkeys(NETFILTER_TRIALS, False), "iptables": None}
    out: dict[str, Any] = {"iptables": version}
    for name, args in NETFILTER_TRIALS.items():
        argv = ["ip", "netns", "exec", ns, "iptables", "-w", "-t", "raw", "-A", "PREROUTING",
                "-i", "gbp0", *args]
        # A loaded machine can make one try fail that says nothing about the kernel (20 s
        # spent waiting on the xtables lock, nf_tables' transaction racing another run's),
        # and a false "no" ends a run: try three times and keep the last reason.
        for _ in range(NETFILTER_TRIES):
            res = _run(argv)
            if res.returncode == 0:
                break
        out[name] = res.returncode == 0
        if not out[name]:
            out[f"{name}_error"] = res.stderr.strip()[-300:] or f"exit {res.returncode}"
    return out


def _mininet_version() -> str | None:
    try:
        from mininet.net import VERSION
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return None
    return str(VERSION)


def _ovs_datapath() -> bool | None:
    """True/False, or None when it cannot be told (no modprobe and no module loaded)."""
    if os.path.isdir("/sys/module/openvswitch"):
        return True
    if shutil.which("modprobe") is None:
        return None
    # -n: only resolve the module, never load it (the probe must not change the kernel).
    return _run(["modprobe", "-n", "-q", "openvswitch"]).returncode == 0


def _iproute2_version() -> str | None:
    out = _run(["tc", "-V"]).stdout
    m = re.search(r"iproute2-(\S+?),?\s", out + " ")
    return m.group(1) if m else out.strip() or None


def probe(refresh: bool = False) -> dict[str, Any]:
    """Kernel capabilities as a JSON-able dict, cached per process.

    Keys: every qdisc in QDISC_TRIALS plus ``ingress``/``ifb`` (True/False, or None when
    the probe could not run, e.g. not root, with ``qdisc_probe_error`` saying why),
    ``nfqueue``/``xt_statistic``/``iptables`` (``probe_netfilter``; ``NAME_error`` with
    iptables' last words where one was refused), ``delay_mechanism``/``loss_mechanism`` (``topo.netfilter.mechanisms``),
    ``tcp_congestion_control`` (list), ``tcp_congestion_control_default``, ``kernel``,
    ``ovs`` (None: could not tell), ``mininet_version``, ``iproute2``, ``root``,
    ``missing_tools`` (programs of :data:`TOOLS` not on ``PATH``) and ``unchecked`` (for
    each, what that leaves unchecked or impossible).
    """
    with _lock:
        return dict(_probe(refresh))


def probe_in_background() -> threading.Thread:
    """Start :func:`probe` on a thread (not a daemon: its throwaway namespace is always
    deleted), so that the process's next ``probe()`` finds its result or waits for it."""
    thread = threading.Thread(target=probe, name="probe", daemon=False)
    thread.start()
    return thread


def _probe(refresh: bool) -> dict[str, Any]:
    global _cache
    if _cache is not None and not refresh:
        return _cache
    caps: dict[str, Any] = {"kernel": platform.release(), "root": os.geteuid() == 0}
    missing = sorted(t for t in TOOLS if shutil.which(t) is None)
    caps["missing_tools"] = missing
    caps["unchecked"] = {t: TOOLS[t] for t in missing}
    caps.update(probe_qdiscs())
    avail = _read("/proc/sys/net/ipv4/tcp_available_congestion_control") or ""
    caps["tcp_congestion_control"] = sorted(avail.split())
    caps["tcp_congestion_control_default"] = _read("/proc/sys/net/ipv4/tcp_congestion_control")
    caps["ovs"] = _ovs_datapath()
    caps["mininet_version"] = _mininet_version()
    caps["iproute2"] = _iproute2_version()
    from topo.netfilter import mechanisms

    mech = mechanisms(caps)
    caps["delay_mechanism"], caps["loss_mechanism"] = mech["delay"], mech["loss"]
    _cache = caps
    return caps
