"""Per-iteration and per-bucket events of a DDP model, on a gradbed run's shared clock.

``gradbed.ddp.instrument(ddp_model)`` after ``register_comm_hook`` (or with no hook: it
then registers gradbed's recorded dense all_reduce, which is DDP's own mean). Inside a
``gradbed torchrun`` run it appends to ``RUN_DIR/events/HOST.jsonl`` (``HOST.L`` for local
rank L when a host runs several):

- ``ddp_bucket``, per bucket and iteration, when its result is ready: the bucket index, raw
  and payload bytes, the wire bytes of the formula (:mod:`gradbed.ddp.wire`), the keep,
  the time spent compressing (``compress_s``) and in the collective (``comm_s``);
- ``ddp_iter``, per iteration, at the next forward (or at exit): the iteration's time
  from forward to forward, the loss given to :meth:`Instrument.loss`, the buckets' sums and
  the TCP payload this process's connections moved in it.

Every ``start_ns``/``end_ns`` is CLOCK_MONOTONIC, the clock every host of the run shares,
so the intervals land in ``trace.json`` and the report's timeline beside the links' rates.
Outside gradbed (no ``GRADBED_RUN_DIR``) it registers nothing and writes nothing.
"""

from __future__ import annotations

import atexit
import math
import os
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn

from agents.core.events import EventLog, now_ns
from gradbed.ddp.record import BucketRecord, Listeners
from gradbed.ddp.wire import own_tcp_bytes

# What gradbed torchrun gives every rank (controller/roles/torchrun.py).
RUN_DIR_ENV = "GRADBED_RUN_DIR"
HOST_ENV = "GRADBED_HOST"
LINK_ENV = "GRADBED_LINK_MBPS"


def node_name(env: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The events file's node: the host, and the local rank when the host runs several."""
    host = env.get(HOST_ENV) or f"rank{env.get('RANK', '0')}"
    if int(env.get("LOCAL_WORLD_SIZE", "1")) > 1:
        return f"{host}.{env.get('LOCAL_RANK', '0')}"
    return host


class Instrument:
    """The recorder :func:`instrument` returns; with ``log`` None it does nothing."""

    def __init__(self, log: EventLog | None) -> None:
        self.log = log
        self._lock = threading.Lock()
        self._iteration = -1
        self._start_ns = 0
        self._loss = math.nan
        self._buckets: list[BucketRecord] = []
        self._tcp = (0, 0)
        self.hook_name = ""

    @property
    def active(self) -> bool:
        return self.log is not None

    def loss(self, value: float | torch.Tensor) -> None:
        """The loss of the iteration in progress (optional; NaN when never given)."""
        if self.log is not None:
            self._loss = float(value.detach() if isinstance(value, torch.Tensor) else value)

    def on_bucket(self, rec: BucketRecord) -> None:
        """A hook's record (called from gloo's threads): one ``ddp_bucket`` event."""
        if self.log is None:
            return
        with self._lock:
            self._buckets.append(rec)
            self.log.emit("ddp_bucket", iter=rec.iteration, bucket=rec.bucket, hook=rec.hook,
                          collective=rec.collective, raw_bytes=rec.raw_bytes,
                          payload_bytes=rec.payload_bytes, wire_bytes=rec.wire_bytes,
                          keep=rec.keep, compress_s=rec.compress_s, comm_s=rec.comm_s,
                          start_ns=rec.start_ns, end_ns=rec.end_ns, kind=f"b{rec.bucket}")

    def next_iteration(self) -> None:
        """Close the iteration in progress (its ``ddp_iter`` event) and open the next."""
        if self.log is None:
            return
        now = now_ns()
        tcp = own_tcp_bytes()
        if self._iteration >= 0:
            self._emit_iteration(now, tcp)
        self._iteration += 1
        self._start_ns, self._tcp, self._loss = now, tcp, math.nan

    def _emit_iteration(self, end_ns: int, tcp: tuple[int, int]) -> None:
        assert self.log is not None
        with self._lock:
            recs = [r for r in self._buckets if r.iteration == self._iteration]
            self._buckets = [r for r in self._buckets if r.iteration > self._iteration]
            first = min((r.launched_ns for r in recs), default=0)
            last = max((r.end_ns for r in recs), default=0)
            self.log.emit("ddp_iter", iter=self._iteration, hook=self.hook_name,
                          start_ns=self._start_ns, end_ns=end_ns,
                          iter_s=(end_ns - self._start_ns) / 1e9, loss=self._loss,
                          buckets=len(recs), raw_bytes=sum(r.raw_bytes for r in recs),
                          wire_bytes=sum(r.wire_bytes for r in recs),
                          compress_s=sum(r.compress_s for r in recs),
                          comm_s=(last - first) / 1e9 if recs else 0.0,
                          tcp_sent_bytes=tcp[0] - self._tcp[0],
                          tcp_received_bytes=tcp[1] - self._tcp[1])

    def close(self) -> None:
        """Write the last iteration and close the events file (also run at exit)."""
        if self.log is None:
            return
        if self._iteration >= 0:
            self._emit_iteration(now_ns(), own_tcp_bytes())
            self._iteration = -1
        self.log.close()
        self.log = None


def instrument(ddp_model: nn.Module, run_dir: str | Path | None = None) -> Instrument:
    """Record ``ddp_model``'s iterations and buckets into the gradbed run's events
    (module docstring). ``run_dir`` defaults to ``GRADBED_RUN_DIR``; without either this
    returns an inactive :class:`Instrument` and changes nothing."""
    where = run_dir if run_dir is not None else os.environ.get(RUN_DIR_ENV, "")
    if not where:
        return Instrument(None)
    rd = Path(where)
    inst = Instrument(EventLog.for_node(rd, rd.name, node_name()))
    listeners = _hook_listeners(ddp_model, inst)
    if listeners is not None:
        listeners.add(inst.on_bucket)

    def pre_forward(module: nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled():
            inst.next_iteration()

    ddp_model.register_forward_pre_hook(pre_forward)
    atexit.register(inst.close)
    return inst


def _hook_listeners(ddp_model: nn.Module, inst: Instrument) -> Listeners | None:
    """The listeners of the gradbed hook registered on ``ddp_model``; with no hook, gradbed's
    recorded dense all_reduce is registered first; another library's hook gives None (its
    buckets are not seen, the iterations are)."""
    hooks: list[tuple[Any, Any]] = getattr(ddp_model, "_comm_hooks", [])
    if not hooks:
        from gradbed.ddp.hooks import CompressState, HookConfig, compress_hook

        state = CompressState(HookConfig("allreduce"), getattr(ddp_model, "process_group",
                                                               None))
        ddp_model.register_comm_hook(state, compress_hook)  # type: ignore[operator]
        inst.hook_name = "allreduce"
        return state.listeners
    _, state = hooks[-1]
    listeners = getattr(state, "listeners", None)
    if isinstance(listeners, Listeners):
        inst.hook_name = getattr(getattr(state, "config", None), "name", "powersgd")
        return listeners
    return None
