"""gradbed's own workloads (fashion_resnet, digits_mlp, ...) under plain DDP over gloo.

The model, the data, the sampling and the evaluation are those of gradbed's PS path
(``agents.workloads``): global batch i is the same images, rank r takes slice r of it as
worker r does, so a DDP run and a PS run of one config train the same thing and differ only
in how the gradients travel. ``benchmarks/ps_vs_allreduce.py`` runs it through ``gradbed
torchrun``; alone::

    torchrun --standalone --nproc-per-node 2 examples/torchrun_ddp/workload.py --steps 20

--hook/--ratio/--policy choose a gradbed.ddp hook (docs/ddp.md); the run is always
instrumented (``gradbed.ddp.instrument``: a no-op outside gradbed). Every --eval-every
steps rank 0 evaluates on the held-out images and prints one JSON line ``{"eval": ...,
"iter", "accuracy", "ts_ns"}`` (CLOCK_MONOTONIC, the run's clock); with --target the ranks
stop together once it is reached.
"""

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradbed.ddp
from agents.core.config import WorkloadConfig
from agents.core.vision_config import VisionConfig
from agents.workloads.factory import make_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="fashion_resnet")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=32, help="per rank, as workload.batch_size")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--eval-samples", type=int, default=2000)
    ap.add_argument("--target", type=float, default=0.0, help="stop at this accuracy")
    ap.add_argument("--hook", default="", help="a gradbed.ddp hook; '' = DDP's all_reduce")
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--policy", default=None)
    args = ap.parse_args()

    # One thread per rank, as gradbed's own workers and PS run (controller/agent_env.py): on
    # a few cores, ranks with a thread pool each would fight over them.
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    wl = make_workload(WorkloadConfig(name=args.workload, batch_size=args.batch),
                       VisionConfig(eval_samples=args.eval_samples))
    model = wl.build_model(args.seed)
    wl.prepare(model, rank, args.seed)
    ddp = DDP(model)
    if args.hook:
        ddp.register_comm_hook(*gradbed.ddp.hook(args.hook, ratio=args.ratio,
                                                 policy=args.policy))
    record = gradbed.ddp.instrument(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    for i in range(args.steps):
        batch = wl.batch(i, rank, world, args.batch)
        opt.zero_grad()
        loss = wl.loss(ddp, batch)
        loss.backward()
        opt.step()
        record.loss(loss)
        if args.eval_every and (i + 1) % args.eval_every == 0 and _evaluate(
                wl, model, i, rank, args.target):
            break
    record.close()
    # Every rank's collectives done and the hooks' futures dropped before the group goes:
    # a gloo work object still alive at the interpreter's exit can abort the process.
    dist.barrier()
    del ddp
    dist.destroy_process_group()


def _evaluate(wl: object, model: torch.nn.Module, i: int, rank: int, target: float) -> bool:
    """Rank 0 evaluates and prints; every rank learns whether the target is reached."""
    reached = torch.zeros(1)
    if rank == 0:
        acc = wl.evaluate(model)["accuracy"]  # type: ignore[attr-defined]
        print(json.dumps({"eval": True, "iter": i, "accuracy": acc,
                          "ts_ns": time.clock_gettime_ns(time.CLOCK_MONOTONIC)}), flush=True)
        reached[0] = float(target > 0 and acc >= target)
    dist.broadcast(reached, 0)
    return bool(reached.item())


if __name__ == "__main__":
    main()
