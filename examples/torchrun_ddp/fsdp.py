"""A plain FSDP2 training script (``fully_shard``) over gloo on CPU: no gradbed import.

Each rank keeps 1/world of every parameter; a forward all-gathers them, a backward
reduce-scatters the gradients. The model is the DDP example's MLP on scikit-learn's digits,
seeded the same way, so the parameters after K steps match the DDP script's.

    torchrun --standalone --nproc-per-node 4 fsdp.py --steps 5 --save /tmp/fsdp.pt
"""

import argparse
import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:  # train.py's: each script stands alone
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
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default="")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    x, y = load_digits()
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    gen = torch.Generator().manual_seed(args.seed)
    per_rank = args.batch // world
    for step in range(args.steps):
        idx = torch.randint(0, len(x), (args.batch,), generator=gen)
        mine = idx[rank * per_rank:(rank + 1) * per_rank]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[mine]), y[mine])
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f}", flush=True)
    full = [p.full_tensor().detach() for p in model.parameters()]  # all-gathers each shard
    if rank == 0:
        print(f"done: {args.steps} steps, world {world}", flush=True)
        if args.save:
            torch.save(full, args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
