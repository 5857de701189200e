"""Where an agent's tensors live, and the settings that make its arithmetic repeatable.

``run.device`` names the device ("auto" takes CUDA when this process sees one).
``run.deterministic`` (default on) asks for the same bits from the same inputs on every
run: TF32 off for matmuls and convolutions (TF32 keeps 10 mantissa bits, so a CUDA run
would differ from its CPU reference by about 1e-3 relative instead of float32 rounding),
cuDNN's deterministic algorithms and no autotuning, and
``torch.use_deterministic_algorithms`` with cuBLAS's fixed workspace
(``CUBLAS_WORKSPACE_CONFIG``, which cuBLAS reads when its first handle is made, so this
runs before any CUDA work). An operation with no deterministic implementation warns in the
agent's log instead of ending the run (``warn_only``).
"""

from __future__ import annotations

import os

import torch


def pick_device(name: str) -> torch.device:
    """``"auto"``: CUDA when this process sees a device, else the CPU; otherwise ``name``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def make_deterministic(on: bool) -> None:
    """Apply ``run.deterministic`` to this process (see the module docstring); ``False``
    leaves torch's defaults (TF32 in convolutions, cuDNN autotuning) as they are."""
    if not on:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def memory_stats(device: torch.device) -> dict[str, int]:
    """The peak bytes this process's caching allocator handed out and reserved on
    ``device`` (empty on the CPU): what one agent costs a shared GPU, its CUDA context
    aside (``nvidia-smi`` shows that per process)."""
    if device.type != "cuda":
        return {}
    return {"cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved(device)}
