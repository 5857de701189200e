"""One timed gloo all_to_all_single of N floats per rank among every rank: no gradbed import.

    torchrun --standalone --nproc-per-node 4 all_to_all.py --floats 10000000

Each rank sends an equal share of its N floats to every rank (itself included) and gets
the same back. Rank 0 prints one JSON line: the floats, the bytes, the world size, the
seconds the timed exchange took (after a barrier, so every rank starts it together) and
its CLOCK_MONOTONIC start and end (ns), so the links' own counters can be read over the
same window. Every rank checks what it got.
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
    share = args.floats // world
    # Block j goes to rank j and holds rank * world + j: what comes back is checkable.
    src = torch.arange(world, dtype=torch.float32).repeat_interleave(share) + rank * world
    dst = torch.empty_like(src)
    dist.barrier()
    start_ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    dist.all_to_all_single(dst, src)
    end_ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    want = (torch.arange(world, dtype=torch.float32) * world + rank).repeat_interleave(share)
    if not torch.equal(dst, want):
        raise SystemExit(f"rank {rank}: all_to_all gave wrong blocks")
    if rank == 0:
        print(json.dumps({"floats": share * world, "size_bytes": 4 * share * world,
                          "world": world, "seconds": round((end_ns - start_ns) / 1e9, 4),
                          "start_ns": start_ns, "end_ns": end_ns}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
