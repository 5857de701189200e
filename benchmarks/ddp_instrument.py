"""What ``gradbed.ddp.instrument`` costs a DDP iteration (target: at most 2 %).

Two ranks over gloo on 127.0.0.1 (no Mininet, no root) train two copies of the
``fashion_resnet`` model (width 16, 32 images per rank) side by side: one plain DDP (torch's
built-in all_reduce), one instrumented (gradbed's recorded all_reduce hook, a
``ddp_bucket`` event per bucket and a ``ddp_iter`` event per iteration written to a
temporary run directory). Blocks of ``BLOCK`` iterations alternate between the two,
``ROUNDS`` times, so a slow moment of the machine hits both alike. The headline is the
instrumented median iteration time over the plain one, minus 1 (rank 0's times).
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401  (puts the repository on the path)
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import emit, log
from torch.nn.parallel import DistributedDataParallel as DDP

from agents.core.config import WorkloadConfig
from agents.core.vision_config import VisionConfig
from agents.workloads.factory import make_workload

ROUNDS = int(os.environ.get("GB_DI_ROUNDS", "10"))
BLOCK = 5


def rank_main(rank: int, world: int, port: int, run_dir: str, out: str) -> None:
    import gradbed.ddp

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    wl = make_workload(WorkloadConfig(name="fashion_resnet", batch_size=32), VisionConfig())
    plain = DDP(wl.build_model(0))
    inst_model = DDP(wl.build_model(0))
    os.environ["GRADBED_HOST"] = f"r{rank}"
    rec = gradbed.ddp.instrument(inst_model, run_dir=run_dir)
    times: dict[str, list[float]] = {"plain": [], "instrumented": []}
    i = 0
    for _ in range(ROUNDS):
        for name, model in (("plain", plain), ("instrumented", inst_model)):
            for _ in range(BLOCK):
                batch = wl.batch(i, rank, world, 32)
                i += 1
                t0 = time.perf_counter()
                model.zero_grad()
                loss = wl.loss(model, batch)
                loss.backward()
                if model is inst_model:
                    rec.loss(loss)
                times[name].append(time.perf_counter() - t0)
    rec.close()
    if rank == 0:
        torch.save(times, out)
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    tmp = Path(tempfile.mkdtemp(prefix="gb-di-"))
    out = tmp / "times.pt"
    t0 = time.monotonic()
    mp.spawn(rank_main, args=(2, port, str(tmp / "run"), str(out)), nprocs=2, join=True)
    times = torch.load(out)
    med = {k: statistics.median(v[BLOCK:]) for k, v in times.items()}  # first block warms up
    events = sum(1 for _ in (tmp / "run" / "events").glob("*.jsonl"))
    log(f"medians {med}, {events} event files, {time.monotonic() - t0:.0f} s")
    emit("ddp_instrument", med["instrumented"] / med["plain"] - 1, "fraction of iteration time",
         "<= 0.02", {"median_s": med, "rounds": ROUNDS, "block": BLOCK,
                     "iterations_each": len(times["plain"]), "loadavg": os.getloadavg(),
                     "event_files": events})


if __name__ == "__main__":
    sys.exit(main())
