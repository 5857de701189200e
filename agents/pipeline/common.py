"""What the pipeline's two roles share: the stage (:mod:`agents.pipeline.stage`) and the
pipeline's PS (:mod:`agents.pipeline.stage_ps`) build the same validated schedule, name
each other by the same indices, agree on which steps are evaluated and cut the same
micro-batches out of the workload's batches."""

from __future__ import annotations

import threading
from typing import Any

from agents.core.events import EventLog
from agents.core.schedules import Schedule, validate
from agents.core.schedules import make as make_schedule
from agents.workloads.base import Batch

#: How long a stage waits for its neighbours and the PS to be reachable, and the PS for
#: every stage to connect.
CONNECT_TIMEOUT_S = 60.0


class StageError(RuntimeError):
    """A neighbour sent something the schedule does not allow, or vanished."""


def ps_node_id(stage: int, replica: int, stages: int) -> int:
    """The id a stage gives the PS in its HELLO and frames: ``replica * p + stage``."""
    return replica * stages + stage


def ps_index(stages: int, replicas: int) -> int:
    """The pipeline PS's index in its links' handshakes: after every stage's."""
    return stages * replicas


def is_eval_step(run: Any, step: int) -> bool:
    """Whether the PS evaluates after step ``step``: every ``run.eval_every`` steps and
    after the last (the data-parallel PS's cadence)."""
    return (step + 1) % run.eval_every == 0 or step + 1 == run.iterations


def build_schedule(pc: Any, steps: int) -> Schedule:
    """The run's schedule (``pipeline.schedule`` over ``steps`` steps), validated: both
    roles derive what each connection carries from it."""
    return validate(make_schedule(pc.schedule, pc.stages, pc.micro_batches, steps=steps,
                                  recompute=pc.recompute))


def micro_batch(workload: Any, pc: Any, mb: int, replica: int) -> Batch:
    """Micro-batch ``mb`` (global id) of replica ``replica``: step ``k``'s global batch of
    ``d * m * b`` samples is the workload's batch of iteration ``k``; replica ``r`` takes
    slice ``r`` and cuts it into ``m`` micro-batches of ``b``."""
    m, b = pc.micro_batches, pc.micro_batch_size
    k, i = divmod(mb, m)
    full = workload.batch(k, replica, pc.replicas, m * b)
    return Batch(full.x[i * b:(i + 1) * b], full.y[i * b:(i + 1) * b])


class LockedLog:
    """An agent's event log shared by several threads (EventLog is not thread-safe)."""

    def __init__(self, log: EventLog) -> None:
        self._log = log
        self._lock = threading.Lock()
        self.path = log.path

    def emit(self, event: str, iter: int = -1, **fields: Any) -> None:
        with self._lock:
            self._log.emit(event, iter, **fields)

    def close(self) -> None:
        with self._lock:
            self._log.close()
