"""The torchrun role: real ``python -m torch.distributed.run`` on every training host,
running the user's unmodified script (``controller/torchrun/``); its processes end the run.
What it starts on each host is pure data from the config and the network spec, so the dry run and the tests see exactly what a run does.

Why each variable (every one recorded in ``meta.json``):

- Mininet hosts share one hostname, so gloo and TensorPipe would bind to whatever
  ``gethostname()`` resolves to (127.0.1.1, or the root namespace's address): their
  traffic would never touch a shaped link. ``GLOO_SOCKET_IFNAME`` and
  ``TP_SOCKET_IFNAME`` pin them to the host's emulated interface.
- torchrun finds its own address with ``socket.getfqdn()``: ``--local-addr`` and the
  static rendezvous at rank 0's emulated IP replace every name lookup with an address.
- NCCL identifies a machine by ``/proc/sys/kernel/random/boot_id``, which every
  namespace shares, and would use shared memory or peer-to-peer copies between "local"
  ranks: ``NCCL_P2P_DISABLE``, ``NCCL_SHM_DISABLE``, ``NCCL_IB_DISABLE``,
  ``NCCL_SOCKET_IFNAME`` and a distinct ``NCCL_HOSTID`` per host force its socket
  transport over the emulated link. Two ranks cannot share a GPU (NCCL >= 2.5): one GPU
  per host, ``nproc_per_node = 1``.
- The c10d store gives up after 60 s by default; a delayed or lossy link needs longer
  (:func:`store_timeouts_s`).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from agents.core.config import ExperimentConfig
from agents.core.guard_config import GuardConfig
from agents.core.policies import make_rate_policy
from controller.roles import Role, RoleCommand, RoleContext, register
from topo.spec import HostSpec, NetSpec, SpecError

ROLE = "torchrun"
#: The kinds of host that train, by shape: the star's and the dumbbell's workers (one side
#: of the dumbbell), the fabric's hosts.
TRAINING_KINDS = ("worker", "fabric")

#: torchrun's own defaults that gradbed scales: the c10d store's read timeout and the
#: rendezvous' join timeout (torch/distributed/elastic/rendezvous).
STORE_READ_TIMEOUT_S = 60.0
RDZV_JOIN_TIMEOUT_S = 600.0


class TorchrunError(ValueError):
    """A torchrun run cannot be planned: no training host, NCCL without one GPU per host,
    a script that is missing or not Python. The message names the option or file."""


def training_hosts(spec: NetSpec) -> list[HostSpec]:
    """The hosts that run ranks, node rank order: the star's or dumbbell's workers, else
    the fabric's hosts."""
    for kind in TRAINING_KINDS:
        hosts = sorted(spec.hosts_of_kind(kind), key=lambda h: h.rank)
        if hosts:
            return hosts
    raise TorchrunError(f"the {spec.shape} has no training host (no host of kind "
                        f"{' or '.join(TRAINING_KINDS)}); torchrun runs on the star's "
                        "workers, the dumbbell's workers or the fabric's hosts")


def torchrun_spec(spec: NetSpec) -> NetSpec:
    """``spec`` with the torchrun role on every training host and none on the hosts of
    gradbed's own data-parallel roles (the PS); background traffic stays."""
    train = {h.name for h in training_hosts(spec)}

    def put(h: HostSpec) -> HostSpec:
        if h.name in train:
            return replace(h, role=ROLE)
        return replace(h, role="") if h.role in ("ps", "worker", "stage", "expert") else h

    return replace(spec, hosts=tuple(put(h) for h in spec.hosts))


def interface(spec: NetSpec, host: str) -> str:
    """The host's emulated interface (``w0-eth0``): the one every rank must use."""
    for e in spec.edges:
        if e.a == host:
            return str(e.a_intf)
        if e.b == host:
            return str(e.b_intf)
    raise SpecError(f"host {host} has no link in this {spec.shape}")


def uplink_mbps(spec: NetSpec, host: str) -> float | None:
    """The rate of ``host``'s own egress onto its access link (None: unshaped)."""
    for e in spec.edges:
        if e.a == host:
            return e.a_to_b.link.rate_mbps
        if e.b == host:
            return e.b_to_a.link.rate_mbps
    raise SpecError(f"host {host} has no link in this {spec.shape}")


def path_impairment(spec: NetSpec) -> tuple[float, float]:
    """(one-way delay in ms, loss fraction) of the worst host-to-host path, bounded from
    above: the two largest point delays added, the largest point loss counted twice."""
    delays = sorted((p.point.link.delay_ms or 0.0 for p in spec.places()), reverse=True)
    loss = max((p.point.link.loss_pct or 0.0 for p in spec.places()), default=0.0) / 100
    return sum(delays[:2]), min(0.99, 1 - (1 - loss) ** 2)


def store_timeouts_s(delay_ms: float, loss: float) -> tuple[float, float]:
    """(store read timeout, rendezvous join timeout) in seconds for a path of one-way
    ``delay_ms`` and loss fraction ``loss``.

    torchrun's defaults (60 s, 600 s) assume a LAN. A store operation is a few round trips;
    each lost segment costs at least one retransmission timeout (>= 200 ms, doubling), so
    the defaults are stretched by ``1 + RTT/100 ms`` (a 100 ms RTT doubles them) and by
    ``1 / (1 - loss)^4`` (four lossy exchanges in a row; 10 % loss: x1.52)."""
    rtt_ms = 2 * delay_ms
    factor = (1 + rtt_ms / 100) / (1 - loss) ** 4
    return round(STORE_READ_TIMEOUT_S * factor, 1), round(RDZV_JOIN_TIMEOUT_S * factor, 1)


def check_script(script: str) -> Path:
    """The script as an absolute path; TorchrunError when it is missing or not Python."""
    if not script:
        raise TorchrunError("no script: give one after '--' (gradbed torchrun CONFIG -- "
                            "train.py ARGS) or set torchrun.script")
    path = Path(script).expanduser().absolute()
    if not path.is_file():
        raise TorchrunError(f"torchrun.script {script}: no such file")
    if path.suffix != ".py":
        raise TorchrunError(f"torchrun.script {script}: not a Python script (.py)")
    try:
        compile(path.read_bytes(), str(path), "exec")
    except (SyntaxError, ValueError) as e:
        raise TorchrunError(f"torchrun.script {script}: not valid Python: {e}") from None
    return path


def check_gpus(cfg: ExperimentConfig, hosts: int, gpus: int) -> None:
    """NCCL needs one GPU of its own per emulated host (NCCL >= 2.5 refuses two ranks on
    one GPU, and ranks on one GPU would not cross the network anyway)."""
    tr = cfg.torchrun
    if tr.backend != "nccl":
        return
    if tr.nproc_per_node != 1:
        raise TorchrunError(f"torchrun.backend = 'nccl' needs torchrun.nproc_per_node = 1 "
                            f"(one GPU per emulated host), not {tr.nproc_per_node}")
    if gpus < hosts:
        raise TorchrunError(f"torchrun.backend = 'nccl' needs one GPU per emulated host: "
                            f"{hosts} hosts, {gpus} GPU(s) found; use backend 'gloo'")


def check_shaping(cfg: ExperimentConfig) -> None:
    """Link/N caps reach a torchrun script's ranks only through tc: an HTB class on each
    training host's uplink, set from outside the processes. ``pacing`` and ``pace_guard``
    set SO_MAX_PACING_RATE on gradbed's own agents' sockets, over their control
    connections; a script's sockets are its own, so they are refused by name."""
    sh = cfg.shaping
    if sh.method == "pacing":
        raise TorchrunError("shaping.method = 'pacing' paces the sockets of gradbed's own "
                            "agents; a torchrun script's sockets are its own: use "
                            "shaping.method = 'tc' (an HTB cap on each host's uplink)")
    if sh.method == "tc" and sh.pace_guard:
        raise TorchrunError(f"shaping.pace_guard = {sh.pace_guard:g} paces the sockets of "
                            "gradbed's own agents; a torchrun script's sockets are its own: "
                            "set shaping.pace_guard = 0")


def planned_mbps(cfg: ExperimentConfig, spec: NetSpec, host: HostSpec) -> float | None:
    """The rate ``host`` may send at, as the adaptive hook's planned rate: its uplink's,
    or under ``shaping.method = "tc"`` the link/N cap the driver sets on it (the rate
    policy's first caps, the one definition of the cap)."""
    rate = uplink_mbps(spec, host.name)
    if cfg.shaping.method != "tc" or "up" not in spec.point_names():
        return rate
    policy = make_rate_policy(cfg.shaping.policy, bottleneck_mbps=cfg.net.bottleneck_mbps,
                              workers=cfg.net.workers, worker_link_mbps=cfg.net.worker_link_mbps,
                              headroom=cfg.shaping.headroom)
    caps = {c.worker: c.rate_mbps for c in policy.initial()}
    cap = caps.get(host.rank)
    if cap is None:
        return rate
    return cap if rate is None else min(rate, cap)


@dataclass(frozen=True)
class RankPlan:
    """One host's torchrun: its node rank, the global ranks it runs, argv and the
    variables gradbed adds to its environment."""

    host: str
    ip: str
    node_rank: int
    ranks: tuple[int, ...]
    argv: tuple[str, ...]
    env: Mapping[str, str]


#: The variables of a host's torchrun that differ from host to host (besides NCCL's). Its
#: agent reads them once it runs (and passes them to its ranks), never while torch loads:
#: the agents may fork from one process that imported torch with the rest of
#: :func:`run_env` (controller.torchrun.experiment); a NCCL run's never do.
HOST_ENV = frozenset({"GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "TORCHELASTIC_ERROR_FILE",
                      "GRADBED_HOST", "GRADBED_LINK_MBPS"})


def run_env(log_dir: Path) -> dict[str, str]:
    """The variables every host's torchrun gets alike (``log_dir``: RUN/logs/ranks)."""
    # Rank 0's lines reach the terminal (and a test's log reader) as they are printed;
    # gradbed.ddp (instrument, the adaptive hook) inside the script writes to the run.
    return {"PYTHONUNBUFFERED": "1", "GRADBED_RUN_DIR": str(log_dir.parent.parent)}


def rank_plans(cfg: ExperimentConfig, spec: NetSpec, python: str, script: Path,
               log_dir: Path) -> list[RankPlan]:
    """Every training host's torchrun command and environment (pure)."""
    tr = cfg.torchrun
    hosts = training_hosts(spec)
    master = hosts[0].ip
    delay_ms, loss = path_impairment(spec)
    read_s, join_s = store_timeouts_s(delay_ms, loss)
    k = tr.nproc_per_node
    out = []
    for i, h in enumerate(hosts):
        # c10d's agents decide who hosts the store by matching the endpoint against the
        # machine's hostname and addresses; Mininet hosts share the root's hostname, so no
        # host would match and none would host it: node 0 is told that it does.
        conf = (f"timeout={int(join_s)}" if tr.rdzv == "static"
                else f"join_timeout={int(join_s)},read_timeout={int(read_s)},"
                     f"is_host={'true' if i == 0 else 'false'}")
        dev = interface(spec, h.name)
        argv = (python, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)),
                "--node-rank", str(i), "--nproc-per-node", str(k),
                "--rdzv-backend", tr.rdzv, "--rdzv-endpoint", f"{master}:{tr.port}",
                "--rdzv-id", "gradbed", "--rdzv-conf", conf,
                "--master-addr", master, "--master-port", str(tr.port),
                "--local-addr", h.ip, "--log-dir", str(log_dir / h.name),
                "--redirects", "3", "--tee", "3",
                str(script), *tr.args)
        env = {**run_env(log_dir), "GLOO_SOCKET_IFNAME": dev, "TP_SOCKET_IFNAME": dev,
               # torchrun's @record error files land next to the rank's logs.
               "TORCHELASTIC_ERROR_FILE": str(log_dir / h.name / "error.json"),
               # gradbed.ddp inside the script: under which host its events go.
               "GRADBED_HOST": h.name}
        rate = planned_mbps(cfg, spec, h)
        if rate is not None:  # the adaptive hook's planned rate
            env["GRADBED_LINK_MBPS"] = f"{rate:g}"
        if tr.backend == "nccl":
            env |= {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1",
                    "NCCL_SOCKET_IFNAME": dev, "NCCL_HOSTID": f"gradbed-{h.name}",
                    "CUDA_VISIBLE_DEVICES": str(i)}
        out.append(RankPlan(h.name, h.ip, i, tuple(range(i * k, (i + 1) * k)), argv, env))
    return out


ADMISSION_RULE_COMMENT = "gradbed-torchrun-admission"


def admission_rules(spec: NetSpec, guard: GuardConfig) -> dict[str, list[list[str]]]:
    """Per training host, the iptables commands, run there before any rank starts, that
    let only the training hosts (and the host itself) open TCP connections to it; a
    connection from any other host of the run (a background host flooding the c10d store
    or a rank's gloo listener, say) is reset. The stores (the rendezvous store on the
    endpoint's port, the ranks' store on a port torchrun picks) and gloo's listeners are
    torch's own, outside gradbed's handshake; this is their admission. Only connection
    attempts (SYN) are matched: what the ranks open themselves, and every reply, pass.
    None with ``guard.kernel_admission`` off (a machine without iptables), as for
    gradbed's own listeners (controller.kernel_admission)."""
    if not guard.kernel_admission:
        return {}
    hosts = training_hosts(spec)
    rule = ["iptables", "-w", "-A", "INPUT", "-p", "tcp", "--syn"]
    tag = ["-m", "comment", "--comment", ADMISSION_RULE_COMMENT]
    cmds = [[*rule, "-s", ip, *tag, "-j", "ACCEPT"]
            for ip in ("127.0.0.1", *(h.ip for h in hosts))]
    cmds.append([*rule, *tag, "-j", "REJECT", "--reject-with", "tcp-reset"])
    return {h.name: cmds for h in hosts}


def describe(plans: list[RankPlan]) -> list[str]:
    """The dry run's lines: each host's variables and command."""
    return [f"$ {' '.join(f'{k}={v}' for k, v in sorted(p.env.items()))} "
            f"{shlex.join(p.argv)}   # in {p.host}, ranks {list(p.ranks)}" for p in plans]


_FAILURE = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n"
                      r"\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)


def rank_exit_codes(plan: RankPlan, torchrun_status: int | None, log_text: str
                    ) -> dict[int, int | None]:
    """Each of the host's ranks' exit codes: from torchrun's failure report (``rank :
    R (local_rank: L)`` / ``exitcode : C``) where it names the rank; 0 for the others when
    torchrun itself ended (it exits 0 only when all its ranks did); None while it runs or
    when it was stopped before reporting (then the caller names the signal)."""
    codes: dict[int, int | None] = {}
    for m in _FAILURE.finditer(log_text):
        codes[int(m.group(1))] = int(m.group(3))
    if torchrun_status is None:
        return {r: codes.get(r) for r in plan.ranks}
    if torchrun_status < 0 and not codes:
        return {r: torchrun_status for r in plan.ranks}
    return {r: codes.get(r, 0) for r in plan.ranks}



def commands(ctx: RoleContext, hosts: Sequence[HostSpec]) -> list[RoleCommand]:
    tr = ctx.cfg.torchrun
    plans = rank_plans(ctx.cfg, ctx.spec, tr.python or ctx.python, Path(tr.script),
                       ctx.run_dir / "logs" / "ranks")
    names = {h.name for h in hosts}
    return [RoleCommand(p.host, p.argv) for p in plans if p.host in names]


ROLE_DECL = register(Role(
    name=ROLE,
    sections=("run", "net", "torchrun"),
    host_kinds=TRAINING_KINDS,
    ends_run=True,
    commands=commands,
    phase=1,
))


_FAILURE_TIME = r"^\s*time\s*:\s*(\S+)\s*\n\s*host\s*:.*\n\s*rank\s*:\s*{rank}\s*\("


def failure_time(log_text: str, rank: int) -> str:
    """When torchrun's failure report says ``rank`` failed (``2026-11-27_06:27:18``; they
    sort as text), or "~" (after any time) when the report does not name it."""
    m = re.search(_FAILURE_TIME.format(rank=rank), log_text, re.MULTILINE)
    return m.group(1) if m else "~"
