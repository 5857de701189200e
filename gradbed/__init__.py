"""gradbed's Python API: topology scripts in the Mininet habit.

A thin facade over the packages that do the work (``topo``, ``controller``,
``agents.core``); see ``docs/roles_and_shapes.md``. Everything needs root only when it
touches the kernel (:func:`run`, :func:`cli`, :class:`Network`)::

    import gradbed

    cfg = gradbed.load_config("configs/demo.toml", ["run.iterations=20"])
    spec = gradbed.shape_spec(cfg)                          # the config's shape, as data
    spec = spec.with_traces({"w0.up": "traces/data/cellular_like.trace"})
    run_dir = gradbed.run(cfg, spec)                        # -> runs/demo-.../
    print(gradbed.summary(run_dir)["iter_time_p50_s"])

or a network of your own: ``gradbed.NetSpec(...)`` from ``HostSpec``, ``SwitchSpec``,
``EdgeSpec`` and ``ShapingPoint`` (each with a ``LinkSpec``), roles put on hosts with
:func:`place`, then ``gradbed.run(cfg, spec)``, or ``with gradbed.Network(spec) as net:
net.run("w0", ["ping", "-c", "1", net.ip("ps")])``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agents.core.config import ExperimentConfig
    from topo.spec import NetSpec

__all__ = [
    "ConfigError", "EdgeSpec", "Experiment", "ExperimentConfig", "HostSpec", "LinkSpec",
    "NetSpec", "Network", "Role", "RoleCommand", "RoleContext", "RoleError", "ShapingPoint",
    "SpecError", "StarSpec", "SwitchSpec", "cli", "dry_run", "load_config", "place", "role",
    "role_names", "register_role", "register_shape", "run", "shape_spec", "shape_names",
    "summary", "torchrun", "exit_status",
]

# Every re-exported name, imported on first use: ``import gradbed.ddp`` inside a training
# script must not load the controller, the topology builder or Mininet, and ``import
# gradbed`` (configs, specs, dry runs) must not load torch (the runner imports it).
_LAZY = {
    "ConfigError": "agents.core.checks", "ExperimentConfig": "agents.core.config",
    "Role": "controller.roles", "RoleCommand": "controller.roles",
    "RoleContext": "controller.roles", "RoleError": "controller.roles",
    "role": "controller.roles:get", "role_names": "controller.roles:names",
    "register_role": "controller.roles:register", "Network": "topo.build",
    "shape_names": "topo.shapes:names", "register_shape": "topo.shapes:register",
    "shape_spec": "topo.shapes", "StarSpec": "topo.shapes.star", "EdgeSpec": "topo.spec",
    "HostSpec": "topo.spec", "LinkSpec": "topo.spec", "NetSpec": "topo.spec",
    "ShapingPoint": "topo.spec", "SpecError": "topo.spec", "SwitchSpec": "topo.spec",
    "Experiment": "controller.run",
}


def __getattr__(name: str) -> Any:
    """The re-exported names of :data:`_LAZY`, imported (and cached) on first use."""
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'gradbed' has no attribute {name!r}")
    module, _, attr = target.partition(":")
    value = getattr(import_module(module), attr or name)
    globals()[name] = value
    return value


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """A TOML config (a path, or the name of a shipped one: ``"demo.toml"``) with dotted
    overrides (``"net.workers=8"``, TOML values), validated, every file it names made
    absolute (``controller.paths``); ``ConfigError`` names the field, the value and what is
    allowed."""
    from controller.paths import load_config as _load

    return _load(path, list(overrides))


def place(spec: NetSpec, roles: Mapping[str, str]) -> NetSpec:
    """``spec`` with ``roles[host]`` (a registered role name, or "" for none) on those
    hosts; the host's kind becomes the role's first host kind when it is not one of them.
    An unknown host or role is an error naming it."""
    from controller.roles import get as role
    from topo.spec import HostSpec, SpecError

    hosts = {h.name for h in spec.hosts}
    for name, r in roles.items():
        if name not in hosts:
            raise SpecError(f"place: host {name!r} is not in this {spec.shape}; allowed "
                            f"{sorted(hosts)}")
        if r:
            role(r)  # RoleError naming the known roles

    def put(h: HostSpec) -> HostSpec:
        if h.name not in roles:
            return h
        r = roles[h.name]
        kinds = role(r).host_kinds if r else (h.kind,)
        return replace(h, role=r, kind=h.kind if h.kind in kinds else kinds[0])

    return replace(spec, hosts=tuple(put(h) for h in spec.hosts))


def run(cfg: ExperimentConfig, spec: NetSpec | None = None, *, out: str | Path = "runs",
        progress: bool = True, quiet: bool = False, report: bool = True) -> Path:
    """Run one experiment (root): build ``spec`` (the config's shape when None), start
    every host's role, and return the run directory, loadable even when interrupted.
    ``report``: write report/index.html at the end (``gradbed run --no-report`` is False;
    ``gradbed report RUN`` writes it later)."""
    from controller.run import Experiment

    exp = Experiment(cfg, out_root=Path(out), progress=progress, quiet=quiet, spec=spec,
                     argv=["gradbed.run"], report=report)
    return exp.run()


def torchrun(cfg: ExperimentConfig, script: str | Path, args: Sequence[str] = (),
             spec: NetSpec | None = None, *, out: str | Path = "runs", python: str = "",
             progress: bool = True, quiet: bool = False) -> Path:
    """Run an unmodified ``torch.distributed`` script under real torchrun on every
    training host of ``spec`` (the config's shape when None), as ``gradbed torchrun``
    does (root); returns the run directory. ``summary(run_dir)["torchrun"]`` holds the
    per-rank exit codes and the bytes proof (docs/torchrun.md)."""
    from dataclasses import asdict

    from agents.core.config import from_dict
    from controller.torchrun.experiment import TorchrunExperiment

    tr = replace(cfg.torchrun, script=str(script), args=tuple(str(a) for a in args),
                 python=python or cfg.torchrun.python)
    cfg = from_dict({**cfg.to_dict(), "torchrun": asdict(tr)})
    exp = TorchrunExperiment(cfg, out_root=Path(out), progress=progress, quiet=quiet,
                             spec=spec, argv=["gradbed.torchrun"])
    return exp.run()


def dry_run(cfg: ExperimentConfig, spec: NetSpec | None = None,
            caps: Mapping[str, Any] | None = None) -> list[str]:
    """What :func:`run` would do, as ``gradbed run --dry-run`` prints it (no root)."""
    from controller.run import plan_commands
    from topo.probe import probe

    return plan_commands(cfg, dict(caps) if caps is not None else probe(), spec)


def cli(cfg: ExperimentConfig, spec: NetSpec | None = None) -> None:
    """Build the network (root), start no role, and open Mininet's CLI on it."""
    from controller.interactive import open_cli

    open_cli(cfg, spec)


def summary(run_dir: str | Path) -> dict[str, Any]:
    """A run directory's ``summary.json``."""
    result: dict[str, Any] = json.loads((Path(run_dir) / "summary.json").read_text())
    return result


def exit_status(run_dir: str | Path) -> int:
    """The exit status ``gradbed run`` gave (or would give) the run in ``run_dir``: 0
    completed, 3 failed start, 4 an agent lost, 5 timed out, 128+n signal n
    (``controller.exit_status``, the one table)."""
    from controller.exit_status import status_for

    return status_for(str(summary(run_dir).get("stop_reason", "")))
