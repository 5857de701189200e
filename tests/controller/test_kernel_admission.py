"""The kernel's half of admission (controller.kernel_admission): which hosts' ports get
netfilter rules, what the rules say, and, as root in a network namespace of the test's own
(no Mininet), that the kernel really drops a source's surplus connection attempts while
another source connects."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from agents.core import config as cfgmod
from agents.core.guard_config import GuardConfig
from controller import kernel_admission
from controller.roles import RoleContext, plan_commands
from topo.shapes import shape_spec

REPO = Path(__file__).resolve().parents[2]


def _listens(config: str, *overrides: str) -> list[tuple[str, tuple[int, ...]]]:
    """Each process the roles would start, as (what it is, the ports it listens on)."""
    cfg = cfgmod.load(REPO / config, list(overrides))
    ctx = RoleContext(cfg, shape_spec(cfg), Path("RUN"))
    return sorted((c.agent or c.argv[2], c.listens) for _, c in plan_commands(ctx))


def test_every_listening_agent_and_only_those_names_its_port():
    # Not the workers, not a background host (a flow generator's sinks are not agents').
    assert _listens("configs/test_tiny.toml", "net.background_hosts=1", "net.port=5600") \
        == [("agents.dp.ps", (5600,)), ("agents.dp.worker", ()), ("agents.dp.worker", ())]
    cfg = cfgmod.load(REPO / "configs/pipeline.toml", [])
    port, p, d = cfg.net.port, cfg.pipeline.stages, cfg.pipeline.replicas
    # Stage s listens on net.port + s for its upstream neighbour; the PS on net.port.
    assert _listens("configs/pipeline.toml") == sorted(
        [("agents.pipeline.stage", (port + s,)) for _ in range(d) for s in range(p)]
        + [("stage_ps", (port,))])
    cfg = cfgmod.load(REPO / "configs/moe.toml", [])
    assert _listens("configs/moe.toml") == [("agents.moe.expert", (cfg.net.port,))] * \
        cfg.moe.hosts


def test_the_rules_follow_the_guard_fields():
    guard = GuardConfig(max_handshakes_per_source=5, max_connects_per_source_per_s=30)
    rules = kernel_admission.rules([7000, 7001], guard)
    assert len(rules) == 2  # one a port: no connlimit (its conntrack costs every packet)
    for port, rate in zip([7000, 7001], rules, strict=True):
        assert rate[:9] == ["iptables", "-w", "-A", "INPUT", "-p", "tcp", "--syn",
                            "--dport", str(port)]
        assert rate[-2:] == ["-j", "DROP"] and kernel_admission.RULE_COMMENT in rate
        assert rate[rate.index("--hashlimit-above") + 1] == "30/sec"
        assert rate[rate.index("--hashlimit-burst") + 1] == "30"
        assert rate[rate.index("--hashlimit-mode") + 1] == "srcip"
        assert not any("conn" in a for a in rate)
    assert kernel_admission.rules([7000], dataclasses.replace(guard, kernel_admission=False)) \
        == []
    assert kernel_admission.rules([], guard) == []


def test_the_dry_run_shows_the_rules_before_the_agent(tmp_path: Path):
    p = subprocess.run([sys.executable, "-m", "controller.cli", "run",
                        str(REPO / "configs/test_tiny.toml"), "--dry-run", "--set",
                        "net.port=5600"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    ps = next(i for i, x in enumerate(lines) if "agents.dp.ps" in x)
    assert "--dport 5600" in lines[ps - 1] and lines[ps - 1].endswith("# in ps")
    assert "gradbed-admission" not in lines[ps - 2]
    assert not any("iptables" in x and "# in w" in x for x in lines)


def test_a_config_may_turn_the_rules_off_and_says_so_when_wrong():
    with pytest.raises(cfgmod.ConfigError, match="guard.kernel_admission"):
        cfgmod.load(REPO / "configs/test_tiny.toml", ["guard.kernel_admission=3"])
    off = cfgmod.load(REPO / "configs/test_tiny.toml", ["guard.kernel_admission=false"])
    assert kernel_admission.rules([5000], off.guard) == []


# -- the kernel itself, in a namespace of the test's own ----------------------------------

# Inside the namespace: a listener that never accepts (what completes the handshake waits
# in its backlog, tracked as established), then `n` connection attempts from `src` and one
# from `other`; prints how many of each connected within `wait_s`.
_KNOCK = textwrap.dedent("""
    import json, select, socket, sys, time
    port, src, n, other, wait_s = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
    srv = socket.socket(); srv.bind(("0.0.0.0", port)); srv.listen(256)
    def knock(source, k):
        out = []
        for _ in range(k):
            s = socket.socket(); s.bind((source, 0)); s.setblocking(False)
            s.connect_ex(("127.0.0.1", port)); out.append(s)
        return out
    t0 = time.monotonic()
    socks = {"src": knock(src, n)}
    knock_s = time.monotonic() - t0
    socks["other"] = knock(other, 1)
    time.sleep(wait_s)
    def connected(s):
        _, w, _ = select.select([], [s], [], 0)
        return bool(w) and s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
    print(json.dumps({**{k: sum(map(connected, v)) for k, v in socks.items()},
                      "knock_s": knock_s}))
""")


class _Netns:
    """What ``kernel_admission.install`` needs of a network: ``run`` in a host."""

    def __init__(self, name: str) -> None:
        self.name = name

    def run(self, host: str, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", self.name, *argv], capture_output=True,
                              text=True, timeout=60, check=True)


@pytest.fixture
def netns() -> Iterator[_Netns]:
    if os.geteuid() != 0 or not shutil.which("iptables"):
        pytest.skip("needs root and iptables")
    name = f"gbka{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
                       check=True)
        yield _Netns(name)
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def _knock(ns: _Netns, port: int, n: int) -> dict[str, float]:
    """How many of ``n`` attempts from one address and of one from another connected, and
    how long the ``n`` took to send (``knock_s``)."""
    out = ns.run("h", [sys.executable, "-c", _KNOCK, str(port), "127.0.0.2", str(n),
                       "127.0.0.3", "0.5"]).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def test_the_kernel_holds_a_source_to_its_connections_a_second(netns: _Netns):
    said: list[str] = []
    guard = GuardConfig(max_handshakes_per_source=1000, max_handshakes=1000,
                        max_connects_per_source_per_s=5)
    kernel_admission.install(netns, "h", [7200], guard, said.append)
    assert len(said) == 1 and said[0].endswith("# in h")  # run.log's line
    # 30 attempts from one address: the bucket's 5 connect, the rest are dropped (their
    # SYNs wait for a retransmit); another address, a bucket of its own, still gets in.
    got = _knock(netns, 7200, 30)
    # The bucket of 5 refills at 5 a second: a loaded machine may take a while to send 30.
    assert 5 <= got["src"] <= 5 + int(got["knock_s"] * 5) and got["other"] == 1, got


def test_a_kernel_that_refuses_the_rules_is_named_with_the_way_out():
    class Refusing:
        def run(self, host: str, argv: Sequence[str]) -> None:
            raise subprocess.CalledProcessError(1, argv, "", "iptables: No chain/target/match")

    with pytest.raises(RuntimeError, match=r"gbh3: .*No chain.*guard.kernel_admission = false"):
        kernel_admission.install(Refusing(), "gbh3", [5000], GuardConfig(), lambda _: None)
