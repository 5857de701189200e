"""Roles: the process kinds the runner places on a network's hosts.

A role is a declaration, pure data importable without torch: the config sections it
reads, the host kinds it may run on, its command lines (argv built from the config and
the network spec alone), its start phase, and whether it decides when the run ends. The
agents themselves live in ``agents/`` (``agents.dp.ps``, ``agents.dp.worker``,
``agents.traffic.flowgen``) and never import this package; the runner
(``controller.runner``) starts ``get(host.role)`` for every host of the spec.

One file per role in this folder, registered with :func:`register`; this package imports
every module in it, so adding a role is one new file plus its test
(``docs/roles_and_shapes.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from agents.core.config import ExperimentConfig
from agents.core.registry import Registry, RegistryKind, UnknownName
from topo.spec import HostSpec, NetSpec


class RoleError(ValueError):
    """A host names an unknown role, a role sits on a host kind it does not run on, or a
    role's command cannot be built from the spec; the message names host and role."""


@dataclass(frozen=True)
class RoleContext:
    """What a role's command lines are built from: all of it plain data."""

    cfg: ExperimentConfig
    spec: NetSpec
    run_dir: Path
    python: str = "python"  # the interpreter agents run under (sys.executable in a run)


@dataclass(frozen=True)
class RoleCommand:
    """One process to start in ``host``'s namespace; its output goes to ``log`` (a path
    relative to the run directory). ``links``: the mesh links it is an end of, as
    ``(mesh, its name there, the peer's name)``; the runner hands it those links' pair
    keys on its stdin, and no others (:func:`agents.net.auth.bundle_for`). ``agent``:
    what the process is where that is not the role's name (the pipeline's PS runs under
    the stage role), as an ``agent_lost`` event names it. ``listens``: the TCP ports it
    accepts peers on through the handshake driver, where a keyless host may knock; the
    kernel caps each source's connections there too (:mod:`controller.kernel_admission`)."""

    host: str
    argv: tuple[str, ...]
    log: str = ""
    links: tuple[tuple[str, str, str], ...] = ()
    agent: str = ""
    listens: tuple[int, ...] = ()

    def log_path(self, run_dir: Path) -> Path:
        return run_dir / (self.log or f"logs/{self.host}.log")


#: Starts one process of a role as the controller starts every agent, and watches it.
Starter = Callable[[RoleCommand], Any]


class RoleSession(Protocol):
    """A role that starts and stops its processes itself (background traffic: servers
    before clients, a delayed start, reports read at the end)."""

    def start(self, net: Any) -> None: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class Role:
    """A process kind, declared as data.

    name: what ``HostSpec.role`` says to run it.
    sections: the config sections it reads (``[run]``, ``[background]``...).
    host_kinds: the ``HostSpec.kind`` values it may run on; anything else is an error.
    ends_run: the run ends once every process of every such role has exited (the PS);
        the others are then given ``grace_s`` to exit on their own, and stopped.
    commands: the processes for all hosts of this role at once (pure).
    phase: start order; every process of a lower phase starts (and, with
        ``wait_ready``, reports ``ready`` over the control socket) before the next phase.
    wait_ready: wait for a ``ready`` report from each of its hosts before going on.
    reports_progress: its ``iter_done`` reports drive the progress bar.
    session: builds a :class:`RoleSession` that starts and stops this role's processes
        itself, after the process roles are up and the network driver has started (given
        the runner's :data:`Starter` for those of its processes that are agents of ours);
        ``None``: the runner starts ``commands`` itself.
    """

    name: str
    sections: tuple[str, ...]
    host_kinds: tuple[str, ...]
    ends_run: bool
    commands: Callable[[RoleContext, Sequence[HostSpec]], Sequence[RoleCommand]]
    phase: int = 1
    wait_ready: bool = False
    reports_progress: bool = False
    session: Callable[[RoleContext, Callable[[str], None], Any, Starter], RoleSession] \
        | None = field(default=None)


ROLE = RegistryKind("role", "controller.roles", "register")
ROLES: Registry[Role] = Registry(ROLE)


def register(role: Role) -> Role:
    """Register ``role`` under ``role.name`` (a role is a value, not a class: called, not
    used as a decorator)."""
    ROLES.add(role.name, role)
    return role


def names() -> list[str]:
    return list(ROLES.names())


def get(name: str) -> Role:
    try:
        return ROLES.get(name)
    except UnknownName:
        raise RoleError(f"role {name!r} is not registered; known roles: "
                        f"{', '.join(ROLES.names())}") from None


def placement(spec: NetSpec) -> list[tuple[Role, tuple[HostSpec, ...]]]:
    """Each role the spec's hosts name, with its hosts (rank order), in start order.
    Raises RoleError for an unknown role or a host kind the role does not run on."""
    by_role: dict[str, list[HostSpec]] = {}
    for h in spec.hosts:
        if not h.role:
            continue
        role = get(h.role)
        if h.kind not in role.host_kinds:
            raise RoleError(f"host {h.name} (kind {h.kind!r}) has role {role.name!r}, which "
                            f"runs on kinds {list(role.host_kinds)}")
        by_role.setdefault(role.name, []).append(h)
    out = [(get(n), tuple(sorted(hs, key=lambda h: h.rank))) for n, hs in by_role.items()]
    return sorted(out, key=lambda rh: (rh[0].phase, rh[0].name))


def require_end(spec: NetSpec) -> list[tuple[Role, tuple[HostSpec, ...]]]:
    """:func:`placement`, refusing a network where no role decides when the run ends."""
    placed = placement(spec)
    if not any(role.ends_run for role, _ in placed):
        raise RoleError(f"no host of this {spec.shape} runs a role that ends the run "
                        f"(roles placed: {[r.name for r, _ in placed] or 'none'}); "
                        "a run needs one, such as ps (for a fabric: set topo.role)")
    return placed


def plan_commands(ctx: RoleContext) -> list[tuple[Role, RoleCommand]]:
    """Every process the runner (or a role's session) would start, in start order."""
    return [(role, c) for role, hosts in require_end(ctx.spec)
            for c in role.commands(ctx, hosts)]


def the_host(spec: NetSpec, kind: str, role: str) -> HostSpec:
    """The single host of ``kind`` a role talks to (a worker's PS); RoleError otherwise."""
    found = spec.hosts_of_kind(kind)
    if len(found) != 1:
        raise RoleError(f"role {role!r} needs exactly one host of kind {kind!r} in this "
                        f"{spec.shape}; found {[h.name for h in found]}")
    return found[0]
