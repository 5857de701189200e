"""The shapes: each turns an experiment config into a :class:`topo.spec.NetSpec`.

One file per shape in this folder, registered by name with :func:`register` (Mininet's
``TOPOS`` dictionary for ``mn --topo``); the config picks one with ``topo.shape``.
Adding a shape is one new file plus its test: this package imports every module in it.
See ``docs/roles_and_shapes.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from agents.core.config import ExperimentConfig
from agents.core.registry import Registry, RegistryKind, UnknownName
from topo.spec import NetSpec, SpecError

Shape = Callable[[ExperimentConfig], NetSpec]
SHAPE = RegistryKind("shape", "topo.shapes", "register")
SHAPES: Registry[Shape] = Registry(SHAPE)


def register(name: str) -> Callable[[Shape], Shape]:
    """Decorator: ``@register("star") def star(cfg) -> NetSpec``."""
    return SHAPES.register(name)


def names() -> list[str]:
    return list(SHAPES.names())


def get(name: str) -> Shape:
    try:
        return SHAPES.get(name)
    except UnknownName:
        raise SpecError(f"topo.shape = {name!r}: must be one of "
                        f"{', '.join(SHAPES.names())}") from None


def shape_spec(cfg: ExperimentConfig) -> NetSpec:
    """The network a config asks for (pure: no root needed): its shape's spec, with the
    traces of ``trace.up``/``trace.down`` (the ``up``/``down`` points) and of
    ``topo.traces`` on their shaping points, and ``run.seed`` as the loss seed when
    ``net.loss_model = "seeded"``."""
    spec = get(cfg.topo.shape)(cfg)
    traces = {}
    for point, path in (("up", cfg.trace.up), ("down", cfg.trace.down)):
        if path:
            if point in cfg.topo.traces:
                raise SpecError(f"trace.{point} and topo.traces[{point!r}] both name a trace "
                                "for the same shaping point; keep one")
            traces[point] = path
    traces.update(cfg.topo.traces)
    if cfg.net.loss_model == "seeded":
        spec = replace(spec, loss_seed=cfg.run.seed)
    return spec.with_traces(traces) if traces else spec
