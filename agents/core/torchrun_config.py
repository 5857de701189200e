"""The ``[torchrun]`` section: a user's own ``torch.distributed`` script, launched with
``python -m torch.distributed.run`` on every training host (``controller/torchrun/``).

Pure data, no torch: what to run, how many processes per host, how the ranks meet, and
when gradbed gives up on a silent rank. The command line's ``-- SCRIPT.py ARGS`` fills
``script`` and ``args``.
"""

from __future__ import annotations

from dataclasses import dataclass

from agents.core.checks import check as _check

RDZV_BACKENDS = ("static", "c10d")
BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class TorchrunConfig:
    script: str = ""                  # the training script (a .py file), run unedited
    args: tuple[str, ...] = ()        # its arguments, after the script name
    # Processes per host (torchrun --nproc-per-node). More than one: their traffic to each
    # other stays inside the host and never crosses a shaped link.
    nproc_per_node: int = 1
    # "static": rank 0's host serves the c10d store at its emulated IP (torchrun's
    # --rdzv-backend static); "c10d": torchrun's dynamic rendezvous at the same address.
    rdzv: str = "static"
    port: int = 29500                 # rendezvous / store port on rank 0's host
    # A rank whose TCP connections move no bytes for this long ends the run, named,
    # instead of waiting for gloo's 30-minute timeout. Keep it above any configured delay
    # and above the longest compute between two collectives; lower = a hang found sooner.
    stall_s: float = 60.0
    # gloo (CPU or CUDA tensors); nccl needs one GPU per emulated host.
    backend: str = "gloo"
    # The interpreter the ranks run under ("" = the one gradbed runs under); its torch is
    # the one the script gets. --python on the command line sets it.
    python: str = ""

    def validate(self, p: str) -> None:
        _check(self.script == "" or self.script.endswith(".py"), f"{p}.script", self.script,
               "must name a Python script (a .py file)")
        _check(1 <= self.nproc_per_node <= 64, f"{p}.nproc_per_node", self.nproc_per_node,
               "must be in [1, 64]")
        _check(self.rdzv in RDZV_BACKENDS, f"{p}.rdzv", self.rdzv,
               f"must be {' or '.join(RDZV_BACKENDS)}")
        _check(1024 <= self.port <= 65535, f"{p}.port", self.port, "must be in [1024, 65535]")
        _check(1.0 <= self.stall_s <= 86_400, f"{p}.stall_s", self.stall_s,
               "must be in [1, 86400] s")
        _check(self.backend in BACKENDS, f"{p}.backend", self.backend,
               f"must be {' or '.join(BACKENDS)}")
        _check(all(isinstance(a, str) for a in self.args), f"{p}.args", list(self.args),
               "must be a list of strings")
