"""Moving a payload from the GPU to the socket: pinned host buffers, a copy stream, overlap.

Compression runs on the device the gradient lives on, and only the payload crosses
the bus. On CUDA, :meth:`PayloadStager.stage` enqueues each payload tensor's copy into a
page-locked (pinned) host buffer on a dedicated copy stream, after the compute stream's work
that produced it, and returns at once; the worker then compresses the next chunk on the
compute stream while the copy runs, and calls :meth:`Staged.host_tensors` (which waits for
that copy only) just before the chunk goes to the socket. Pinned memory is what lets the
copy run asynchronously at full bus speed: from pageable memory CUDA copies synchronously,
through a bounce buffer.

The pinned buffers are kept per (chunk, part) and reused every iteration (allocating pinned
memory costs far more than the copy); a buffer is reused only after the socket has taken the
previous iteration's bytes, because the worker sends each chunk before it stages the same
chunk again.

On the CPU, :meth:`stage` is a no-op: the payload's tensors are returned as they are, with no
copy, and ``asynchronous`` is False, so the worker keeps its one-chunk-at-a-time order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from agents.compress.base import Payload


@dataclass
class Staged:
    """A payload on its way to host memory; ``host_tensors`` waits for it to arrive."""

    payload: Payload
    tensors: tuple[Tensor, ...]
    event: Any = None  # torch.cuda.Event recorded after the copies (None: already on host)

    def host_tensors(self) -> tuple[Tensor, ...]:
        if self.event is not None:
            self.event.synchronize()
        return self.tensors


class PayloadStager:
    """Stages payloads for the socket: a no-op on the CPU, pinned asynchronous copies on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.asynchronous = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.asynchronous else None
        self._pinned: dict[tuple[int, int], Tensor] = {}

    def _buffer(self, chunk: int, part: int, like: Tensor) -> Tensor:
        nbytes = like.numel() * like.element_size()
        buf = self._pinned.get((chunk, part))
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 4096), dtype=torch.uint8, pin_memory=True)
            self._pinned[(chunk, part)] = buf
        return buf[:nbytes].view(like.dtype)

    def stage(self, chunk: int, payload: Payload) -> Staged:
        """Start moving ``payload`` (chunk ``chunk``) to host memory; returns at once."""
        if not self.asynchronous or all(t.device.type == "cpu" for t in payload.tensors):
            return Staged(payload, payload.tensors)
        assert self._stream is not None
        # The copy stream waits for the compute stream's kernels that produced the payload.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        out = []
        with torch.cuda.stream(self._stream):
            for i, t in enumerate(payload.tensors):
                if t.device.type == "cpu":
                    out.append(t)
                    continue
                host = self._buffer(chunk, i, t)
                host.copy_(t, non_blocking=True)
                # The device tensor must outlive the copy even if the caller drops it.
                t.record_stream(self._stream)
                out.append(host)
            event = torch.cuda.Event()
            event.record(self._stream)
        return Staged(payload, tuple(out), event)
