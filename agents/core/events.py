"""The event schema and the event log shared by every process of a run.

Every process (worker, PS, flow generator, controller) appends one JSON object per line to
``RUN_DIR/events/NODE.jsonl``. Each line is flushed as it is written, so a run killed at any
moment leaves every event up to that moment on disk. When the run ends (or is interrupted)
the controller converts each JSONL file into ``events/NODE.parquet``
(:func:`jsonl_to_parquet`).

Columns common to every event (the schema, version :data:`SCHEMA_VERSION`):

- ``ts_ns``  -- ``time.clock_gettime_ns(CLOCK_MONOTONIC)``; Mininet hosts share the kernel,
  so all nodes share this clock.
- ``run_id`` -- the run's id (the run directory's name).
- ``node``   -- ``ps``, ``w0`` .. ``wN-1``, a background host, or ``controller``.
- ``iter``   -- training iteration, ``-1`` when not tied to one.
- ``event``  -- the event type; the remaining keys are its fields.

**The schema is code**: :data:`EVENTS` below declares every event type, who emits it, what
it means and each of its fields (units in the names). ``python -m agents.core.events``
prints it. An event may leave a declared field out; it may not carry an undeclared one.

**Declaring a new event type** (or a new field of an existing one): add one ``_declare``
call to the table below, in the group of the process that emits it::

    _declare("stage_done", "stage", "a pipeline stage finished its micro-batch",
             micro_batch="index of the micro-batch in the iteration",
             fwd_s="forward time (s)")

then emit it with ``log.emit("stage_done", iter=i, micro_batch=m, fwd_s=dt)``. Emitting an
undeclared type or field raises :class:`UndeclaredEvent` when ``GRADBED_STRICT_EVENTS=1``
(``tests/conftest.py`` sets it, and agents started by the tests inherit it); elsewhere it is
written anyway with one warning on stderr, so a forgotten declaration never kills a run.
``tests/agents/core/test_events.py`` also checks every ``.emit("name", field=...)`` call in the source
against this table without running anything.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from agents.core.files import write_atomic_with

SCHEMA_VERSION = 1

#: Columns every event row carries, whatever its type.
COMMON_COLUMNS = ("ts_ns", "run_id", "node", "iter", "event")

#: Set to "1" to make an undeclared event type or field an error (the tests do).
STRICT_ENV = "GRADBED_STRICT_EVENTS"


class UndeclaredEvent(ValueError):
    """An event type, or a field of one, that :data:`EVENTS` does not declare."""


@dataclass(frozen=True)
class EventType:
    """One declared event type: who emits it (``by``), what it means, and its fields
    (name -> meaning, with the unit)."""

    name: str
    by: str
    meaning: str
    fields: Mapping[str, str]


EVENTS: dict[str, EventType] = {}


def _declare(name: str, by: str, meaning: str, **fields: str) -> None:
    if name in EVENTS:
        raise ValueError(f"event {name!r} declared twice")
    clash = set(fields) & set(COMMON_COLUMNS)
    if clash:
        raise ValueError(f"event {name!r}: {sorted(clash)} are common columns, not fields")
    EVENTS[name] = EventType(name, by, meaning, dict(fields))


# -- every agent with an authenticated connection (agents/net/handshake.py) ---------------
_declare("handshake", "any agent", "one handshake through the driver (agents.net.handshake), "
         "passed or refused",
         end="dial (this end opened the connection) or answer (it accepted it)",
         link="the connection's name (who, from where)",
         peer_role="answer: the role the peer's HELLO claimed; dial: the role expected",
         peer_index="the peer's index in that role",
         ok="whether the peer proved its key (and, dialing, welcomed us)",
         elapsed_ms="from the first byte to the end of the handshake (ms)",
         error="why it failed, when it did")

# -- worker (agents/dp/worker.py) --------------------------------------------------------------
_declare("joined", "worker", "the PS admitted this worker (HELLO answered by WELCOME and "
         "the weights); iter is the iteration it joins at")
_declare("left", "worker", "the worker left the run by the membership schedule (BYE sent)",
         rejoin_at="iteration it comes back at (-1: never)")
_declare("paced", "worker, ps", "a socket's SO_MAX_PACING_RATE was set by a controller command",
         rate_bps="the pacing rate (bit/s); 0 = no limit",
         worker="ps only: the worker whose connection was paced")
_declare("compute_done", "worker", "forward and backward of one iteration are done",
         compute_s="forward+backward (or replay's simulated) time (s)",
         loss="training loss of this worker's batch (NaN for replay)")
_declare("device_memory", "worker, stage, expert host", "this agent's peak GPU memory, at its end "
         "(only on CUDA; agents.workloads.device.memory_stats)",
         cuda_max_allocated_bytes="peak bytes the caching allocator handed out",
         cuda_max_reserved_bytes="peak bytes it held from the driver (the CUDA context "
         "is not counted)")
_declare("tcp_info", "worker", "one kernel TCP_INFO sample of the upload connection",
         bytes_acked="tcpi_bytes_acked (bytes)",
         delivery_rate_bps="tcpi_delivery_rate (bit/s)",
         rtt_us="smoothed RTT (us)", cwnd="congestion window (packets)",
         pacing_rate_bps="tcpi_pacing_rate (bit/s)",
         total_retrans="retransmitted segments since the connection opened",
         rate_bps="bytes_acked growth since the previous sample (bit/s); null on the first")
_declare("drain", "worker", "one upload's link rate from the kernel's transmit stamps "
         "(adaptive.rate_source = drain, agents.core.drain)",
         stamps="writes of the upload stamped on entering and leaving the shaper",
         waited="of them, packets that waited in the shaper (>= WAIT_MIN_NS)",
         rate_bps="queued_departure_rate_bps (bit/s); null: no queued run to time")
_declare("decision", "worker", "the ratio policy's keep for the chunks not yet sent",
         chunk="index of the chunk about to be compressed",
         r0_bps="reference rate r0 (bit/s)", rt_bps="latest stable rate rt (bit/s)",
         sent_bytes="dense bytes of this iteration already sent",
         remaining_bytes="dense bytes not yet sent",
         keep="fraction of the remaining chunks to send",
         overall_keep="fraction of the whole gradient sent this iteration",
         reason="why: stable, no-stable-rate, clamped-min, clamped-max, fixed, oracle, ...")
_declare("compress_done", "worker", "one chunk was compressed (and queued for sending)",
         key="chunk key (c0, c1, ...)", ratio="element ratio handed to the compressor",
         keep="the policy's keep (a byte budget under adaptive.budget = bytes)",
         raw_bytes="dense bytes of the chunk", wire_bytes="bytes the payload takes on the wire",
         residual_norm="L2 norm of the error-feedback residual after it",
         compress_s="compression time (s)")
_declare("send_done", "worker", "the whole gradient of one iteration is written to the socket",
         bytes="wire bytes sent", send_s="from the first chunk's compression to the last write (s)",
         start_ns="when the first chunk's compression began (CLOCK_MONOTONIC ns)")
_declare("recv_done", "worker", "the new weights of one iteration have arrived",
         bytes="wire bytes received", wait_s="from the last write to the last weight byte (s)",
         first_ns="when the first weight chunk's header arrived (CLOCK_MONOTONIC ns)")
_declare("iter_done", "worker", "one training iteration is over on this worker",
         iter_s="wall time of the iteration (s)", compute_s="forward+backward (s)",
         compress_s="compression, summed over chunks (s)", send_s="as in send_done (s)",
         wait_s="as in recv_done (s)", bytes_up="wire bytes sent",
         bytes_down="wire bytes received", loss="training loss",
         start_ns="when the iteration began (CLOCK_MONOTONIC ns): it spans start_ns to "
                  "start_ns + iter_s")
_declare("worker_error", "worker", "the worker stopped on an error", error="the message")

# -- parameter server (agents/dp/ps.py) ---------------------------------------------------------
_declare("ps_ready", "ps", "the PS listens and waits for the workers' HELLO",
         numel="model parameters", chunks="gradient chunks per iteration",
         compressor="compress.name")
_declare("worker_hello", "ps", "a worker connected and said HELLO",
         worker="worker index", peer="its address:port", join_at="iteration it asked for")
_declare("worker_joined", "ps", "a worker became active at this iteration", worker="index")
_declare("worker_left", "ps", "a worker said BYE", worker="index", reason="why")
_declare("worker_lost", "ps", "a worker's connection failed or sent garbage",
         worker="index", reason="why")
_declare("frame_error", "ps", "a malformed or unauthenticated frame, or a failed socket call",
         peer="address:port", worker="index when known", error="the message")
_declare("refused", "any agent that listens (agents.net.handshake.accept_forever), and the "
         "controller for its control socket (controller.control)",
         "connections refused at admission or in the handshake, aggregated: at most one "
         "event per (source, reason) per guard.refusal_report_interval_s",
         source="the peer's address (no port)", reason="why, in a few fixed words",
         count="refusals since the last event of this (source, reason)",
         example="the last refusal's full message")
_declare("agent_lost", "controller", "an agent was declared lost: its process ended, or "
         "it sent no heartbeat for run.stall_timeout_s",
         host="the agent's host",
         role="its role, or what it is under its role (stage_ps: the pipeline's PS)",
         reason="why",
         action="what follows: 'stop' ends the run, 'continue' goes on without it")
_declare("grads_in", "ps", "the last chunk of an iteration's gradients is in from every "
         "active worker (the end of the upload window)", workers="active workers")
_declare("eval", "ps, expert host 0", "held-out evaluation after an optimizer step",
         loss="held-out loss", accuracy="held-out accuracy (fraction)")
_declare("final_eval", "ps", "held-out evaluation of the final weights",
         loss="held-out loss", accuracy="held-out accuracy (fraction)")
_declare("weights_sent", "ps", "one iteration's new weights went to one worker (the kernel "
         "took the last byte)", worker="index", bytes="wire bytes sent",
         start_ns="the first chunk queued (CLOCK_MONOTONIC)",
         end_ns="the kernel took the last byte (CLOCK_MONOTONIC)")
_declare("ps_iter_done", "ps", "the PS finished an iteration (every chunk aggregated and sent)",
         agg_s="aggregation and optimizer time (s)", bytes_in="wire bytes received",
         bytes_out="wire bytes sent",
         rebalanced="downlink pacing changes the backlog split made this iteration",
         workers="active workers", elapsed_s="since the first iteration started (s)",
         rx_buffers_new="received payloads that needed a new tensor (agents.net.buffers)",
         rx_buffers_reused="received payloads that landed in a tensor used before",
         recv_calls="recv_into system calls on the workers' sockets this iteration")
_declare("ps_done", "ps", "the PS ended the run", reason="completed, stopped, or the error",
         at_target="true when run.stop_at_target ended it at an evaluation that reached "
                   "run.target_accuracy")

# -- flow generator (agents/traffic/flowgen.py) ------------------------------------------------------
_declare("flows_planned", "flowgen", "the background flows drawn from the CDF",
         flows="number of flows", bytes="their total size (bytes)",
         load_mbps="offered load (Mbit/s)", duration_s="arrival window (s)",
         cdf="the flow-size CDF file")
_declare("flow_done", "flowgen", "one background flow completed",
         flow="flow index", start_s="planned start (s after the source started)",
         size_bytes="flow size (bytes)", fct_s="flow completion time (s)")
_declare("flow_failed", "flowgen", "one background flow failed",
         flow="flow index", start_s="planned start (s)", size_bytes="flow size (bytes)",
         error="the message")
_declare("flow_skipped", "flowgen", "a flow was not started: max_concurrent flows were still running",
         flow="flow index", start_s="planned start (s)", size_bytes="flow size (bytes)")
_declare("flowgen_error", "flowgen", "the flow source stopped on an error",
         error="the message")
_declare("flow_unfinished", "flowgen", "a flow still running when the run ended",
         flow="flow index", start_s="planned start (s)", size_bytes="flow size (bytes)")
_declare("background", "flowgen, controller", "totals of one background host's traffic",
         host="the background host", bytes="payload bytes moved",
         mbps="bytes x 8 / seconds (Mbit/s)", seconds="duration (s)",
         flows="flows completed (flowgen)", failed="flows failed (flowgen)",
         skipped="flows skipped (flowgen)", unfinished="flows unfinished (flowgen)",
         packets="packets sent (pcap replay)", retransmits="TCP retransmissions (iperf3)",
         note="iperf3's own remark (e.g. interrupted)", error="why there are no totals")

# -- pipeline stage (agents/pipeline/stage.py) -------------------------------------------------------
_declare("stage_ready", "stage", "a pipeline stage holds its slices and is connected",
         stage="stage index", replica="pipeline replica (data-parallel index)",
         chunks="model chunks per stage (2 for the two-group schedule)",
         schedule="the schedule's registered name", params="parameters held",
         actions="actions in one step of its schedule")
_declare("pp_action", "stage", "one schedule action ran (iter = the micro-batch's step; for "
         "OPT, mb is the step)", kind="F B R SA RA SG RG OPT", mb="micro-batch",
         chunk="model chunk", start_ns="start (CLOCK_MONOTONIC)",
         end_ns="end (CLOCK_MONOTONIC)", bytes="bytes sent or received (0 for compute)",
         held_bytes="activation bytes held after the action")
_declare("pp_send", "stage", "a message written to the kernel by the stage's sender thread",
         kind="SA (activation) or SG (gradient)", mb="micro-batch", chunk="model chunk",
         to="the receiving stage", bytes="bytes on the wire (frame included)",
         start_ns="start (CLOCK_MONOTONIC)", end_ns="end (CLOCK_MONOTONIC)")
_declare("pp_recv", "stage", "a message from a neighbour stage was read whole by its "
         "reader thread (before decoding)", kind="RA (activation) or RG (gradient)",
         mb="micro-batch", chunk="model chunk", from_stage="the sending stage",
         arrived_ns="its last byte read (CLOCK_MONOTONIC)")
_declare("pp_step_done", "stage", "a pipeline step (all micro-batches and the optimizer) ended",
         step_s="wall seconds of the step", loss="mean loss of its micro-batches (last stage)",
         peak_held_bytes="peak activation bytes held so far",
         bytes_down="bytes sent downstream so far", bytes_up="bytes sent upstream so far")
_declare("pp_done", "stage", "the stage finished every step",
         stage="stage index", replica="pipeline replica",
         peak_held_bytes="peak activation bytes held", bytes_down="bytes sent downstream",
         bytes_up="bytes sent upstream")
_declare("stage_error", "stage", "the stage stopped on an error", error="the message")
_declare("pp_ps_send", "stage", "a message to the pipeline's PS written to the kernel",
         kind="G (slice gradient, d > 1) or W (slice weights for evaluation)",
         chunk="model chunk", bytes="bytes on the wire (frame included)",
         start_ns="start (CLOCK_MONOTONIC)", end_ns="end (CLOCK_MONOTONIC)")

# -- the pipeline's PS (agents/pipeline/stage_ps.py; node ps) -----------------------------------------
_declare("ps_slice_mean", "ps", "the PS averaged one stage chunk's gradient over the d "
         "replicas and queued the mean to each", stage="stage index", chunk="model chunk",
         replicas="gradients averaged (d)", bytes="wire bytes of the mean to one replica")
_declare("ps_slice_sent", "ps", "the pipeline's PS queued one mean to a stage (its event "
         "loop writes it as the socket takes it)",
         to="the stage's node (rRsS)", chunk="model chunk",
         bytes="bytes on the wire (frame included)")
_declare("ps_connected", "ps", "every stage has connected to the pipeline's PS, which serves "
         "them all on one event loop", stages="stage connections",
         threads="Python threads the PS process runs (threading.active_count())")

# -- MoE expert host (agents/moe/expert.py; nodes e0..eH-1) ---------------------------------------
_declare("moe_start", "expert", "the expert host joined the mesh and built its shards",
         hosts="expert hosts", experts="experts per MoE layer",
         owned="this host's expert indices", expert_numel="elements of its expert parameters",
         zero3_numel="elements of the split shared class (ZeRO-3)",
         zero2_numel="elements of the unsplit shared class (ZeRO-2)",
         max_frame_bytes="largest payload a peer may send this host")
_declare("moe_phase", "expert", "one phase of one step on this host (the timeline)",
         phase="forward, backward, dispatch_tokens (dispatch_counts in older runs), "
               "expert, combine, combine_grad, tokens_grad, all_gather_zero3, all_gather_zero3_bwd or "
               "reduce_scatter_and_update",
         layer="MoE layer, -1 for whole-model phases",
         start_ns="CLOCK_MONOTONIC at the start", end_ns="CLOCK_MONOTONIC at the end",
         dur_s="end - start (s)", bytes_up="frame bytes sent to peers (headers included)",
         bytes_down="frame bytes received from peers", payload_up="tensor bytes sent",
         payload_down="tensor bytes received")
_declare("moe_route", "expert", "this host's routing of one MoE layer in one step",
         layer="MoE layer", capacity="C per expert for this host's tokens",
         tokens="this host's tokens", kept="token choices kept, list per expert",
         dropped="token choices dropped for capacity, list per expert",
         imbalance="max / mean of kept (agents.core.moe_metrics.load_imbalance)")
_declare("moe_class_bytes", "expert", "uplink bytes per parameter class in one step",
         expert_bytes="expert parameters (never reduced: 0)",
         zero3_bytes="split shared class: reduce-scatter + 2 all-gathers (forward, backward)",
         zero2_bytes="unsplit shared class: reduce-scatter + all-gather frames",
         zero3_formula_bytes="3 (H-1) (4 ceil(N/H) + 64) for the split class",
         zero2_formula_bytes="2 (H-1) (4 ceil(N/H) + 64) for the unsplit class")
_declare("moe_param_bytes", "expert", "parameter bytes this host held in one step (sum of "
         "the distinct storages, agents.moe.zero.storage_bytes)",
         zero3_peak_bytes="split class after a gather: its buffer + the shard",
         zero3_freed_bytes="split class after its last free: the shard alone",
         zero3_peak_formula_bytes="4 ceil(N/H) (H + 1)",
         zero3_freed_formula_bytes="4 ceil(N/H)",
         zero3_buffers_kept_alive="freed gathered buffers something else still held (0)",
         zero2_bytes="unsplit class (full parameters on every host)",
         expert_bytes="this host's expert parameters (host memory)",
         host_peak_bytes="zero3 peak + zero2 + expert",
         host_freed_bytes="zero3 freed + zero2 + expert")
_declare("moe_grad_bytes", "expert", "gradient bytes this host held in one step around "
         "each shared class's reduce-scatter (sum of the distinct storages, "
         "agents.moe.zero.storage_bytes)",
         zero3_grad_peak_bytes="split class at the end of its reduce-scatter: full buffer + "
                               "summed shard",
         zero3_grad_freed_bytes="split class after the buffer's free: the summed shard alone",
         zero3_grad_peak_formula_bytes="4 ceil(N/H) (H + 1)",
         zero3_grad_freed_formula_bytes="4 ceil(N/H)",
         zero2_grad_peak_bytes="unsplit class at the end of its reduce-scatter: full buffer "
                               "+ summed shard",
         zero2_grad_freed_bytes="unsplit class after the buffer's free: the summed shard "
                                "alone",
         zero2_grad_peak_formula_bytes="4 ceil(N/H) (H + 1)",
         zero2_grad_freed_formula_bytes="4 ceil(N/H)",
         grad_buffers_kept_alive="freed gradient buffers something else still held (0)",
         expert_grad_bytes="this host's expert gradients (whole: never reduced)")
_declare("moe_step", "expert", "one training step is over on this expert host",
         loss="cross entropy + aux_loss_coef x aux loss", ce="cross entropy",
         aux="sum of the layers' load-balancing losses", step_s="step time (s)",
         expert_uses="'layer.expert' this host ran, in order (forward, then reversed)")
_declare("moe_offload", "expert", "this host's expert offload in one training step "
         "(agents/moe/expert_offload.py; with moe.offload_budget_bytes > 0)",
         policy="belady or lru", budget_bytes="device budget for experts (bytes)",
         device="cpu (counted clones) or cuda", uses="expert fetches (forward + backward)",
         transfers="host-to-device copies of an expert", bytes_moved="their bytes",
         hits="uses that found the expert resident", evictions="experts evicted",
         grad_bytes="device-to-host gradient bytes",
         peak_device_bytes="most expert bytes held on the device in the step")
_declare("moe_done", "expert", "the expert host finished its steps")
_declare("expert_error", "expert", "the expert host stopped on an error", error="the message")

# -- a DDP rank under gradbed torchrun (gradbed/ddp/instrument.py; node HOST or HOST.L) ----------
_declare("ddp_bucket", "DDP rank", "a DDP gradient bucket's collective finished (gradbed.ddp "
         "hook); start_ns..end_ns spans the hook's call to the decoded mean",
         bucket="DDP's bucket index", hook="the hook (topk, fp16, powersgd, allreduce, ...)",
         collective="allreduce or allgather", raw_bytes="the bucket's dense gradient (bytes)",
         payload_bytes="the compressed buffers this rank contributed (bytes)",
         wire_bytes="bytes this rank sends for it by the formula (gradbed.ddp.wire)",
         keep="the ratio the compressor was given (1 = dense)",
         compress_s="hook time before the collective was launched (s)",
         comm_s="from the collective's launch to the decoded mean (s)",
         start_ns="the hook was called (CLOCK_MONOTONIC)", end_ns="the mean was ready",
         kind="b<bucket index> (the timeline's label)")
_declare("ddp_iter", "DDP rank", "one DDP training iteration, forward to next forward",
         hook="the registered gradbed hook", start_ns="the forward began",
         end_ns="the next forward began (or the process exited)", iter_s="end - start (s)",
         loss="the loss given to Instrument.loss (NaN when not given)",
         buckets="buckets recorded", raw_bytes="their dense bytes",
         wire_bytes="their formula bytes", compress_s="summed hook time before launch (s)",
         comm_s="first launch to last result (s)",
         tcp_sent_bytes="tcpi_bytes_acked moved by this process's TCP sockets",
         tcp_received_bytes="tcpi_bytes_received likewise")

# -- controller (controller/run.py, controller/driver.py) ------------------------------------
_declare("run_start", "controller", "the network is up and the agents are starting",
         workers="net.workers", setup_s="time to build the network (s)")
_declare("run_end", "controller", "the run ended", reason="completed, timeout, interrupted, ...")
_declare("tc", "controller", "one tc command the topology ran", cmd="the command line")
_declare("trace_step", "controller", "the bottleneck rate changed (trace replay)",
         direction="up or down", rate_mbps="the new rate (Mbit/s)",
         applied_mbps="the HTB rate it was replayed as: rate_mbps, at least 0.01 (a zero "
                      "rate, a dark link, is 0.01; controller.driver.applied_rate_mbps)",
         index="step index in the trace", loop="how many times the trace wrapped",
         lag_ms="how late the change landed (ms)")
_declare("replay_error", "controller", "trace replay stopped on an error", error="the message")
_declare("membership", "controller", "the PS reported a new set of active workers",
         active="sorted worker indices")
_declare("shape", "controller", "a worker's rate cap was set (rate policy)",
         worker="worker index", rate_mbps="the cap (Mbit/s); null = no cap",
         method="tc or pacing", direction="up (worker egress) or down (the PS's socket)",
         delivered="false when the agent had no control connection yet",
         reason="cap, hello, pace_guard")


def check(event: str, fields: Mapping[str, Any]) -> None:
    """Raise :class:`UndeclaredEvent` unless ``event`` is declared with every key of
    ``fields``."""
    et = EVENTS.get(event)
    if et is None:
        raise UndeclaredEvent(f"event {event!r} is not declared in agents/core/events.py "
                              f"(declared: {', '.join(sorted(EVENTS))})")
    extra = sorted(set(fields) - set(et.fields))
    if extra:
        raise UndeclaredEvent(f"event {event!r}: undeclared field(s) {', '.join(extra)} "
                              f"(declared: {', '.join(et.fields) or 'none'}); declare them "
                              "in agents/core/events.py")


def clock_fields(event: str) -> tuple[str, ...]:
    """The fields of ``event`` that hold a CLOCK_MONOTONIC stamp (ns): ``ts_ns``, and every
    declared field whose meaning says CLOCK_MONOTONIC. These are what aligning another
    server's events onto the controller's clock shifts (``controller.remote``)."""
    et = EVENTS.get(event)
    own = [] if et is None else [k for k, v in et.fields.items() if "CLOCK_MONOTONIC" in v]
    return ("ts_ns", *own)


def strict_default() -> bool:
    """Whether undeclared events are errors in this process (``GRADBED_STRICT_EVENTS=1``)."""
    return os.environ.get(STRICT_ENV) == "1"


def describe() -> str:
    """The schema as text, one event type per paragraph."""
    out = []
    for et in EVENTS.values():
        out.append(f"{et.name}  ({et.by}): {et.meaning}")
        out += [f"    {k}: {v}" for k, v in et.fields.items()]
    return "\n".join(out)


def now_ns() -> int:
    """CLOCK_MONOTONIC in nanoseconds: the one clock every node of a run shares."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


class EventLog:
    """Append-only JSONL event writer for one node. Not thread-safe across processes:
    each node owns its own file."""

    def __init__(self, path: str | os.PathLike[str], run_id: str, node: str,
                 strict: bool | None = None) -> None:
        self.path = Path(path)
        # strict: an undeclared event raises; otherwise it is written with one warning.
        self.strict = strict_default() if strict is None else strict
        self._warned: set[str] = set()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id
        self.node = node
        self._fh: IO[str] | None = open(self.path, "a", buffering=1, encoding="utf-8")

    @classmethod
    def for_node(cls, run_dir: str | os.PathLike[str], run_id: str, node: str) -> EventLog:
        return cls(Path(run_dir) / "events" / f"{node}.jsonl", run_id, node)

    def emit(self, event: str, iter: int = -1, **fields: Any) -> None:
        """Append one event of a type declared in :data:`EVENTS`."""
        try:
            check(event, fields)
        except UndeclaredEvent as e:
            if self.strict:
                raise
            if event not in self._warned:
                self._warned.add(event)
                print(f"{self.node}: warning: {e}", file=sys.stderr)
        if self._fh is None:
            return
        row = {"ts_ns": now_ns(), "run_id": self.run_id, "node": self.node,
               "iter": int(iter), "event": event}
        row.update(fields)
        self._fh.write(json.dumps(row, default=_jsonable) + "\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read a JSONL event file. A truncated last line (a process killed mid-write)
    is skipped; any other bad line raises with the file and line number."""
    rows: list[dict[str, Any]] = []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if lineno == len(lines):
                break
            raise ValueError(f"{path}:{lineno}: bad event line: {e}") from e
    return rows


def jsonl_to_parquet(jsonl: str | os.PathLike[str]) -> Path:
    """Convert one node's JSONL events into Parquet beside it, atomically
    (write to a temporary name, then rename). Returns the Parquet path."""
    import pandas as pd

    src = Path(jsonl)
    dst = src.with_suffix(".parquet")
    rows = read_jsonl(src)
    df = pd.DataFrame(rows)
    for col in ("ts_ns", "iter"):
        if col in df:
            df[col] = df[col].astype("int64")
    # Mixed-type object columns (a field that is sometimes str, sometimes number)
    # cannot go to Arrow as-is; store them as strings.
    for col in df.columns:
        if df[col].dtype == object:
            kinds = {type(v) for v in df[col].dropna()}
            if len(kinds) > 1:
                df[col] = df[col].map(lambda v: None if v is None else str(v))
    write_atomic_with(dst, lambda fh: df.to_parquet(fh, index=False))
    return dst


if __name__ == "__main__":
    print(describe())
