"""What the top-k DDP hook's compression costs against the backward pass of the same model.

Target (docs/ddp.md): the compression time of ``gradbed.ddp.hook("topk", ratio=0.01,
error_feedback=True)`` is at most 0.5x the backward time of the same model, the bound the
PS path's error-feedback step meets (``ef_step``: 0.092).

The model and batch are ``ef_step``'s (ResNet-18 of ``agents.workloads.resnet``, 11.7 M
parameters, batch 32 x 3 x 112 x 112, cross-entropy), so the two ratios compare. One
process forms a gloo group of one on 127.0.0.1 (no Mininet, no root): the hook then does
all its work (error feedback, top-k per bucket, packing) and its collectives have no peer
to wait for. Two DDP copies of the model alternate in blocks of ``BLOCK`` iterations,
``ROUNDS`` times, so a slow moment of the shared machine hits both alike:

- ``plain``: DDP with its built-in all_reduce; its ``loss.backward()`` time is the
  backward time;
- ``topk``: DDP with the top-k hook; the hook's compression time of an iteration is the
  sum over its buckets of ``BucketRecord.compress_s`` (from the bucket's gradients being
  ready to the collective's launch: error feedback, selection, packing).

Headline: the median compression time per iteration over the median plain backward time.
The first ``START_ITER`` iterations of the hook are DDP's dense all_reduce (the bucket
rebuild) and are left out.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections import defaultdict
from typing import Any

import _common  # noqa: F401  (puts the repository on the path)
import torch
import torch.distributed as dist
from _common import emit, log
from torch.nn.parallel import DistributedDataParallel as DDP

import gradbed.ddp
from agents.workloads.resnet import resnet18
from gradbed.ddp.record import BucketRecord

BATCH, SIZE, RATIO = 32, 112, 0.01
ROUNDS = int(os.environ.get("GB_DT_ROUNDS", "4"))
BLOCK = 3
START_ITER = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    torch.manual_seed(0)
    x = torch.randn(BATCH, 3, SIZE, SIZE)
    y = torch.randint(0, 1000, (BATCH,))
    loss_fn = torch.nn.CrossEntropyLoss()
    plain = DDP(resnet18())
    hooked = DDP(resnet18())
    state, hook = gradbed.ddp.hook("topk", ratio=RATIO, error_feedback=True,
                                   start_iter=START_ITER)
    hooked.register_comm_hook(state, hook)
    compress_s: dict[int, float] = defaultdict(float)
    buckets: dict[int, int] = defaultdict(int)

    def on_bucket(rec: BucketRecord) -> None:
        compress_s[rec.iteration] += rec.compress_s
        buckets[rec.iteration] += 1

    state.listeners.add(on_bucket)
    backward: dict[str, list[float]] = {"plain": [], "topk": []}
    hooked_iters = 0
    for _ in range(ROUNDS):
        for name, model in (("plain", plain), ("topk", hooked)):
            for _ in range(BLOCK):
                model.zero_grad(set_to_none=False)
                loss = loss_fn(model(x), y)
                t0 = time.perf_counter()
                loss.backward()
                backward[name].append(time.perf_counter() - t0)
                hooked_iters += model is hooked
    dist.destroy_process_group()
    timed = [i for i in range(START_ITER, hooked_iters)]
    comp = [compress_s[i] for i in timed]
    bwd = backward["plain"][1:]  # the first backward also allocates DDP's buckets
    ratio = statistics.median(comp) / statistics.median(bwd)
    details: dict[str, Any] = {
        "model": "resnet18", "batch": BATCH, "image": SIZE, "ratio": RATIO,
        "error_feedback": True, "threads": torch.get_num_threads(), "rounds": ROUNDS,
        "block": BLOCK, "buckets_per_iteration": buckets[timed[-1]],
        "backward_plain_ms": {"median": statistics.median(bwd) * 1e3, "best": min(bwd) * 1e3,
                              "n": len(bwd)},
        "backward_topk_ms": {"median": statistics.median(backward["topk"][START_ITER:]) * 1e3},
        "compress_ms_per_iteration": {"median": statistics.median(comp) * 1e3,
                                      "best": min(comp) * 1e3, "n": len(comp)},
        "ratio_best": min(comp) / min(bwd),
        "load_average": os.getloadavg()}
    log(f"backward (plain DDP): median {statistics.median(bwd) * 1e3:.0f} ms; top-k hook "
        f"compression: median {statistics.median(comp) * 1e3:.1f} ms per iteration over "
        f"{buckets[timed[-1]]} buckets = {ratio:.3f} x backward")
    emit("ddp_topk_step", ratio, "x (top-k hook compression time / backward time, ResNet-18)",
         "<= 0.5", details)


if __name__ == "__main__":
    main()
