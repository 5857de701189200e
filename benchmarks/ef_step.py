"""Cost of the full error-feedback + top-k step relative to forward + backward.

Model: ResNet-18 (``agents.workloads.resnet``, 11.7 M parameters, 1000 classes), batch
32 x 3 x 112 x 112 (chosen so forward + backward takes about a second on the 2-core test
machine), cross-entropy loss. The EF step runs **per parameter tensor** (62 of them, the way
the worker compresses layer by layer in backprop order): ``G = g + R``, clip off, select,
``R = G - sent``, norms for the ``compress_done`` event. Timed side by side with dgc at keep
ratio 0.01 (the headline) and exact top-k; best of several repeats (shared machine), medians
in the details. Headline = ef_time(dgc) / fwd_bwd_time, target <= 0.5.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import emit, log

from agents.compress import ErrorFeedback, make
from agents.workloads.resnet import layer_sizes, resnet18

BATCH, SIZE, RATIO = 32, 112, 0.01


def timings(fn: Callable[[], Any], repeats: int) -> list[float]:
    fn()  # warm-up (and, for EF, creates the residuals so later steps do G = g + R)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    model = resnet18()
    x = torch.randn(BATCH, 3, SIZE, SIZE)
    y = torch.randint(0, 1000, (BATCH,))
    loss_fn = torch.nn.CrossEntropyLoss()

    def fwd_bwd() -> None:
        model.zero_grad(set_to_none=False)
        loss_fn(model(x), y).backward()

    fb = timings(fwd_bwd, 5)
    params = dict(model.named_parameters())
    grads = [(name, params[name].grad) for name, _ in layer_sizes(model)]
    details: dict[str, Any] = {"model": "resnet18", "batch": BATCH, "image": SIZE,
                               "ratio": RATIO, "granularity": "per parameter tensor",
                               "tensors": len(grads), "threads": torch.get_num_threads(),
                               "fwd_bwd_ms": {"best": min(fb) * 1e3,
                                              "median": statistics.median(fb) * 1e3}}
    log(f"fwd+bwd: best {min(fb) * 1e3:.0f} ms, median {statistics.median(fb) * 1e3:.0f} ms")
    for name in ("dgc", "topk"):
        ef = ErrorFeedback(make(name))
        rng = torch.Generator().manual_seed(1)
        wire = [0]

        def step(ef: ErrorFeedback = ef, rng: torch.Generator = rng,
                 wire: list[int] = wire) -> None:
            wire[0] = 0
            for key, g in grads:
                payload, stats = ef.step(g, key, RATIO, rng)
                wire[0] += stats["wire_bytes"]

        ts = timings(step, 7)
        details[name] = {"ef_ms": {"best": min(ts) * 1e3, "median": statistics.median(ts) * 1e3},
                         "ratio_to_fwd_bwd": min(ts) / min(fb),
                         "ratio_to_fwd_bwd_median": statistics.median(ts) / statistics.median(fb),
                         "wire_bytes": wire[0],
                         "raw_bytes": sum(g.numel() * 4 for _, g in grads)}
        log(f"EF+{name}: best {min(ts) * 1e3:.0f} ms = {min(ts) / min(fb):.3f} x fwd+bwd, "
            f"{wire[0]} wire bytes")
    emit("ef_step", details["dgc"]["ratio_to_fwd_bwd"],
         "x (EF+dgc step time / fwd+bwd time, ResNet-18)", "<= 0.5", details)


if __name__ == "__main__":
    main()
