"""The ``[topo]`` config section: which shape the network takes, and per-point traces.

A shape (``topo/shapes/``, one file each) turns the whole config into a network spec; this
section only picks it and adds what no other section says. The shape names are checked
against the shape registry when the network is planned (``topo.shapes.shape_spec``): the
core cannot import ``topo``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from agents.core.checks import check as _check

_POINT = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class TopoConfig:
    # "star": workers and background hosts on one switch, the switch->PS link the
    # bottleneck (net.bottleneck_mbps); "dumbbell": workers and background sources on one
    # switch, PS and background sinks on the other, the trunk the bottleneck; "fabric":
    # topo.hosts hosts on one switch, every access link shaped both ways.
    shape: str = "star"
    # Shaping point -> bandwidth trace replayed on it (Mahimahi or "time_s Mbps"), e.g.
    # {"w0.up" = "traces/data/cellular_like.trace"}: one worker behind a cellular uplink.
    # trace.up / trace.down are the same as "up" / "down" here.
    traces: dict[str, str] = field(default_factory=dict)
    hosts: int = 0                    # fabric: hosts gbh0..gbh{N-1}; 0 = net.workers
    role: str = ""                    # fabric: the role every host runs ("" = none)
    # Read every shaped point's HTB class counters this often into classes.parquet
    # (controller/class_sampler.py). Finer = one all-to-all phase resolved. 0 = off,
    # except MoE and pipeline runs on this machine, which take them every 5 ms for
    # agent_limited (controller.summary.FABRIC_CLASS_SAMPLE_MS).
    class_sample_ms: float = 0.0
    # fabric: every access link's HTB bucket (burst and cburst), as ms at the link rate
    # (topo.spec.LinkSpec.burst_ms); 0 = gradbed's default, 10 ms. An idle link drains
    # its full bucket at line rate when traffic starts again: configs/moe.toml takes 2 ms
    # so a ~50 ms all-to-all phase is not read up to 20 % above the link rate.
    access_burst_ms: float = 0.0

    def validate(self, p: str) -> None:
        _check(bool(re.match(r"^[a-z][a-z0-9_]*$", self.shape)), f"{p}.shape", self.shape,
               "must be a registered shape name (star, dumbbell, fabric, ...)")
        for point, path in self.traces.items():
            _check(bool(_POINT.match(point)), f"{p}.traces", point,
                   "keys must be shaping point names (letters, digits, '_', '.', '-')")
            _check(isinstance(path, str) and bool(path), f"{p}.traces.{point}", path,
                   "must be a trace file path")
        _check(0 <= self.hosts <= 64, f"{p}.hosts", self.hosts, "must be in [0, 64]")
        _check(self.role == "" or bool(re.match(r"^[a-z][a-z0-9_]*$", self.role)),
               f"{p}.role", self.role, "must be empty or a registered role name")
        _check(self.class_sample_ms == 0 or 0.5 <= self.class_sample_ms <= 10_000,
               f"{p}.class_sample_ms", self.class_sample_ms, "must be 0 (off) or in [0.5, 10000]")
        _check(self.access_burst_ms == 0 or 0.1 <= self.access_burst_ms <= 1000,
               f"{p}.access_burst_ms", self.access_burst_ms,
               "must be 0 (the default bucket) or in [0.1, 1000]")
