"""The names of a run's nodes, defined once: host names, event-file names and the ``node``
column of every event all follow them.

- ``ps``: the parameter server; ``controller``: the controller's own events;
- ``w0`` .. ``wN-1``: the data-parallel workers (``w`` and the worker's index, no padding);
- ``s0`` .. ``sP-1`` (one pipeline) or ``r{R}s{S}`` (replica R's stage S): pipeline stages;
- ``e0`` .. ``eH-1``: MoE expert hosts.
"""

from __future__ import annotations

import re

PS_NODE = "ps"
CONTROLLER_NODE = "controller"
WORKER_PREFIX = "w"
#: A worker's node name: ``w`` and its index (``w0``, ``w12``). Use with ``fullmatch``.
WORKER_NODE_RE = re.compile(r"w(0|[1-9][0-9]*)")


def worker_node(index: int) -> str:
    """The node name of worker ``index`` (``w3``)."""
    if index < 0:
        raise ValueError(f"worker index {index} must be >= 0")
    return f"{WORKER_PREFIX}{index}"


def worker_index(node: str) -> int | None:
    """The index of worker node ``node`` (``"w3"`` -> 3); None when it is not a worker."""
    m = WORKER_NODE_RE.fullmatch(node)
    return int(m.group(1)) if m else None


def is_worker_node(node: str) -> bool:
    """Whether ``node`` names a worker (``w0``, ``w12``; not ``ps``, ``wx`` or ``w01``)."""
    return worker_index(node) is not None


def stage_node(replica: int, stage: int, replicas: int) -> str:
    """The node name of stage ``stage`` of pipeline replica ``replica`` (``s1``, ``r1s0``)."""
    return f"s{stage}" if replicas == 1 else f"r{replica}s{stage}"


def stage_links(replica: int, stage: int, stages: int, replicas: int
                ) -> list[tuple[str, str, str]]:
    """The ``stage`` mesh links a stage is an end of, as ``(mesh, it, peer)``: every other
    stage of its replica (the schedule picks which it talks to) and the pipeline's PS
    (``ps``, where replicas meet)."""
    me = stage_node(replica, stage, replicas)
    return [("stage", me, stage_node(replica, s, replicas)) for s in range(stages)
            if s != stage] + [("stage", me, PS_NODE)]


def stage_ps_links(stages: int, replicas: int) -> list[tuple[str, str, str]]:
    """The pipeline PS's links: one to every stage of every replica."""
    return [("stage", PS_NODE, stage_node(r, s, replicas)) for r in range(replicas)
            for s in range(stages)]
