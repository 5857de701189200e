"""A plain DDP training script: nothing here knows about gradbed.

A two-layer MLP learns scikit-learn's digits (1,797 8x8 images, read from the file
scikit-learn ships) with DistributedDataParallel over gloo. Every step draws one seeded
global batch; rank r trains on its slice of it, and DDP's all-reduce averages the gradients,
so the parameters after K steps depend on the seed and the world size only, never on the
network or the timing.

    torchrun --standalone --nproc-per-node 4 train.py --steps 20          # one machine
    sudo gradbed torchrun examples/torchrun_ddp/fabric4.toml -- \\
        examples/torchrun_ddp/train.py --steps 20                        # 4 emulated hosts

--save PATH (rank 0) writes the final parameters; --history PATH the parameters after
every step (a list, step 1 first). With --hook NAME (topk, fp16, qsgd, ..., powersgd; see
docs/ddp.md) the gradients travel through gradbed's compression hook, with --policy adaptive
at a ratio that follows the slowest link; --instrument records every bucket and iteration
into the gradbed run's events (a no-op outside one). Those three import gradbed.ddp.
"""

import argparse
import importlib.util
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits as float32 images in [0, 1] (1797 x 64) and int64 labels,
    read from the file its wheel ships: ``sklearn.datasets.load_digits()``'s arrays
    without importing scikit-learn, which costs each rank as much CPU as importing torch."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the digits come with scikit-learn: pip install scikit-learn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    data = np.loadtxt(path, delimiter=",")  # 64 pixel columns (0-16), then the label
    return (torch.tensor(data[:, :-1], dtype=torch.float32) / 16.0,
            torch.tensor(data[:, -1], dtype=torch.long))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64, help="global batch (split over ranks)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default="")
    ap.add_argument("--history", default="")
    ap.add_argument("--hook", default="", help="a gradbed.ddp hook: topk, fp16, powersgd...")
    ap.add_argument("--ratio", type=float, default=0.01, help="the hook's keep ratio")
    ap.add_argument("--policy", default=None, help="adaptive: the ratio follows the link")
    ap.add_argument("--instrument", action="store_true", help="gradbed.ddp.instrument")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (every rank on this "
                    "host's GPU; gloo stages CUDA tensors through host memory)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        # The same bits on every run, and float32 matmuls as on the CPU (no TF32).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.use_deterministic_algorithms(True, warn_only=True)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the world size {world}")
    torch.manual_seed(args.seed)
    x, y = load_digits()
    x, y = x.to(device), y.to(device)
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    model.to(device)
    ddp = DDP(model)  # broadcasts rank 0's parameters to every rank
    if args.hook:
        import gradbed.ddp

        ddp.register_comm_hook(*gradbed.ddp.hook(args.hook, ratio=args.ratio,
                                                 policy=args.policy))
    record = None
    if args.instrument:
        import gradbed.ddp

        record = gradbed.ddp.instrument(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    gen = torch.Generator().manual_seed(args.seed)
    per_rank = args.batch // world
    history = []
    t0 = time.monotonic()
    for step in range(args.steps):
        idx = torch.randint(0, len(x), (args.batch,), generator=gen).to(device)
        mine = idx[rank * per_rank:(rank + 1) * per_rank]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x[mine]), y[mine])
        loss.backward()
        opt.step()
        if record is not None:
            record.loss(loss)
        if args.history and rank == 0:
            history.append([p.detach().cpu().clone() for p in model.parameters()])
        if rank == 0:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f} "
                  f"t {time.monotonic() - t0:.2f} s", flush=True)
    if rank == 0:
        with torch.no_grad():
            acc = (model(x).argmax(1) == y).float().mean().item()
        print(f"done: {args.steps} steps, world {world}, train accuracy {acc:.3f}, "
              f"{time.monotonic() - t0:.2f} s (pid {os.getpid()})", flush=True)
        if args.save:
            torch.save([p.detach().cpu() for p in model.parameters()], args.save)
        if args.history:
            torch.save(history, args.history)
    # Every rank's collectives done and the hooks' futures dropped before the group goes:
    # a gloo work object still alive at the interpreter's exit can abort the process.
    dist.barrier()
    del ddp
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
