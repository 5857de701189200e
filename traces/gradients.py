"""Gradient-size profiles of real models, read from ASTRA-sim workload files.

ASTRA-sim (Rashidi et al., "ASTRA-SIM: Enabling SW/HW Co-Design Exploration for Distributed
DL Training Platforms", ISPASS 2020) describes a model as one line per layer with the
compute time (cycles) and the collective type and size (bytes) of its forward pass, input
gradient and weight gradient. gradbed's replay-mode workers send gradients of exactly these
sizes, in this order, so a 2-core machine can emulate ResNet-50's 102 MB of gradients
without computing them. The format is described in ``../shared/traces/gradients/FORMAT.md``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from agents.core.bandwidth import TraceError

COMM_TYPES = frozenset({"NONE", "ALLREDUCE", "ALLGATHER", "ALLTOALL", "REDUCESCATTER"})
PARALLELISMS = frozenset({"DATA", "HYBRID_TRANSFORMER", "HYBRID_DLRM", "HYBRID_DATA_MODEL",
                          "HYBRID_MODEL_DATA", "MODEL", "HYBRID_CUSTOMIZED"})


@dataclass(frozen=True)
class WorkloadLayer:
    """One layer of an ASTRA-sim workload: compute times in cycles, sizes in bytes."""

    name: str
    fwd_compute_cycles: int
    fwd_comm_type: str
    fwd_comm_bytes: int
    ig_compute_cycles: int
    ig_comm_type: str
    ig_comm_bytes: int
    wg_compute_cycles: int
    wg_comm_type: str
    wg_comm_bytes: int
    update_delay_cycles: int

    @property
    def comm_size_bytes(self) -> int:
        """The weight-gradient collective's size: what data parallelism sends per layer."""
        return self.wg_comm_bytes if self.wg_comm_type != "NONE" else 0

    @property
    def compute_time_cycles(self) -> int:
        """Forward + input-gradient + weight-gradient compute of the layer."""
        return self.fwd_compute_cycles + self.ig_compute_cycles + self.wg_compute_cycles


@dataclass(frozen=True)
class GradientProfile:
    """A whole workload file: its parallelism line and its layers in file order."""

    parallelism: str
    layers: tuple[WorkloadLayer, ...]
    source: str

    def gradient_sizes(self) -> list[tuple[str, int, int]]:
        """(layer name, comm size bytes, compute time cycles) for every layer."""
        return [(la.name, la.comm_size_bytes, la.compute_time_cycles) for la in self.layers]

    def total_comm_bytes(self, comm_type: str = "ALLREDUCE") -> int:
        """Sum of weight-gradient collective sizes of one type."""
        return sum(la.wg_comm_bytes for la in self.layers if la.wg_comm_type == comm_type)


def _int(name: str, lineno: int, field: str, token: str) -> int:
    try:
        value = int(token)
    except ValueError:
        raise TraceError(f"{name}:{lineno}: {field} {token!r} is not an integer") from None
    return value


def _count(name: str, lineno: int, field: str, token: str) -> int:
    value = _int(name, lineno, field, token)
    if value < 0:
        raise TraceError(f"{name}:{lineno}: {field} {value} is negative")
    return value


def _comm(name: str, lineno: int, field: str, token: str) -> str:
    if token not in COMM_TYPES:
        raise TraceError(f"{name}:{lineno}: {field} {token!r} is not one of "
                         f"{sorted(COMM_TYPES)}")
    return token


def load_profile(path: str | os.PathLike[str]) -> GradientProfile:
    """Parse an ASTRA-sim workload file; every error names ``file:line``."""
    name = str(path)
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise TraceError(f"{name}: cannot read: {e.strerror or e}") from e
    rows = [(i, ln.split()) for i, ln in enumerate(lines, start=1) if ln.strip()]
    if not rows:
        raise TraceError(f"{name}:1: empty workload file")
    lineno, first = rows[0]
    parallelism = first[0]
    if parallelism not in PARALLELISMS:
        raise TraceError(f"{name}:{lineno}: parallelism {parallelism!r} is not one of "
                         f"{sorted(PARALLELISMS)}")
    if len(rows) < 2:
        raise TraceError(f"{name}:{lineno + 1}: missing the layer-count line")
    lineno, second = rows[1]
    if len(second) != 1:
        raise TraceError(f"{name}:{lineno}: expected one layer count, got {second!r}")
    n_layers = _count(name, lineno, "layer count", second[0])
    layers: list[WorkloadLayer] = []
    for lineno, f in rows[2:]:
        if len(f) != 12:
            raise TraceError(f"{name}:{lineno}: expected 12 fields (name, reserved, then "
                             f"compute/type/size for fwd, input grad, weight grad, then the "
                             f"update delay), got {len(f)}")
        layers.append(WorkloadLayer(
            name=f[0],
            fwd_compute_cycles=_count(name, lineno, "forward compute time", f[2]),
            fwd_comm_type=_comm(name, lineno, "forward comm type", f[3]),
            fwd_comm_bytes=_count(name, lineno, "forward comm size", f[4]),
            ig_compute_cycles=_count(name, lineno, "input-grad compute time", f[5]),
            ig_comm_type=_comm(name, lineno, "input-grad comm type", f[6]),
            ig_comm_bytes=_count(name, lineno, "input-grad comm size", f[7]),
            wg_compute_cycles=_count(name, lineno, "weight-grad compute time", f[8]),
            wg_comm_type=_comm(name, lineno, "weight-grad comm type", f[9]),
            wg_comm_bytes=_count(name, lineno, "weight-grad comm size", f[10]),
            update_delay_cycles=_count(name, lineno, "update delay", f[11]),
        ))
        _int(name, lineno, "reserved", f[1])
    if len(layers) != n_layers:
        where = rows[1][0]
        raise TraceError(f"{name}:{where}: declares {n_layers} layers but the file has "
                         f"{len(layers)}")
    return GradientProfile(parallelism, tuple(layers), name)


def load_gradient_sizes(path: str | os.PathLike[str]) -> list[tuple[str, int, int]]:
    """(layer name, comm size bytes, compute time cycles) per layer of a workload file."""
    return load_profile(path).gradient_sizes()
