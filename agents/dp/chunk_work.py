"""The PS's per-chunk arithmetic on a thread of its own, beside the event loop that reads.

What happens to a worker's chunk once its last byte is in splits in two. The event loop
(:mod:`agents.net.loop`, the PS's main thread) receives the bytes, checks every frame's
MAC and CRC (:class:`agents.net.wire.MessageReceiver`), keeps the conversation's rules
(:class:`agents.net.protocol.ChunkBarrier`) and writes what goes down. The arithmetic,
here, runs on one worker thread: decoding the payload, the gradient checks
(:func:`agents.compress.checks.check_gradient`: finite, bounded, no duplicate index) and
the add into the chunk's accumulator; once every active worker's chunk is added, the mean,
the SGD step, the check that the new weights are finite and the downlink payload's CRC.
torch's kernels release the GIL, so while chunk k is checked, added and stepped the loop
reads chunk k+1 and writes chunk k-1's weights: the receive, check, accumulate, send
pipeline of ps-lite's and BytePS's servers. On one thread the loop stood still for each
of those passes (docs/linerate.md).

The order of the floating-point additions is the workers' (``rank_order``, the
default, ``run.sum_order = "rank"``): a checked contribution is held until its chunk's
step, which adds what it holds in worker order, so the weights are the same bits whatever
order the network delivered them in (a sum of three or more floats depends on its order).
With ``rank_order`` off each is added as it arrives; jobs run one at a time in the order
the loop submitted them, the order the messages arrived. A step job is submitted after
every add of its chunk, so it runs after them, and it takes the mean over the
contributions its accumulator actually holds.

Every job's outcome comes back as data (:class:`Added`, :class:`Stepped`), in order, on a
queue the loop drains; :meth:`ChunkWork.start`'s ``wake`` interrupts the loop's wait. A
payload that fails a check adds nothing, and every later job of the same connection is
skipped, as the serial PS dropped the connection before reading on: the loop drops the
worker when it meets the :class:`Added` that says why.

Side effects: the thread writes the model's gradient buffer, parameters, momentum buffer
and downlink shadow, chunk by chunk. The owner reads a chunk's parameters only after its
:class:`Stepped` came back, and the whole model only when nothing is pending.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from agents.compress.base import Compressor, PayloadError
from agents.compress.checks import check_gradient, checked_sparse
from agents.compress.sparse import SparseCompressor
from agents.dp.aggregate import SparseAccumulator, weights_delta
from agents.net import codec, wire
from agents.net.codec import FrameHeader
from agents.workloads.base import FlatModel, sgd_step_

# What a decoder or a check raises for a payload a worker should not have sent.
PAYLOAD_ERRORS = (PayloadError, ValueError, RuntimeError, IndexError, TypeError)


@dataclass(frozen=True)
class AddJob:
    """Add ``tensors`` (worker ``worker``'s chunk ``header.chunk``, received on ``conn``)
    to that chunk's accumulator; ``n_active``: the workers active when it arrived (the
    first add of a chunk scales every contribution by 1/n)."""
    conn: Hashable
    worker: int
    header: FrameHeader
    tensors: list[torch.Tensor]
    n_active: int


@dataclass(frozen=True)
class StepJob:
    """Step chunk ``chunk`` of iteration ``iteration`` at learning rate ``lr``."""
    chunk: int
    iteration: int
    lr: float


@dataclass(frozen=True)
class Added:
    """An :class:`AddJob`'s outcome: added (``error`` None), refused (``error`` says why,
    naming the worker and chunk), or ``skipped``: an earlier payload of the same
    connection was refused."""
    job: AddJob
    error: str | None = None
    skipped: bool = False
    dense: bool = False  # added densely: the received tensors are free again


@dataclass(frozen=True)
class Stepped:
    """A :class:`StepJob`'s outcome: the downlink message (``msg_type``, ``tensors``, their
    payload ``crcs``), whether the chunk's new weights are all finite, and the seconds the
    mean and the step took."""
    job: StepJob
    msg_type: codec.MsgType
    tensors: list[torch.Tensor]
    crcs: list[int]
    finite: bool
    agg_s: float


@dataclass
class _Failed:
    """A job that raised something no payload explains (a bug): the loop re-raises it."""
    error: BaseException
    job: AddJob | StepJob | None = field(default=None)


Outcome = Added | Stepped


class ChunkWork:
    """The accumulators and the optimizer state of a PS, and the thread that works on them.

    ``chunks``: the model's chunk ranges; ``momentum``: SGD momentum the PS applies (0
    when the workers apply it, DGC's momentum correction); ``shadow``: what the workers
    hold, for the sparse-delta downlink (None: dense weights go down); ``max_abs_grad``:
    ``guard.max_abs_grad``. Submit with :meth:`add` and :meth:`step`, collect with
    :meth:`outcomes`."""

    def __init__(self, model: FlatModel, chunks: list[tuple[int, int]], compressor: Compressor,
                 *, momentum: float, shadow: torch.Tensor | None, max_abs_grad: float,
                 rank_order: bool = True) -> None:
        self.model = model
        self.chunks = chunks
        self.compressor = compressor
        self.momentum = momentum
        self.shadow = shadow
        self.max_abs_grad = max_abs_grad
        # One accumulator per chunk for the whole run: reset in place, never reallocated.
        # Each sums straight into its slice of the gradient buffer, already divided by the
        # workers expected, so stepping a chunk needs no pass to write the mean.
        self.acc = [SparseAccumulator(e - s, torch.float32, into=model.flat_grad[s:e])
                    for s, e in chunks]
        self.momentum_buf = torch.zeros_like(model.flat_params) if momentum > 0 else None
        # Per chunk, the checked contributions waiting for its step (rank_order): worker ->
        # the add, and the workers active when the first arrived.
        self.rank_order = rank_order
        self._held: list[dict[int, Callable[[], None]]] = [{} for _ in chunks]
        self._held_n = [0] * len(chunks)
        self._jobs: queue.SimpleQueue[AddJob | StepJob | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Outcome | _Failed] = queue.SimpleQueue()
        self._refused: set[Hashable] = set()  # connections with a refused payload
        self._thread: threading.Thread | None = None
        self._wake: Callable[[], None] = lambda: None

    def start(self, wake: Callable[[], None]) -> None:
        """Start the thread; ``wake()`` is called after each outcome is ready."""
        self._wake = wake
        self._thread = threading.Thread(target=self._run, name="chunk-work", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Finish the jobs submitted and end the thread."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def submit(self, job: AddJob | StepJob) -> None:
        """Queue a job behind those submitted before."""
        self._jobs.put(job)

    def outcomes(self) -> list[Outcome]:
        """The outcomes ready now, in submission order. A job that failed for a reason no
        payload explains re-raises here, on the owner's thread."""
        out: list[Outcome] = []
        while True:
            try:
                o = self._done.get_nowait()
            except queue.Empty:
                return out
            if isinstance(o, _Failed):
                raise RuntimeError(f"PS chunk work failed on {o.job}") from o.error
            out.append(o)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._done.put(self._added(job) if isinstance(job, AddJob)
                               else self._stepped(job))
            except BaseException as e:  # noqa: BLE001  (handed to the owner's thread)
                self._done.put(_Failed(e, job))
            self._wake()

    # -- the jobs, on the thread ----------------------------------------------------------

    def _added(self, job: AddJob) -> Added:
        """Decode, check and add one worker's chunk: nothing is added unless every check
        passes."""
        if job.conn in self._refused:
            return Added(job, skipped=True)
        c, w = job.header.chunk, job.worker
        s, e = self.chunks[c]
        who = f"worker {w} chunk {c}"
        a = self.acc[c]
        try:
            payload = self.compressor.from_parts(job.tensors, e - s, (e - s,), torch.float32)
            sparse = self.compressor.decompress_sparse(payload)
            if sparse is not None:
                # Every check first (range, finite, bounded, no duplicate index), then the
                # add in the order the duplicate test sorted: nothing added if it fails.
                idx, values = checked_sparse(
                    *sparse, e - s, who=who, max_abs=self.max_abs_grad,
                    unique_indices=isinstance(self.compressor, SparseCompressor))
                self._add(job, lambda: a.add_sparse(idx, values, who=who, validate=False))
                return Added(job)
            dense = self.compressor.decompress(payload).reshape(-1)
            check_gradient(None, dense, e - s, who=who, max_abs=self.max_abs_grad,
                           unique_indices=False)
            # Held, it is copied: the received buffers go back to the pool now.
            kept = dense.clone() if self.rank_order else dense
            self._add(job, lambda: a.add_dense(kept, who=who))
        except PAYLOAD_ERRORS as err:
            self._refused.add(job.conn)
            msg = str(err) if str(err).startswith(f"worker {w}") else f"{who}: {err}"
            return Added(job, error=msg)
        return Added(job, dense=True)

    def _add(self, job: AddJob, add: Callable[[], None]) -> None:
        """Add one checked contribution now, or hold it for its chunk's step (rank_order)."""
        c = job.header.chunk
        if self.rank_order:
            if not self._held[c]:
                self._held_n[c] = job.n_active
            self._held[c][job.worker] = add
            return
        if self.acc[c].added == 0:
            self.acc[c].expect(job.n_active)
        add()

    def _add_held(self, c: int) -> None:
        """Chunk ``c``'s held contributions, in worker order."""
        held, self._held[c] = self._held[c], {}
        if held:
            self.acc[c].expect(self._held_n[c])
        for w in sorted(held):
            held[w]()

    def _stepped(self, job: StepJob) -> Stepped:
        """Mean and SGD step of one chunk (SGD is elementwise, so chunk-wise steps are
        exactly one whole-model step), then its downlink payload; the accumulator is
        reset for the next iteration."""
        t0 = time.perf_counter()
        c = job.chunk
        s, e = self.chunks[c]
        self._add_held(c)
        acc = self.acc[c]
        grad = self.model.flat_grad[s:e]
        params = self.model.flat_params[s:e]
        if acc.added:
            acc.result(mean_over=acc.added, out=grad)
        sgd_step_(params, grad, None if self.momentum_buf is None else self.momentum_buf[s:e],
                  lr=job.lr, momentum=self.momentum, first=job.iteration == 0)
        acc.reset()
        # aminmax: one pass with no allocation (isfinite().all() over the whole model made
        # a mask and took longer than the step), and a NaN or an infinity shows in it.
        finite = e == s or all(math.isfinite(float(x)) for x in torch.aminmax(params))
        if self.shadow is None:
            msg_type, tensors = codec.MsgType.WEIGHTS, [params]
        else:
            msg_type, tensors = codec.MsgType.UPDATE, weights_delta(params, self.shadow[s:e])
        agg_s = time.perf_counter() - t0
        # The same bytes go to every worker: one CRC pass, here rather than on the loop.
        return Stepped(job, msg_type, tensors, wire.payload_crcs(tensors), finite, agg_s)
