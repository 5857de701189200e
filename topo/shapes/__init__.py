"""The shapes: each turns an experiment config into a :class:`topo.spec.NetSpec`.

One file per shape in this folder, registered by name with :func:`register` (Mininet's
``TOPOS`` dictionary for ``mn --topo``); the config picks one with ``topo.shape``.
Adding a shape is one new file plus its test: this package imports every module in it.
See ``docs/roles_and_shapes.md``.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import replace

from agents.core.config import ExperimentConfig
from topo.placement import place
from topo.spec import NetSpec, SpecError

Shape = Callable[[ExperimentConfig], NetSpec]
_SHAPES: dict[str, Shape] = {}


def register(name: str) -> Callable[[Shape], Shape]:
    """Decorator: ``@register("star") def star(cfg) -> NetSpec``."""
    def deco(fn: Shape) -> Shape:
        if name in _SHAPES and _SHAPES[name] is not fn:
            raise ValueError(f"shape {name!r} is registered twice")
        _SHAPES[name] = fn
        return fn
    return deco


def _discover() -> None:
    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")


def names() -> list[str]:
    _discover()
    return sorted(_SHAPES)


def get(name: str) -> Shape:
    _discover()
    if name not in _SHAPES:
        raise SpecError(f"topo.shape = {name!r}: must be one of {', '.join(sorted(_SHAPES))}")
    return _SHAPES[name]


def shape_spec(cfg: ExperimentConfig) -> NetSpec:
    """The network a config asks for (pure: no root needed): its shape's spec, with the
    traces of ``trace.up``/``trace.down`` (the ``up``/``down`` points) and of
    ``topo.traces`` on their shaping points, and ``run.seed`` as the loss seed when
    ``net.loss_model = "seeded"``; its nodes placed on ``cluster.servers``
    (``topo.placement.place``: on this machine alone by default)."""
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
    spec = spec.with_traces(traces) if traces else spec
    c = cfg.cluster
    return place(spec, c.servers, c.placement, c.pins, cfg.run.seed)
