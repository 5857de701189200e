"""Gradient compressors, one file each, registered by name (see :mod:`agents.compress.base`).

Importing this package imports every algorithm module so each registers itself; build one
with ``make("topk")`` and wrap it in :class:`ErrorFeedback` for DESIGN 1.2's residual.
"""

from agents.compress import (  # noqa: F401  (imported for their @register side effect)
    dgc,
    fp16,
    none,
    powersgd,
    qsgd,
    randomk,
    signsgd,
    threshold,
    topk,
)
from agents.compress.base import (
    FRAME_HEADER_BYTES,
    Compressor,
    Payload,
    PayloadError,
    k_for,
    make,
    names,
    register,
)
from agents.compress.feedback import ErrorFeedback, clip_threshold

__all__ = ["FRAME_HEADER_BYTES", "Compressor", "ErrorFeedback", "Payload", "PayloadError",
           "clip_threshold", "k_for", "make", "names", "register"]
