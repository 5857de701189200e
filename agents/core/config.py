"""Experiment configuration: typed, frozen, validated dataclasses loaded from TOML.

A config file has one table per section below. Every field has a default, so a
file states only what differs. Dotted overrides from the command line
(``--set net.bottleneck_mbps=50``) are applied before validation. Every error
names the field, the value it got and what is allowed, e.g.::

    configs/demo.toml: net.bottleneck_mbps = -5: must be in [0.01, 10000] Mbit/s

Human strings such as "100mbit" are not accepted here: units live in the field
names (``rate_mbps``, ``queue_bytes``, ``delay_ms``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import tomllib
import types
import typing
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from agents.core.checks import (
    MAX_CONFIG_BYTES,
    MAX_NESTING,
    ConfigError,
    check_number,
    collect,
    collecting,
    fail,
    nesting_depth,
)
from agents.core.checks import check as _check
from agents.core.checks import check_registered as _check_name
from agents.core.cluster_config import ClusterConfig
from agents.core.feedback_config import LAYERWISE_COMPRESSORS, FeedbackConfig
from agents.core.guard_config import GuardConfig
from agents.core.lr_schedule import check_lr_schedule
from agents.core.moe_config import MoEConfig
from agents.core.pipeline_config import PipelineConfig
from agents.core.registry import COMPRESSOR, RATE_POLICY, RATIO_POLICY, WORKLOAD
from agents.core.topo_config import TopoConfig
from agents.core.torchrun_config import TorchrunConfig
from agents.core.vision_config import VisionConfig

__all__ = ["ConfigError"]


# The agents' allocator settings (controller.agent_env).
ALLOCATORS = ("steady", "default")


@dataclass(frozen=True)
class RunConfig:
    name: str = "run"                 # prefix of the run directory name
    iterations: int = 50              # training iterations (PS optimizer steps)
    seed: int = 0                     # seeds models, data order and compressors
    eval_every: int = 5               # PS evaluates held-out accuracy every N iterations
    device: str = "auto"              # "auto" picks CUDA when present, else "cpu"
    # The same bits from the same inputs on every run (agents/workloads/device.py): TF32
    # off, cuDNN deterministic, torch.use_deterministic_algorithms; off is faster on a GPU.
    deterministic: bool = True
    timeout_s: float = 900.0          # hard limit for the whole run; the run stops cleanly
    # An agent that sends no heartbeat on the control channel (every HEARTBEAT_S) for
    # this long is declared lost (docs/robustness.md says what follows, per role); lower
    # catches a hung agent sooner, but must outlast a loaded machine's longest pause.
    stall_timeout_s: float = 10.0
    # What a lost agent does to the run: "continue" goes on without it (a worker: the
    # bottleneck re-shaped to B/(N-1)); "stop" ends the run (exit status 4). The old name
    # ``on_worker_death`` is still read, with a deprecation message.
    on_agent_death: str = "continue"
    target_accuracy: float = 0.0      # summary reports time to reach it (0 = not reported)
    # The PS ends the run, completed, at its first evaluation that reaches target_accuracy
    # (data-parallel runs): a time-to-accuracy run need not train on to run.iterations.
    stop_at_target: bool = False
    # The first iterations (TCP slow start, first-touch allocations) left out of the
    # summary's iteration-time percentiles and utilisation; the events keep them all.
    warmup_iterations: int = 0
    # The agents' glibc malloc: "steady" fixes its thresholds (controller.agent_env), so an
    # iteration reuses the pages the last one freed instead of faulting in fresh ones;
    # "default" leaves glibc's adaptive thresholds as they are.
    allocator: str = "steady"
    # The order in which the PS adds a chunk's contributions: "rank" (worker 0, 1, ...,
    # whatever the order they arrived in: the network changes timing, never the weights)
    # or "arrival" (each added as it comes: no contribution held until the last, one copy
    # less per dense chunk, and float sums that follow the arrival order).
    sum_order: str = "rank"

    def validate(self, p: str) -> None:
        _check(self.iterations >= 1, f"{p}.iterations", self.iterations, "must be >= 1")
        _check(0 <= self.warmup_iterations < self.iterations, f"{p}.warmup_iterations",
               self.warmup_iterations, f"must be in [0, iterations={self.iterations})")
        _check(self.eval_every >= 1, f"{p}.eval_every", self.eval_every, "must be >= 1")
        _check(self.device in ("auto", "cpu", "cuda"), f"{p}.device", self.device,
               "must be one of auto, cpu, cuda")
        _check(self.timeout_s > 0, f"{p}.timeout_s", self.timeout_s, "must be > 0")
        _check(self.stall_timeout_s >= 3 * HEARTBEAT_S, f"{p}.stall_timeout_s",
               self.stall_timeout_s, f"must be >= {3 * HEARTBEAT_S:g} s (three heartbeats)")
        _check(self.sum_order in ("rank", "arrival"), f"{p}.sum_order", self.sum_order,
               "must be 'rank' or 'arrival'")
        _check(self.on_agent_death in ("continue", "stop"), f"{p}.on_agent_death",
               self.on_agent_death, "must be 'continue' or 'stop'")
        _check(0.0 <= self.target_accuracy <= 1.0, f"{p}.target_accuracy",
               self.target_accuracy, "must be in [0, 1]")
        _check(not self.stop_at_target or self.target_accuracy > 0, f"{p}.stop_at_target",
               self.stop_at_target, "needs run.target_accuracy > 0 (the accuracy to stop at)")
        _check(RUN_NAME.fullmatch(self.name) is not None, f"{p}.name", self.name[:80],
               f"must be 1 to {RUN_NAME_MAX} characters of A-Z a-z 0-9 . _ - "
               "(it names the run's directory)")
        _check(self.allocator in ALLOCATORS, f"{p}.allocator", self.allocator,
               f"must be {' or '.join(ALLOCATORS)}")

    @property
    def on_worker_death(self) -> str:
        """The old name of :attr:`on_agent_death`."""
        return self.on_agent_death


#: How often every agent says it is alive on the control channel (agents.net.control);
#: ``run.stall_timeout_s`` is counted in these.
HEARTBEAT_S = 1.0


#: A run's name becomes a folder's and a socket's name: short, and no character a file
#: system, a shell or a terminal reads differently.
RUN_NAME_MAX = 64
RUN_NAME = re.compile(rf"[A-Za-z0-9._-]{{1,{RUN_NAME_MAX}}}")


LOSS_MODELS = ("statistic", "seeded")
PORT_MAX = 65535 - 512


@dataclass(frozen=True)
class NetConfig:
    workers: int = 4                  # N worker hosts behind the switch
    worker_link_mbps: float = 1000.0  # each worker's access link (both directions)
    bottleneck_mbps: float = 100.0    # switch -> PS (gradients go up through it)
    bottleneck_down_mbps: float = 0.0 # PS -> switch; 0 = same as bottleneck_mbps
    queue_bytes: int = 1_000_000      # bfifo limit on the bottleneck; deeper = more delay, fewer drops
    delay_ms: float = 0.0             # one-way delay on the bottleneck (netem, else NFQUEUE)
    loss_pct: float = 0.0             # random loss on the bottleneck (netem, else statistic)
    # "statistic": netem, else the kernel's statistic match (cannot be seeded: the packets
    # lost differ between runs); "seeded": the delay line (NFQUEUE) drops the packets a
    # PRNG seeded from run.seed and the link's name draws (topo.loss): the same packets in
    # every run with the same seed.
    loss_model: str = "statistic"
    congestion: str = "cubic"         # TCP congestion control in every host: reno, cubic, bbr
    offload: bool = False             # GSO/TSO/GRO; off gives packet-exact queues
    # Every host's own egress sends pure ACKs ahead of its queued data, within the same
    # rate. Under a link/N cap a worker's upload queues there (90-200 KB measured at 6.25
    # Mbit/s with bbr: 0.1-0.25 s), and the ACKs of its download would wait behind it.
    ack_first: bool = True
    background_hosts: int = 0         # extra hosts on the worker side for cross traffic
    # The first port the run's agents listen on: the PS's; a pipeline's stage s of replica r
    # listens on port + r * stages + s and its PS on port; MoE expert hosts on port (on
    # loopback, port + host index).
    port: int = 5000

    @property
    def down_mbps(self) -> float:
        return self.bottleneck_down_mbps or self.bottleneck_mbps

    def validate(self, p: str) -> None:
        _check(1 <= self.workers <= 64, f"{p}.workers", self.workers, "must be in [1, 64]")
        for name in ("worker_link_mbps", "bottleneck_mbps"):
            v = getattr(self, name)
            _check(0.01 <= v <= 10_000, f"{p}.{name}", v, "must be in [0.01, 10000] Mbit/s")
        _check(self.bottleneck_down_mbps == 0 or 0.01 <= self.bottleneck_down_mbps <= 10_000,
               f"{p}.bottleneck_down_mbps", self.bottleneck_down_mbps,
               "must be 0 (same as up) or in [0.01, 10000] Mbit/s")
        _check(1500 <= self.queue_bytes <= 1_000_000_000, f"{p}.queue_bytes",
               self.queue_bytes, "must be in [1500, 1e9] bytes")
        _check(0 <= self.delay_ms <= 10_000, f"{p}.delay_ms", self.delay_ms,
               "must be in [0, 10000] ms")
        _check(0 <= self.loss_pct <= 100, f"{p}.loss_pct", self.loss_pct,
               "must be in [0, 100] %")
        _check(self.loss_model in LOSS_MODELS, f"{p}.loss_model", self.loss_model,
               f"must be one of {', '.join(LOSS_MODELS)}")
        _check(self.congestion in ("reno", "cubic", "bbr"), f"{p}.congestion",
               self.congestion, "must be one of reno, cubic, bbr")
        _check(0 <= self.background_hosts <= 32, f"{p}.background_hosts",
               self.background_hosts, "must be in [0, 32]")
        _check(1024 <= self.port <= PORT_MAX, f"{p}.port", self.port,
               f"must be in [1024, {PORT_MAX}] (up to 512 listeners count up from it)")


@dataclass(frozen=True)
class WorkloadConfig:
    # a registered workload (agents/workloads/): digits_mlp, digits_cnn, fashion_resnet
    # and fashion_vit (sized by [vision]), replay, ...
    name: str = "digits_mlp"
    # Per-worker batch (the global batch is N times this); an MoE expert host's images per
    # step (tokens = images x tokens per image).
    batch_size: int = 32
    lr: float = 0.1                   # SGD learning rate (at iteration 0): the PS's, a stage's, an expert host's
    # the lr over the run (agents/core/lr_schedule.py): constant, step (x lr_decay_factor at
    # each lr_decay_at fraction of run.iterations; DGC's recipe) or cosine
    lr_schedule: str = "constant"
    lr_decay_at: tuple[float, ...] = (0.5, 0.75)
    lr_decay_factor: float = 0.1
    momentum: float = 0.0             # SGD momentum (MoE: sharded with ZeRO for shared parameters)
    hidden: int = 512                 # digits_mlp: width of the two hidden layers
    channels: int = 16                # digits_cnn: first conv's channels (the second's x2)
    depth: int = 8                    # digits_deep: hidden Linear+ReLU blocks (pipeline stages)
    model: str = "resnet50"           # replay: whose per-layer gradient sizes to send
    compute_ms: float = 100.0         # replay: simulated forward+backward time per iteration
    replay_bytes: int = 0             # replay: >0 sends one flat gradient of this size instead
    chunk_bytes: int = 4_000_000      # gradients travel in buckets of at most this many bytes

    def validate(self, p: str) -> None:
        _check_name(WORKLOAD, f"{p}.name", self.name)
        _check(1 <= self.batch_size <= 4096, f"{p}.batch_size", self.batch_size,
               "must be in [1, 4096]")
        _check(0 < self.lr <= 10, f"{p}.lr", self.lr, "must be in (0, 10]")
        check_lr_schedule(p, self.lr_schedule, self.lr_decay_at, self.lr_decay_factor)
        _check(0 <= self.momentum < 1, f"{p}.momentum", self.momentum, "must be in [0, 1)")
        _check(1 <= self.hidden <= 65536, f"{p}.hidden", self.hidden, "must be in [1, 65536]")
        _check(1 <= self.depth <= 256, f"{p}.depth", self.depth, "must be in [1, 256]")
        _check(1 <= self.channels <= 1024, f"{p}.channels", self.channels,
               "must be in [1, 1024]")
        _check(self.model in ("resnet50", "resnet18"), f"{p}.model", self.model,
               "must be one of resnet50, resnet18")
        _check(0 <= self.compute_ms <= 600_000, f"{p}.compute_ms", self.compute_ms,
               "must be in [0, 600000] ms")
        _check(self.replay_bytes == 0 or 4096 <= self.replay_bytes <= 4_000_000_000,
               f"{p}.replay_bytes", self.replay_bytes, "must be 0 or in [4096, 4e9] bytes")
        _check(4096 <= self.chunk_bytes <= 1_000_000_000, f"{p}.chunk_bytes",
               self.chunk_bytes, "must be in [4096, 1e9] bytes")


@dataclass(frozen=True)
class CompressConfig:
    name: str = "none"                # compressor registered under this name
    # Fraction of elements kept, by the workers' compressor and by a pipeline's top-k (either
    # direction); lower = fewer bytes, more residual.
    ratio: float = 1.0
    # One fixed keep ratio per worker (worker i keeps worker_ratios[i]) instead of the one
    # `ratio`; empty = every worker keeps `ratio`. Only adaptive.policy = "fixed" reads it.
    worker_ratios: tuple[float, ...] = ()
    error_feedback: bool = True       # keep what was not sent and add it next iteration
    clip_global: float = 0.0          # T_global for DGC-style local clipping; 0 = off
    index_encoding: str = "int32"     # sparse indices on the wire: int32 or delta
    downlink: str = "weights"         # what the PS sends back: weights or update (sparse delta)
    params: dict[str, Any] = field(default_factory=dict)  # compressor-specific (levels, rank, ...)

    def validate(self, p: str) -> None:
        _check_name(COMPRESSOR, f"{p}.name", self.name)
        _check(0 < self.ratio <= 1, f"{p}.ratio", self.ratio, "must be in (0, 1]")
        for i, r in enumerate(self.worker_ratios):
            _check(0 < r <= 1, f"{p}.worker_ratios[{i}]", r, "must be in (0, 1]")
        _check(self.clip_global >= 0, f"{p}.clip_global", self.clip_global, "must be >= 0")
        _check(self.index_encoding in ("int32", "delta"), f"{p}.index_encoding",
               self.index_encoding, "must be int32 or delta")
        _check(self.downlink in ("weights", "update"), f"{p}.downlink", self.downlink,
               "must be weights or update")


@dataclass(frozen=True)
class ShapingConfig:
    method: str = "none"              # none, tc (HTB on worker egress) or pacing (SO_MAX_PACING_RATE)
    # The rate policy that sets the caps (agents/core/policies/): "linkn" = headroom x B/N
    # per active worker; "none" = no caps. It only acts when method is not none.
    policy: str = "linkn"
    headroom: float = 1.0             # cap = headroom * B / N; < 1 leaves the queue empty
    # The downlink (the PS paces each connection; on whenever method is not none):
    # "backlog" re-splits B_down by each connection's undelivered bytes every 20 ms, so a
    # connection that fell behind catches up; "equal" keeps a hard B_down / N each.
    downlink: str = "backlog"
    # With method tc, also cap each worker socket's pacing (SO_MAX_PACING_RATE) at
    # pace_guard x its tc cap, so a sender that overestimates its rate cannot flood the
    # cap's queue; 0 = off.
    pace_guard: float = 0.0

    def validate(self, p: str) -> None:
        _check(self.method in ("none", "tc", "pacing"), f"{p}.method", self.method,
               "must be one of none, tc, pacing")
        _check_name(RATE_POLICY, f"{p}.policy", self.policy)
        _check(self.downlink in ("backlog", "equal"), f"{p}.downlink", self.downlink,
               "must be backlog or equal")
        _check(0.1 <= self.headroom <= 2.0, f"{p}.headroom", self.headroom,
               "must be in [0.1, 2]")
        _check(self.pace_guard == 0 or 1.0 <= self.pace_guard <= 4.0, f"{p}.pace_guard",
               self.pace_guard, "must be 0 (off) or in [1, 4]")


@dataclass(frozen=True)
class AdaptiveConfig:
    """The ``[adaptive]`` section: which ratio policy, and the knobs of the adaptive one
    (``agents.core.policies.adaptive.AdaptiveRatio`` takes this object as it is).
    Constructing one validates it, so a policy built in code gets the config's checks."""

    policy: str = "fixed"             # a registered ratio policy: fixed (compress.ratio), adaptive (DESIGN 1.1), oracle
    # A rate counts as stable when consecutive samples agree, |r(t)-r(t+1)|/r(t) <= eps.
    # Larger: rt is found sooner but is noisier; smaller: more samples pass before any cut.
    eps: float = 0.1
    # Consecutive samples that must agree pairwise within eps before a rate counts as
    # stable (2 = one pair). More: fewer false positives, a later decision.
    min_samples: int = 2
    keep_min: float = 0.001           # the adaptive keep ratio never goes below this
    formula: str = "consistent"       # consistent (default) or literal (the patent's text)
    sample_ms: float = 20.0           # TCP_INFO sampling period during a transfer
    # r0, the reference rate: "planned" = this worker's share of the nominal bottleneck
    # (net.bottleneck_mbps / N, TCP payload), so a drop in B keeps the transfer on the
    # originally planned schedule across iterations; "start" = the kernel's delivery rate
    # as the transfer starts (DESIGN 1.1 read literally: reacts only within an iteration).
    r0: str = "planned"
    # With r0 = planned, carry the last stable rate into the next iteration. Off by
    # default: TCP restarts slow start after the compute phase, so a short (compressed)
    # transfer may never show a new stable rate and a stale low one would stay in force.
    carry_rt: bool = False
    ewma_alpha: float = 1.0           # smoothing of rate samples (1 = raw); lower = steadier
    # What the adaptive/oracle keep budgets: "bytes" (default; DESIGN 1.1 sends CR x the
    # gradient's bytes, so a sparse compressor keeps fewer elements to pay for its
    # indices) or "elements" (top-k at ratio keep, as the seed's last step reads).
    budget: str = "bytes"
    # The keep planned at r0 (a fraction of the dense bytes): the adaptive policy scales it
    # by rt / r0, the oracle fits plan_keep x the dense time. 1 = plan the dense gradient.
    plan_keep: float = 1.0
    # Under the adaptive and oracle policies the worker's kernel holds at most about this
    # many unsent bytes (TCP_NOTSENT_LOWAT): a write returns only once the data before it
    # is on its way, so DESIGN 1.1's "sent" is bytes the kernel has sent and the TCP_INFO
    # rate is sampled for the whole transfer. Without it the autotuned send buffer (up to
    # tcp_wmem's 16 MB) swallows a whole gradient in a few ms, before any rate sample, and
    # every keep is decided blind.
    notsent_lowat_bytes: int = 16_384
    # Where the adaptive policy's rate samples come from. "writes": bytes_acked deltas
    # sample_ms apart while the gradient is written (none when the writes take less than
    # sample_ms). "upload": also one sample per iteration, the ACK clock of the whole
    # upload (agents.core.policies.adaptive.ack_clock_rate_bps), and with carry_rt the
    # samples carry across iterations like rt, so short compressed uploads still move rt.
    # "drain": at most one sample per upload, the rate at which the kernel's transmit
    # stamps (SO_TIMESTAMPING) show its packets leaving the worker's own shaper over the
    # longest run in which each of them had waited there (so the link, not the writer,
    # window or bucket, set their pace: agents.core.drain, agents.net.txstamps); the keep is
    # planned on the minimum of the last drain_window samples, carried across iterations
    # (an upload without a sample changes nothing), and a minimum within eps of the plan
    # counts as the plan. Measurements on configs/heterogeneous.toml: docs/fidelity.md.
    rate_source: str = "writes"
    drain_window: int = 4

    def __post_init__(self) -> None:
        self.validate("adaptive")

    def validate(self, p: str) -> None:
        _check_name(RATIO_POLICY, f"{p}.policy", self.policy)
        _check(0 < self.eps < 1, f"{p}.eps", self.eps, "must be in (0, 1)")
        _check(2 <= self.min_samples <= 1000, f"{p}.min_samples", self.min_samples,
               "must be in [2, 1000] (stability compares consecutive samples)")
        _check(0 < self.keep_min <= 1, f"{p}.keep_min", self.keep_min, "must be in (0, 1]")
        _check(self.formula in ("consistent", "literal"), f"{p}.formula", self.formula,
               "must be consistent or literal")
        _check(1 <= self.sample_ms <= 10_000, f"{p}.sample_ms", self.sample_ms,
               "must be in [1, 10000] ms")
        _check(self.r0 in ("planned", "start"), f"{p}.r0", self.r0, "must be planned or start")
        _check(0 < self.ewma_alpha <= 1, f"{p}.ewma_alpha", self.ewma_alpha, "must be in (0, 1]")
        _check(self.budget in ("bytes", "elements"), f"{p}.budget", self.budget,
               "must be bytes or elements")
        _check(1024 <= self.notsent_lowat_bytes <= 64 << 20, f"{p}.notsent_lowat_bytes",
               self.notsent_lowat_bytes, "must be in [1024, 67108864] bytes")
        _check(0 < self.plan_keep <= 1, f"{p}.plan_keep", self.plan_keep, "must be in (0, 1]")
        _check(self.rate_source in ("writes", "upload", "drain"), f"{p}.rate_source",
               self.rate_source, "must be writes, upload or drain")
        _check(1 <= self.drain_window <= 1000, f"{p}.drain_window", self.drain_window,
               "must be in [1, 1000] drain samples")


@dataclass(frozen=True)
class TraceConfig:
    up: str = ""                      # bandwidth trace for the bottleneck, workers -> PS
    down: str = ""                    # bandwidth trace for PS -> workers
    granularity_ms: float = 100.0     # trace is replayed as rate steps of this length
    scale: float = 1.0                # multiplies every rate of the trace

    def validate(self, p: str) -> None:
        _check(10 <= self.granularity_ms <= 60_000, f"{p}.granularity_ms",
               self.granularity_ms, "must be in [10, 60000] ms")
        _check(0 < self.scale <= 1000, f"{p}.scale", self.scale, "must be in (0, 1000]")


@dataclass(frozen=True)
class MembershipConfig:
    # Each entry [worker, leave_at_iter, rejoin_at_iter]; rejoin -1 = never comes back.
    schedule: tuple[tuple[int, int, int], ...] = ()

    def validate(self, p: str) -> None:
        for i, entry in enumerate(self.schedule):
            _check(len(entry) == 3 and entry[1] >= 1 and (entry[2] == -1 or entry[2] > entry[1]),
                   f"{p}.schedule[{i}]", list(entry),
                   "must be [worker, leave_iter >= 1, rejoin_iter > leave_iter or -1]")


@dataclass(frozen=True)
class BackgroundConfig:
    # Cross traffic between each of net.background_hosts and the PS (controller/background.py):
    # "bulk" = long iperf3 TCP flows; "flows" = flows drawn from a flow-size CDF
    # (agents/traffic/flowgen.py), each a new connection, with their completion times.
    kind: str = "bulk"
    flows: int = 0                    # bulk: flows per background host (iperf3 -P); 0 = none
    direction: str = "up"             # bulk: up = host -> PS, with the gradients; down = PS -> host
    rate_mbps: float = 0.0            # bulk: per flow (iperf3 -b); 0 = as fast as TCP goes
    flow_cdf: str = ""                # flows: flow-size distribution file (agents/core/flowsize.py)
    flow_cdf_format: str = "auto"     # flows: auto, pairs, mean_pairs, tcl or flows (a flow list)
    flow_cdf_interpolation: str = ""  # flows: linear or step; "" = the format's habit
    flow_cdf_packet_bytes: int = 0    # flows: sizes are packets of this many bytes; 0 = bytes
    load_mbps: float = 0.0            # flows: offered load per background host; 0 = none
    pcap: str = ""                    # pcap: capture replayed by every background host, looped
    pcap_mbps: float = 0.0            # pcap: tcpreplay --mbps; 0 = the capture's own timing
    start_s: float = 0.0              # after the workers start
    duration_s: float = 0.0           # 0 = until the run ends
    congestion: str = ""              # "" = net.congestion

    @property
    def active(self) -> bool:
        if self.kind == "pcap":
            return bool(self.pcap)
        return self.flows > 0 if self.kind == "bulk" else self.load_mbps > 0

    def validate(self, p: str) -> None:
        _check(self.kind in ("bulk", "flows", "pcap"), f"{p}.kind", self.kind,
               "must be bulk, flows or pcap")
        _check(0 <= self.flows <= 16, f"{p}.flows", self.flows, "must be in [0, 16]")
        _check(0 <= self.load_mbps <= 10_000, f"{p}.load_mbps", self.load_mbps,
               "must be in [0, 10000] Mbit/s")
        _check(0 <= self.pcap_mbps <= 10_000, f"{p}.pcap_mbps", self.pcap_mbps,
               "must be in [0, 10000] Mbit/s (0 = the capture's timing)")
        _check(self.direction in ("up", "down"), f"{p}.direction", self.direction,
               "must be up or down")
        _check(0 <= self.rate_mbps <= 10_000, f"{p}.rate_mbps", self.rate_mbps,
               "must be in [0, 10000] Mbit/s (0 = unlimited)")
        _check(0 <= self.start_s <= 86_400, f"{p}.start_s", self.start_s,
               "must be in [0, 86400] s")
        _check(0 <= self.duration_s <= 86_400, f"{p}.duration_s", self.duration_s,
               "must be in [0, 86400] s (0 = until the run ends)")
        _check(self.congestion in ("", "reno", "cubic", "bbr"), f"{p}.congestion",
               self.congestion, "must be empty (net.congestion), reno, cubic or bbr")
        # Each kind has its own fields; one set for another kind is a mistake, not a no-op.
        _check(self.kind == "bulk" or self.flows == 0, f"{p}.flows", self.flows,
               f'is for kind = "bulk", not "{self.kind}"')
        _check(self.kind == "flows" or self.load_mbps == 0, f"{p}.load_mbps", self.load_mbps,
               f'is for kind = "flows", not "{self.kind}"')
        _check(self.kind == "pcap" or not self.pcap, f"{p}.pcap", self.pcap,
               f'is for kind = "pcap", not "{self.kind}"')
        _check(self.flow_cdf_format in ("auto", "pairs", "mean_pairs", "tcl", "flows"),
               f"{p}.flow_cdf_format", self.flow_cdf_format,
               "must be auto, pairs, mean_pairs, tcl or flows")
        _check(self.flow_cdf_interpolation in ("", "linear", "step"),
               f"{p}.flow_cdf_interpolation", self.flow_cdf_interpolation,
               'must be "" (the format\'s habit), linear or step')
        _check(0 <= self.flow_cdf_packet_bytes <= 65_536, f"{p}.flow_cdf_packet_bytes",
               self.flow_cdf_packet_bytes, "must be in [0, 65536] (0 = sizes in bytes)")
        if self.kind == "flows":
            _check(self.load_mbps == 0 or bool(self.flow_cdf), f"{p}.flow_cdf",
                   self.flow_cdf, 'must name a flow-size CDF file for kind = "flows"')
        if self.kind != "bulk":
            _check(self.direction == "up", f"{p}.direction", self.direction,
                   f'must be up for kind = "{self.kind}" (from the host to the PS)')


@dataclass(frozen=True)
class ExperimentConfig:
    run: RunConfig = field(default_factory=RunConfig)
    net: NetConfig = field(default_factory=NetConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    compress: CompressConfig = field(default_factory=CompressConfig)
    shaping: ShapingConfig = field(default_factory=ShapingConfig)
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    background: BackgroundConfig = field(default_factory=BackgroundConfig)
    topo: TopoConfig = field(default_factory=TopoConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    feedback: FeedbackConfig = field(default_factory=FeedbackConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    torchrun: TorchrunConfig = field(default_factory=TorchrunConfig)

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate(f.name)
        self.validate_across()

    def validate_across(self) -> None:
        """The checks that read more than one section."""
        for i, entry in enumerate(self.membership.schedule):
            _check(0 <= entry[0] < self.net.workers, f"membership.schedule[{i}][0]", entry[0],
                   f"must name a worker in [0, {self.net.workers - 1}]")
        ratios = self.compress.worker_ratios
        if ratios:
            _check(len(ratios) == self.net.workers, "compress.worker_ratios", list(ratios),
                   f"must have one ratio per worker (net.workers = {self.net.workers}), "
                   f"not {len(ratios)}")
            _check(self.adaptive.policy == "fixed", "compress.worker_ratios", list(ratios),
                   f'is read by adaptive.policy = "fixed" only, not "{self.adaptive.policy}"')
        if self.run.stop_at_target:
            _check(self.topo.role == "" and not self.torchrun.script, "run.stop_at_target",
                   True, "is read by the data-parallel PS only, not by a fabric role "
                   f"({self.topo.role!r}) or a torchrun script")
        bg = self.background
        if bg.active and self.net.background_hosts < 1:
            field_, value = {"bulk": ("background.flows", bg.flows),
                             "flows": ("background.load_mbps", bg.load_mbps),
                             "pcap": ("background.pcap", bg.pcap)}[bg.kind]
            _check(False, field_, value,
                   "needs net.background_hosts >= 1 (the hosts the flows start from)")
        if self.feedback.momentum_correction:
            _check(self.compress.error_feedback, "feedback.momentum_correction", True,
                   "needs compress.error_feedback = true (the corrected momentum lives in "
                   "the residual)")
            _check(self.workload.momentum > 0, "feedback.momentum_correction", True,
                   "needs workload.momentum > 0 (the momentum it moves onto the workers)")
        for name in ("per_layer", "dense_1d"):
            if getattr(self.feedback, name):
                _check(self.compress.name in LAYERWISE_COMPRESSORS, f"feedback.{name}", True,
                       f"needs compress.name in {list(LAYERWISE_COMPRESSORS)}, not "
                       f"{self.compress.name!r} (a sparse compressor that keeps k elements)")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["membership"]["schedule"] = [list(e) for e in self.membership.schedule]
        return d


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check one TOML value against a dataclass field type; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if tp is float:
        _check(isinstance(value, int | float) and not isinstance(value, bool), path, value,
               "must be a number")
        check_number(path, value)
        return float(value)
    if tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool), path, value,
               "must be an integer")
        check_number(path, value)
        return value
    if tp is bool:
        _check(isinstance(value, bool), path, value, "must be true or false")
        return value
    if tp is str:
        _check(isinstance(value, str), path, value, "must be a string")
        return value
    if origin is dict:
        _check(isinstance(value, dict), path, value, "must be a table")
        return dict(value)
    if origin is tuple:
        _check(isinstance(value, list | tuple), path, value, "must be a list")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
        _check(len(value) == len(args), path, value, f"must have {len(args)} entries")
        return tuple(_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if isinstance(tp, types.UnionType):
        return value
    raise ConfigError(f"{path}: unsupported field type {tp}")


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            fail(f"{prefix}.{key}: unknown field; known fields: {', '.join(sorted(names))}")
            continue
        errors = collecting()
        before = len(errors) if errors is not None else 0
        try:
            coerced = _coerce(value, hints[key], f"{prefix}.{key}")
        except (TypeError, ValueError):  # converting a value already reported as wrong
            if errors is None or len(errors) == before:
                raise
        if errors is None or len(errors) == before:  # a bad value keeps the default
            kwargs[key] = coerced
    return cls(**kwargs)


# Old field names still read, each with the one name that replaced it (docs/configuration.md
# says why each concept has this name). Reading one warns (ConfigDeprecation), naming the new.
RENAMED: dict[str, str] = {
    "net.ps_port": "net.port",
    "moe.port": "net.port",
    "pipeline.base_port": "net.port",
    "pipeline.ratio": "compress.ratio",
    "moe.lr": "workload.lr",
    "moe.momentum": "workload.momentum",
    "moe.batch_size": "workload.batch_size",
    "run.on_worker_death": "run.on_agent_death",
}


class ConfigDeprecation(FutureWarning):
    """A config uses an old field name (:data:`RENAMED`); the value is read under the new
    one. A FutureWarning, so Python shows it to the user on stderr by default."""


def _renamed(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with every old field name moved to its new one, each warned about once. An
    old and a new name given different values is an error: which one was meant is unknown."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for old, new in RENAMED.items():
        old_section, old_field = old.split(".")
        new_section, new_field = new.split(".")
        section = out.get(old_section)
        if not isinstance(section, dict) or old_field not in section:
            continue
        value = section.pop(old_field)
        target = out.setdefault(new_section, {})
        if not isinstance(target, dict):
            continue  # reported as a section that is not a table
        if new_field in target and target[new_field] != value:
            fail(f"{old} = {value!r}: is the old name of {new}, which is set to "
                 f"{target[new_field]!r}; keep {new} only")
            continue
        target[new_field] = value
        warnings.warn(f"{old} is deprecated: it is now {new} (read as {new} = {value!r})",
                      ConfigDeprecation, stacklevel=3)
    return out


def from_dict(data: dict[str, Any]) -> ExperimentConfig:
    """Build and validate a config; raises one ConfigError listing every error found. Old
    field names (:data:`RENAMED`) are read under their new names with a
    :class:`ConfigDeprecation` warning."""
    if nesting_depth(data) > MAX_NESTING:
        raise ConfigError(f"tables and arrays nested deeper than {MAX_NESTING} levels")
    with collect() as errors:
        data = _renamed(data)
        sections = {f.name: f for f in dataclasses.fields(ExperimentConfig)}
        hints = typing.get_type_hints(ExperimentConfig)
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key not in sections:
                fail(f"{key}: unknown section; known sections: {', '.join(sorted(sections))}")
            elif not isinstance(value, dict):
                fail(f"{key} = {value!r}: must be a table [{key}]")
            else:
                kwargs[key] = _build(hints[key], value, key)
        cfg = ExperimentConfig(**kwargs)
        for name in sections:
            _run_check(functools.partial(getattr(cfg, name).validate, name), errors)
        _run_check(cfg.validate_across, errors)
    if errors:
        # A section built with a bad value checks itself twice (constructing it and again
        # here); the author needs each error once, in the order found.
        raise ConfigError(list(dict.fromkeys(errors)))
    return cfg


def _run_check(validate: Callable[[], None], errors: list[str]) -> None:
    """Run one section's checks so that one section failing never hides the next: a
    ConfigError raised outright (not through ``checks.check``) joins the collection, and a
    check that trips over a value already reported as wrong is not news."""
    try:
        validate()
    except ConfigError as e:
        errors.extend(e.errors)
    except (TypeError, KeyError, ValueError):
        if not errors:
            raise


def parse_override(text: str) -> tuple[list[str], Any]:
    """``net.bottleneck_mbps=50`` -> (["net", "bottleneck_mbps"], 50). The value is
    read as a TOML literal when it is one (numbers, booleans, lists, quoted strings),
    otherwise taken as a bare string."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected dotted.key=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"--set {text[:80]!r}: key must be section.field (e.g. net.workers)")
    if len(parts) > MAX_NESTING:
        raise ConfigError(f"--set {key[:80]!r}...: key nested deeper than {MAX_NESTING} levels")
    try:
        value = loads_bounded(f"v = {raw}", f"--set {key}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return parts, value


def loads_bounded(text: str, what: str) -> dict[str, Any]:
    """``tomllib.loads``, refusing tables and arrays nested deeper than :data:`MAX_NESTING`
    levels with one line (tomllib recurses: a few hundred levels are a RecursionError)."""
    try:
        data = tomllib.loads(text)
    except RecursionError:
        data = None
    if data is None or nesting_depth(data) > MAX_NESTING:
        raise ConfigError(f"{what}: tables and arrays nested deeper than {MAX_NESTING} levels")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    out = _deepcopy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {text!r}: {p} is not a table")
        node[parts[-1]] = value
    return out


def _deepcopy(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _deepcopy(v) if isinstance(v, dict) else v for k, v in d.items()}


def read_toml(path: Path) -> dict[str, Any]:
    """The tables of the TOML file ``path``; every way reading it fails is one ConfigError
    naming the file (the config's and the sweep's loaders both read through here)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes; a config file "
                              "is at most that")
        return loads_bounded(raw.decode("utf-8"), str(path))
    except FileNotFoundError as e:
        raise ConfigError(f"{path}: config file not found") from e
    except IsADirectoryError as e:
        raise ConfigError(f"{path}: is a directory, not a config file") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a text file (not UTF-8)") from e
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {(e.strerror or str(e)).lower()}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e


def load(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """Load and validate a TOML config; errors are prefixed with the file name."""
    path = Path(path)
    data = read_toml(path)
    try:
        return from_dict(apply_overrides(data, overrides or []))
    except ConfigError as e:
        raise ConfigError([f"{path}: {m}" for m in e.errors]) from None


def dumps(cfg: ExperimentConfig) -> str:
    return tomli_w.dumps(cfg.to_dict())


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"net": {"workers": 4}}`` -> ``{"net.workers": 4}``: every table becomes its dotted
    keys (an empty table none), and a list a tuple, so the values can key a group or a set
    (the sweep's grid, the analysis's config columns)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        elif isinstance(v, list):
            out[key] = tuple(v)
        else:
            out[key] = v
    return out
