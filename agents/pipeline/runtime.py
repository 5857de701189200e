"""The stage runtime: steps one stage's schedule, action by action (the schedule is data,
:mod:`agents.core.schedules`; this is its interpreter, as ``torch.distributed.pipelining``
keeps ``_Action`` data apart from the runtime that executes it).

Each action goes to the part that does it: ``RA``/``RG`` take what the links received,
``SA``/``SG`` hand a tensor to the links, ``F``/``R``/``B``/``OPT`` run on the compute
(:mod:`agents.pipeline.compute`). Between actions the runtime holds what one action
leaves for a later one (a forward's output for its send, a received gradient for its
backward). Every action is a ``pp_action`` event; each step's last optimizer action
also ends the step (``pp_step_done``) and, on replica 0 at an evaluated step, sends the
fresh weights to the pipeline's PS.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from agents.core import config as cfgmod
from agents.core.events import now_ns
from agents.core.schedules import Action, Kind, Schedule
from agents.pipeline.common import LockedLog, is_eval_step
from agents.pipeline.compute import StageCompute
from agents.pipeline.links import StageLinks

Key = tuple[int, int]  # (micro-batch, chunk)


class Runtime:
    """Runs stage ``links.s``'s actions of ``schedule`` on ``compute`` over ``links``."""

    def __init__(self, cfg: cfgmod.ExperimentConfig, schedule: Schedule,
                 compute: StageCompute, links: StageLinks, log: LockedLog) -> None:
        self.cfg, self.m = cfg, cfg.pipeline.micro_batches
        self.schedule, self.compute, self.links, self.log = schedule, compute, links, log
        self.s = links.s
        self.actions = schedule.actions[self.s]
        self.recomputed = {(a.mb, a.chunk) for a in self.actions if a.kind is Kind.RECOMPUTE}
        # The chunk of each step's last optimizer action: the step ends there.
        self.last_opt = {a.mb: a.chunk for a in self.actions if a.kind is Kind.OPTIMIZER}
        self.outputs: dict[Key, torch.Tensor] = {}
        self.acts_in: dict[Key, torch.Tensor] = {}
        self.grads_in: dict[Key, torch.Tensor] = {}
        self.grads_out: dict[Key, torch.Tensor] = {}
        self.do: dict[Kind, Callable[[Action], int]] = {
            Kind.RECV_ACT: self._recv_act, Kind.RECV_GRAD: self._recv_grad,
            Kind.FORWARD: self._forward, Kind.RECOMPUTE: self._recompute,
            Kind.SEND_ACT: self._send_act, Kind.BACKWARD: self._backward,
            Kind.SEND_GRAD: self._send_grad, Kind.OPTIMIZER: self._optimizer}

    def run(self) -> None:
        step_start = now_ns()
        for a in self.actions:
            self.links.inbox.check()
            t0 = now_ns()
            nbytes = self.do[a.kind](a)
            step = a.mb if a.kind is Kind.OPTIMIZER else a.mb // self.m
            self.log.emit("pp_action", iter=step, kind=a.kind.value, mb=a.mb, chunk=a.chunk,
                          start_ns=t0, end_ns=now_ns(), bytes=nbytes,
                          held_bytes=self.compute.held_bytes)
            if a.kind is Kind.OPTIMIZER and a.chunk == self.last_opt[a.mb]:
                self._step_done(a.mb, step_start)
                step_start = now_ns()

    def _step_done(self, step: int, start_ns: int) -> None:
        lk = self.links
        self.log.emit("pp_step_done", iter=step, step_s=(now_ns() - start_ns) / 1e9,
                      loss=self.compute.step_loss(step),
                      peak_held_bytes=self.compute.peak_held_bytes,
                      bytes_down=lk.down.bytes_sent if lk.down else 0,
                      bytes_up=lk.up.bytes_sent if lk.up else 0)
        if lk.ps is not None and lk.replica == 0 and is_eval_step(self.cfg.run, step):
            lk.send_weights(step, self.compute.fresh_weights(step))

    # -- one method per action kind; each returns the bytes it put on the wire ------------

    def _recv_act(self, a: Action) -> int:
        self.acts_in[(a.mb, a.chunk)] = self.links.take(Kind.RECV_ACT, a.mb, a.chunk)
        return 0

    def _recv_grad(self, a: Action) -> int:
        self.grads_in[(a.mb, a.chunk)] = self.links.take(Kind.RECV_GRAD, a.mb, a.chunk)
        return 0

    def _forward(self, a: Action) -> int:
        key = (a.mb, a.chunk)
        x = (self.compute.first_input(a.mb) if self.schedule.position(self.s, a.chunk) == 0
             else self.acts_in.pop(key))
        # A forward recomputed later keeps no autograd graph now.
        grad = not (self.cfg.pipeline.recompute and key in self.recomputed)
        self.outputs[key] = self.compute.forward(a.mb, a.chunk, x, grad=grad)
        return 0

    def _recompute(self, a: Action) -> int:
        self.compute.recompute(a.mb, a.chunk)
        return 0

    def _send_act(self, a: Action) -> int:
        return self.links.send(Kind.SEND_ACT, a.mb, a.chunk, self.outputs.pop((a.mb, a.chunk)))

    def _backward(self, a: Action) -> int:
        key = (a.mb, a.chunk)
        self.outputs.pop(key, None)
        g_in = self.compute.backward(a.mb, a.chunk, self.grads_in.pop(key, None))
        if g_in is not None:
            self.grads_out[key] = g_in
        return 0

    def _send_grad(self, a: Action) -> int:
        return self.links.send(Kind.SEND_GRAD, a.mb, a.chunk,
                               self.grads_out.pop((a.mb, a.chunk)))

    def _optimizer(self, a: Action) -> int:
        average = self.links.average if self.cfg.pipeline.replicas > 1 else None
        self.compute.optimizer(a.mb, a.chunk, average)
        return 0
