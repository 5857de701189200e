"""One timed gloo all-reduce of N floats among every rank: no gradbed import.

    torchrun --standalone --nproc-per-node 4 allreduce.py --floats 25557032

Rank 0 prints one JSON line: the floats, the bytes, the world size and the seconds the
timed all-reduce took (after a barrier, so every rank starts it together). Every rank checks
the sum it got.
"""

import argparse
import json
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--floats", type=int, default=1_000_000)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((args.floats,), float(rank + 1))
    dist.barrier()
    t0 = time.monotonic()
    dist.all_reduce(t)
    seconds = time.monotonic() - t0
    want = world * (world + 1) / 2
    if not torch.all(t == want):
        raise SystemExit(f"rank {rank}: all-reduce gave {t[0].item()}, want {want}")
    if rank == 0:
        print(json.dumps({"floats": args.floats, "size_bytes": 4 * args.floats,
                          "world": world, "seconds": round(seconds, 4)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
