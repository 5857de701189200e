"""Expert hosts: E experts over H hosts, dispatch and combine as all-to-alls over TCP.

GShard's expert parallelism (arXiv:2006.16668) with DeepSpeed-MoE's parameter classes.
Host h owns experts ``[h E/H, (h+1) E/H)`` and a data-parallel replica of every shared
(non-expert) layer, sharded by :mod:`agents.moe.zero`. Each MoE layer's forward, per
host (one routing group: its own batch):

1. route its tokens (gate, top-k, capacity, drops) as :class:`~agents.moe.layer.MoELayer`;
2. dispatch, ``TOKENS``: send every host one message of two parts, how many rows it will
   get for each of its experts (int32, one per expert; a receiver refuses a count above
   the capacity before it reads on) and exactly those rows, expert by expert in slot
   order (one round: the counts used to go in a round of their own);
3. every host runs each of its experts once on the rows from all hosts, in host order;
4. combine, ``EXPERT_OUT``: send each host its rows' outputs back in the order they came.
   With ``moe.combine_after_dispatch`` (the default) a host tells every peer it holds
   its dispatch (``DISPATCH_DONE``, right after phase 2) and sends no combine frame
   before every peer has told it the same: otherwise a host whose rows all came early
   sends its outputs while a slower host still receives tokens, and that traffic shares
   the slower dispatch's busiest link (docs/moe.md: 10-15 % of its bytes). An early host
   cannot end its combine before the slowest host's outputs reach it anyway; the
   timeline shows its wait as ``dispatch_done``.

Phases 2 and 4 are autograd functions: their backward is the reverse exchange
(``EXPERT_OUT_GRAD``, ``TOKENS_GRAD``) with the sizes already known. The same layer in
one process with ``groups = H`` (:func:`agents.moe.layer.local_experts`) takes the same
decisions and runs each expert on the same rows in the same order.

Bytes: per layer, host h's uplink carries one dispatch message to each peer, its counts
part (``HEADER_SIZE`` + ``4 x experts/H`` bytes) and its rows part
(``HEADER_SIZE + 4 d x rows``) (:func:`dispatch_bytes`).

Every phase's start and end (CLOCK_MONOTONIC) is kept as a :class:`PhaseRecord`; the
role logs them as ``moe_phase`` events, which make the per-host timeline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agents.core.config import WorkloadConfig
from agents.core.moe_config import MoEConfig
from agents.moe.exchange import check_done
from agents.moe.expert_offload import ExpertOffload
from agents.moe.layer import Expert, MoELayer
from agents.moe.mesh import Mesh
from agents.moe.model import MoEClassifier, TokenData, build_model, host_batch, loss_fn
from agents.moe.zero import ShardedOptimizer
from agents.net.codec import HEADER_SIZE, DType, MsgType

CHUNK_EVAL = 0x40000000  # added to a layer's chunk id for the evaluation forward


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def owned_experts(h: int, experts: int, hosts: int) -> list[int]:
    per = experts // hosts
    return list(range(h * per, (h + 1) * per))


def dispatch_bytes(rows_to_peer: Sequence[int], d_model: int, experts_per_host: int) -> int:
    """Uplink bytes of one dispatch (both parts of each message) for the given rows sent
    to each peer."""
    return sum(2 * HEADER_SIZE + 4 * experts_per_host + 4 * d_model * r for r in rows_to_peer)


@dataclass
class PhaseRecord:
    """One phase of one step on this host. ``bytes_up``/``bytes_down``: frames on the
    wire (headers included); ``payload_up``/``payload_down``: tensor bytes only."""

    name: str
    layer: int
    start_ns: int
    end_ns: int
    bytes_up: int = 0
    bytes_down: int = 0
    payload_up: int = 0
    payload_down: int = 0

    def as_event(self) -> dict[str, Any]:
        return {"phase": self.name, "layer": self.layer, "start_ns": self.start_ns,
                "end_ns": self.end_ns, "dur_s": (self.end_ns - self.start_ns) / 1e9,
                "bytes_up": self.bytes_up, "bytes_down": self.bytes_down,
                "payload_up": self.payload_up, "payload_down": self.payload_down}


@dataclass
class StepLog:
    """A step's phases, and the experts this host ran, in order (``(layer, expert)``
    with at least one row): the use trace that offload (:mod:`agents.moe.offload`)
    replays, forward order then the same reversed for the backward."""

    phases: list[PhaseRecord] = field(default_factory=list)
    expert_uses: list[tuple[int, int]] = field(default_factory=list)

    def use_trace(self) -> list[tuple[int, int]]:
        return self.expert_uses + self.expert_uses[::-1]

    def timed_exchange(self, mesh: Mesh, name: str, layer: int, kind: MsgType, step: int,
                       chunk: int, sends: dict[int, torch.Tensor], recv_numel: dict[int, int],
                       dtype: DType = DType.FLOAT32) -> dict[int, torch.Tensor]:
        up0, down0 = sum(mesh.sent.values()), sum(mesh.received.values())
        t0 = now_ns()
        got = mesh.exchange(kind, step, chunk, sends, recv_numel, dtype)
        t1 = now_ns()
        item = dtype.itemsize
        self.phases.append(PhaseRecord(
            name, layer, t0, t1, sum(mesh.sent.values()) - up0,
            sum(mesh.received.values()) - down0,
            sum(t.numel() for t in sends.values()) * item, sum(recv_numel.values()) * item))
        return got


    def timed_dispatch(self, mesh: Mesh, name: str, layer: int, step: int, chunk: int,
                       sends: dict[int, tuple[torch.Tensor, torch.Tensor]], *, experts: int,
                       capacity: int, width: int) -> dict[int, tuple[list[int], torch.Tensor]]:
        """:meth:`Mesh.dispatch`, recorded as one phase: frames (counts parts included)
        as its bytes, the rows alone as its payload (the token payload)."""
        up0, down0 = sum(mesh.sent.values()), sum(mesh.received.values())
        t0 = now_ns()
        got = mesh.dispatch(step, chunk, sends, experts=experts, capacity=capacity,
                            width=width, layer=layer)
        t1 = now_ns()
        self.phases.append(PhaseRecord(
            name, layer, t0, t1, sum(mesh.sent.values()) - up0,
            sum(mesh.received.values()) - down0,
            4 * sum(r.numel() for _, r in sends.values()),
            4 * sum(r.numel() for _, r in got.values())))
        return got


class _AllToAll(torch.autograd.Function):
    """Rows to every peer forward; their gradients come back the same way, reversed."""

    @staticmethod
    def forward(ctx: Any, ex: Exchange, *sends: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.ex = ex
        ctx.send_rows = [t.shape[0] for t in sends]
        if ex.counts_to is not None:
            return ex.run_dispatch(list(sends))
        return ex.run(ex.fwd, ex.fwd_name, list(sends), ex.recv_rows)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        ex: Exchange = ctx.ex
        g = [torch.zeros(r, ex.width) if gr is None else gr
             for gr, r in zip(grads, ex.recv_rows, strict=True)]
        back = ex.run(ex.bwd, ex.bwd_name, g, ctx.send_rows)
        return (None, *back)


@dataclass
class Exchange:
    """One autograd all-to-all of [rows, width] float32 tensors, peers in ``mesh.peers``
    order; ``recv_rows[i]`` rows come from peer i."""

    mesh: Mesh
    log: StepLog
    step: int
    layer: int
    chunk: int
    width: int
    fwd: MsgType
    bwd: MsgType
    fwd_name: str
    bwd_name: str
    recv_rows: list[int]
    #: The dispatch: the counts to send each peer (rows per expert of its), carried with
    #: the rows in one message (:meth:`Mesh.dispatch`); the forward then sets
    #: ``counts_from`` (each peer's, checked) and ``recv_rows`` from them. None: a plain
    #: all-to-all whose sizes are known.
    counts_to: list[list[int]] | None = None
    capacity: int = 0  # the most rows a peer may send one expert (counts_to only)
    counts_from: list[list[int]] = field(default_factory=list)

    def run_dispatch(self, sends: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The forward of the dispatch: counts and rows to every peer in one round."""
        assert self.counts_to is not None
        peers = self.mesh.peers
        got = self.log.timed_dispatch(
            self.mesh, self.fwd_name, self.layer, self.step, self.chunk,
            {p: (torch.tensor(c, dtype=torch.int32), t.detach().reshape(-1))
             for p, c, t in zip(peers, self.counts_to, sends, strict=True)},
            experts=len(self.counts_to[0]), capacity=self.capacity, width=self.width)
        self.counts_from = [got[p][0] for p in peers]
        self.recv_rows = [sum(c) for c in self.counts_from]
        return tuple(got[p][1].reshape(r, self.width)
                     for p, r in zip(peers, self.recv_rows, strict=True))

    def run(self, kind: MsgType, name: str, sends: list[torch.Tensor],
            recv_rows: list[int]) -> tuple[torch.Tensor, ...]:
        peers = self.mesh.peers
        got = self.log.timed_exchange(
            self.mesh, name, self.layer, kind, self.step, self.chunk,
            {p: t.detach().reshape(-1) for p, t in zip(peers, sends, strict=True)},
            {p: r * self.width for p, r in zip(peers, recv_rows, strict=True)})
        return tuple(got[p].reshape(r, self.width) for p, r in zip(peers, recv_rows,
                                                                    strict=True))

    def __call__(self, sends: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(_AllToAll.apply(self, *sends))


class MeshRunner:
    """A :data:`~agents.moe.layer.Runner` that runs the layer's experts on their hosts."""

    def __init__(self, mesh: Mesh, layer_index: int, experts: int, *,
                 combine_after_dispatch: bool = True) -> None:
        self.mesh = mesh
        self.layer_index = layer_index
        self.experts = experts
        self.combine_after_dispatch = combine_after_dispatch
        self.step = 0
        self.chunk_base = 0
        self.log = StepLog()

    def __call__(self, layer: MoELayer, groups: list[list[torch.Tensor]]
                 ) -> list[list[torch.Tensor]]:
        if len(groups) != 1:
            raise ValueError(f"MeshRunner: a host routes one group, got {len(groups)}")
        inputs = groups[0]
        mesh, H, me = self.mesh, self.mesh.hosts, self.mesh.me
        width = inputs[0].shape[1]
        mine = owned_experts(me, self.experts, H)
        chunk = self.chunk_base + self.layer_index
        lay = self.layer_index
        counts_to = {p: [inputs[e].shape[0] for e in owned_experts(p, self.experts, H)]
                     for p in range(H)}
        # The dispatch: to every host, how many rows for each of its experts and the rows
        # themselves, expert by expert, in one message.
        def rows_for(p: int) -> torch.Tensor:
            return torch.cat([inputs[e] for e in owned_experts(p, self.experts, H)])
        dispatch = Exchange(mesh, self.log, self.step, lay, chunk, width, MsgType.TOKENS,
                            MsgType.TOKENS_GRAD, "dispatch_tokens", "tokens_grad", [],
                            counts_to=[counts_to[p] for p in mesh.peers],
                            capacity=layer.capacity)
        received = dict(zip(mesh.peers, dispatch([rows_for(p) for p in mesh.peers]),
                            strict=True))
        received[me] = rows_for(me)
        counts_from = dict(zip(mesh.peers, dispatch.counts_from, strict=True))
        counts_from[me] = counts_to[me]
        if self.combine_after_dispatch:
            # Tell every peer this host holds its dispatch (and how many rows came from
            # it); read theirs before the combine, after the experts ran.
            up0 = sum(mesh.sent.values())
            mesh.post(MsgType.DISPATCH_DONE, self.step, chunk,
                      {p: torch.tensor([sum(counts_from[p])], dtype=torch.int32)
                       for p in mesh.peers})
            done_up = sum(mesh.sent.values()) - up0
        # Experts: each runs once on the rows of all hosts, host 0's first.
        t0 = now_ns()
        by_src = {h: torch.split(received[h], counts_from[h]) for h in range(H)}
        outs_by_src: dict[int, list[torch.Tensor]] = {h: [] for h in range(H)}
        for i, e in enumerate(mine):
            rows = torch.cat([by_src[h][i] for h in range(H)])
            if rows.shape[0]:
                self.log.expert_uses.append((lay, e))
            y = layer.experts[str(e)](rows)
            for h, part in enumerate(torch.split(y, [counts_from[h][i] for h in range(H)])):
                outs_by_src[h].append(part)
        back_to = {h: torch.cat(outs_by_src[h]) for h in range(H)}
        self.log.phases.append(PhaseRecord("expert", lay, t0, now_ns()))
        if self.combine_after_dispatch:
            # No combine frame leaves before every host holds its dispatch.
            t0, down0 = now_ns(), sum(mesh.received.values())
            done = mesh.collect(MsgType.DISPATCH_DONE, self.step, chunk,
                                dict.fromkeys(mesh.peers, 1), DType.INT32)
            for p in mesh.peers:
                check_done(done[p], sum(counts_to[p]), f"expert host {me} <- {p}", lay)
            self.log.phases.append(PhaseRecord(
                "dispatch_done", lay, t0, now_ns(), done_up,
                sum(mesh.received.values()) - down0, 4 * len(mesh.peers),
                4 * len(mesh.peers)))
        # Combine: outputs back to their hosts, in the order the rows came.
        combine = Exchange(mesh, self.log, self.step, lay, chunk, width, MsgType.EXPERT_OUT,
                           MsgType.EXPERT_OUT_GRAD, "combine", "combine_grad",
                           [sum(counts_to[p]) for p in mesh.peers])
        returned = dict(zip(mesh.peers, combine([back_to[p] for p in mesh.peers]),
                            strict=True))
        returned[me] = back_to[me]
        out: list[torch.Tensor] = []
        for p in range(H):
            out += list(torch.split(returned[p], counts_to[p]))
        return [out]


class ExpertHost:
    """One expert host's model, optimizer and training step (the role wraps it)."""

    def __init__(self, cfg: MoEConfig, data: TokenData, me: int, mesh: Mesh | None, *,
                 seed: int, train: WorkloadConfig) -> None:
        # ``train``: the batch, learning rate and momentum every role reads from [workload].
        self.cfg = cfg
        self.train = train
        self.data = data
        self.me = me
        self.mesh = mesh
        self.hosts = cfg.hosts
        self.model: MoEClassifier = build_model(cfg, data, groups=1, seed=seed)
        self.mine = owned_experts(me, cfg.experts, cfg.hosts)
        self.runners: list[MeshRunner] = []
        for i, layer in enumerate(self.model.moe):
            assert isinstance(layer, MoELayer)
            layer.keep_experts(self.mine)
            if mesh is not None and cfg.hosts > 1:
                r = MeshRunner(mesh, i, cfg.experts,
                               combine_after_dispatch=cfg.combine_after_dispatch)
                layer.runner = r
                self.runners.append(r)
        self.opt = ShardedOptimizer(self.model, hosts=cfg.hosts, me=me,
                                    zero3_min_numel=cfg.zero3_min_numel, lr=train.lr,
                                    momentum=train.momentum)
        self.log = StepLog()
        for r in self.runners:
            r.log = self.log
        # Expert offload ([moe] offload_budget_bytes > 0): every expert use fetches its
        # parameters into the device budget (agents/moe/expert_offload.py).
        self.offload: ExpertOffload | None = None
        if cfg.offload_budget_bytes > 0:
            experts: dict[tuple[int, int], Expert] = {}
            for i, layer in enumerate(self.model.moe):
                assert isinstance(layer, MoELayer)
                for e in self.mine:
                    ex = layer.experts[str(e)]
                    assert isinstance(ex, Expert)
                    experts[(i, e)] = ex
            self.offload = ExpertOffload(experts, cfg.offload_budget_bytes,
                                         cfg.offload_policy, cfg.offload_device)

    def _set_step(self, step: int, chunk_base: int = 0) -> None:
        for r in self.runners:
            r.step = step
            r.chunk_base = chunk_base

    def train_step(self, step: int, dump: dict[str, Any] | None = None) -> dict[str, Any]:
        """One step; returns its scalars. ``dump`` (tests) receives logits, the local
        gradients before any reduction, and the routing."""
        self.log = StepLog()
        for r in self.runners:
            r.log = self.log
        self._set_step(step)
        if self.offload is not None:
            self.offload.begin_step()
        t_start = now_ns()
        self.opt.begin_step()
        # ZeRO-3: gather for the forward, free, gather again for the backward, free.
        self.opt.gather_before_use(self.mesh, step)
        t = now_ns()
        self.log.phases.append(PhaseRecord("all_gather_zero3", -1, t_start, t))
        self.opt.zero_grad()
        x, y = host_batch(self.data, step, self.hosts, self.train.batch_size, self.me)
        with self.opt.saving_gathered():  # autograd keeps no hold on the gathered buffer
            logits = self.model(x)
            loss, ce = loss_fn(self.model, logits, y, self.cfg.aux_loss_coef)
        self.opt.release()
        t_fwd = now_ns()
        self.opt.gather_before_backward(self.mesh, step)
        t_bg = now_ns()
        (loss / self.hosts).backward()
        self.opt.release()
        t_bwd = now_ns()
        self.log.phases.append(PhaseRecord("forward", -1, t, t_fwd))
        self.log.phases.append(PhaseRecord("all_gather_zero3_bwd", -1, t_fwd, t_bg))
        self.log.phases.append(PhaseRecord("backward", -1, t_bg, t_bwd))
        if dump is not None:
            dump["logits"] = logits.detach().clone()
            for name, p in self.model.named_parameters():
                assert p.grad is not None
                dump[f"grad/{name}"] = p.grad.detach().clone()
        self.opt.step(self.mesh, step)
        offload = None if self.offload is None else self.offload.end_step().as_event()
        t_end = now_ns()
        self.log.phases.append(PhaseRecord("reduce_scatter_and_update", -1, t_bwd, t_end))
        routing = []
        for i, layer in enumerate(self.model.moe):
            assert isinstance(layer, MoELayer) and layer.stats is not None
            st = layer.stats
            routing.append({"layer": i, "capacity": st.capacity, "tokens": st.tokens,
                            "kept": st.kept.tolist(), "dropped": st.dropped.tolist(),
                            "imbalance": st.imbalance})
        return {"expert_uses": self.log.use_trace(), "loss": float(loss.detach()),
                "ce": float(ce.detach()),
                "aux": float(self.model.aux_loss.detach()),
                "step_s": (t_end - t_start) / 1e9, "routing": routing,
                "bytes_by_class": self.opt.bytes_by_class(),
                "param_bytes": self.opt.param_bytes(), "grad_bytes": self.opt.grad_bytes(),
                "offload": offload}

    @torch.no_grad()
    def evaluate(self, step: int, n_images: int = 360) -> dict[str, float]:
        """Held-out loss and accuracy; every host evaluates its slice of the first
        ``n_images`` test images at once (the experts are spread), then the totals
        are all-gathered."""
        self._set_step(step, CHUNK_EVAL)
        if self.offload is not None:
            self.offload.begin_step()  # its own uses; the masters are current
        self.opt.gather_before_use(self.mesh, step)  # the updated ZeRO-3 shards
        per = n_images // self.hosts
        sl = slice(self.me * per, (self.me + 1) * per)
        x, y = self.data.floats(self.data.x_test[sl]), self.data.y_test[sl]
        logits = self.model(x)
        mine = torch.tensor([float(torch.nn.functional.cross_entropy(logits, y,
                                                                     reduction="sum")),
                             float((logits.argmax(1) == y).sum()), float(len(y))],
                            dtype=torch.float64)
        totals = mine.clone()
        if self.mesh is not None and self.hosts > 1:
            got = self.mesh.exchange(MsgType.ALL_GATHER, step, CHUNK_EVAL,
                                     dict.fromkeys(self.mesh.peers, mine),
                                     dict.fromkeys(self.mesh.peers, 3), DType.FLOAT64)
            for t in got.values():
                totals += t
        self.opt.release()
        self._set_step(step)
        return {"loss": float(totals[0] / totals[2]), "accuracy": float(totals[1] / totals[2])}

    def weights(self) -> dict[str, torch.Tensor]:
        """This host's view of the weights: shared (complete once gathered) and its experts."""
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}
