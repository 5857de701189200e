"""Dense training of the Fashion-MNIST workloads to a target accuracy, in one process.

What each workload is measured by: the iterations and the wall time dense SGD needs to reach
a known test accuracy (>= 90 % for ``fashion_resnet``) on this machine. One process trains on
the global batch (workers x batch size; with the ``none`` compressor the testbed's workers
compute exactly its mean gradient, ``tests/agents/dp/test_transparency.py``) with the PS's step
(``agents.workloads.base.sgd_step_``, SGD with momentum), and scores the full 10,000-image test
set every ``GB_FD_EVAL_EVERY`` iterations. The clock counts training only; the evaluations
are timed apart (``eval_s``).

Environment: ``GB_FD_WORKLOAD`` (fashion_resnet), ``GB_FD_SET`` (dotted overrides of
``[vision]``/``[workload]``, comma separated, e.g. ``vision.resnet_width=32``),
``GB_FD_ITERS`` (max iterations, 2000), ``GB_FD_TARGET`` (0.90), ``GB_FD_THREADS`` (2).

Headline: iterations to the target (None if not reached). The details hold wall seconds,
the accuracy curve, parameters, batch, threads and the machine.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from _common import emit, log

from agents.core import config as cfgmod
from agents.workloads.base import FlatModel, sgd_step_
from agents.workloads.factory import make_workload


def main() -> int:
    threads = int(os.environ.get("GB_FD_THREADS", "2"))
    torch.set_num_threads(threads)
    name = os.environ.get("GB_FD_WORKLOAD", "fashion_resnet")
    sets = [s for s in os.environ.get("GB_FD_SET", "").split(",") if s]
    cfg = cfgmod.from_dict(cfgmod.apply_overrides(
        {"workload": {"name": name, "batch_size": 32, "lr": 0.1, "momentum": 0.9},
         "net": {"workers": 4}}, sets))
    max_iters = int(os.environ.get("GB_FD_ITERS", "2000"))
    target = float(os.environ.get("GB_FD_TARGET", "0.90"))
    every = int(os.environ.get("GB_FD_EVAL_EVERY", "100"))
    wl = make_workload(cfg.workload, cfg.vision)
    model = FlatModel(wl.build_model(cfg.run.seed))
    wl.prepare(model.module, 0, cfg.run.seed)
    mom = torch.zeros_like(model.flat_params)
    workers, bs = cfg.net.workers, cfg.workload.batch_size
    curve: list[tuple[int, float]] = []
    train_s = eval_s = 0.0
    reached = None
    for i in range(max_iters):
        t0 = time.perf_counter()
        parts = [wl.batch(i, k, workers, bs) for k in range(workers)]
        x = torch.cat([p.x for p in parts])
        y = torch.cat([p.y for p in parts])
        model.zero_grad()
        wl.loss(model.module, type(parts[0])(x, y)).backward()
        sgd_step_(model.flat_params, model.flat_grad, mom, lr=cfg.workload.lr,
                  momentum=cfg.workload.momentum, first=i == 0)
        train_s += time.perf_counter() - t0
        if (i + 1) % every == 0:
            t1 = time.perf_counter()
            acc = wl.evaluate(model.module)["accuracy"]
            eval_s += time.perf_counter() - t1
            curve.append((i + 1, acc))
            log(f"{name} it {i + 1}: acc {acc:.4f} train {train_s:.1f} s")
            if acc >= target:
                reached = i + 1
                break
    emit("fashion_dense", reached if reached is not None else float("nan"), "iterations",
         f"reach {target:.2f} test accuracy (10,000 images)",
         {"workload": wl.describe(), "parameters": model.numel,
          "global_batch": workers * bs, "lr": cfg.workload.lr,
          "momentum": cfg.workload.momentum, "train_wall_s": round(train_s, 1),
          "eval_s": round(eval_s, 1), "threads": threads, "iterations_to_target": reached,
          "epochs": round((reached or max_iters) * workers * bs / 60_000, 2),
          "curve": curve, "overrides": sets})
    return 0


if __name__ == "__main__":
    sys.exit(main())
