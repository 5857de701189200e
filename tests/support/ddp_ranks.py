"""Rank bodies for the DDP hook tests: a real gloo group on 127.0.0.1, each rank writing
what it saw to ``OUT/rank<R>.pt`` for the test to check.

The ranks are forks of one fresh interpreter that imported torch and torch._dynamo
(``tests.support.fork_ranks`` runs this file as its script): spawned ranks would each
import both again (about 5 s of CPU per rank on a 2-core machine) and tear torch down at
exit. The parent imports nothing of gradbed, the controller or Mininet, so what a rank
has loaded is what its own work loaded.

    python -m tests.support.fork_ranks WORLD tests/support/ddp_ranks.py FN OUT ARGS_JSON
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = Path(__file__).resolve().parents[2]
#: Long enough for a loaded 2-core machine; a hung collective fails the test instead of
#: waiting for gloo's 30-minute timeout.
RANKS_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(fn: Any, world: int, out: Path, *args: Any) -> list[dict[str, Any]]:
    """Run ``fn(rank, world, *args)`` (a function of this module; ``args`` plain JSON) on
    ``world`` ranks forked from one interpreter; their results, in rank order."""
    argv = [sys.executable, "-m", "tests.support.fork_ranks", str(world), __file__,
            fn.__name__, str(out), json.dumps(list(args))]
    # This checkout first: a rank imports gradbed from it, not from an installed copy.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run(argv, cwd=out, env=env, capture_output=True, text=True,
                       timeout=RANKS_TIMEOUT_S, check=False)
    assert p.returncode == 0, f"the ranks of {fn.__name__} failed ({p.returncode}):\n" \
                              f"{p.stderr[-4000:]}"
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def _main(name: str, out: Path, args: list[Any]) -> None:
    """One rank (its variables set by fork_ranks): join the group, run ``name``, save."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)  # MASTER_ADDR, _PORT
    try:
        result = globals()[name](rank, world, *args)
        torch.save(result, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def batch(iteration: int, rank: int, n_in: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * iteration + rank)
    return torch.randn(8, n_in, generator=g), torch.randint(0, 4, (8,), generator=g)


def local_grads(model: nn.Module, iteration: int, world: int, n_in: int) -> list[torch.Tensor]:
    """Every rank's own gradient of the (single) weight at the current parameters."""
    out = []
    for r in range(world):
        model.zero_grad()
        x, y = batch(iteration, r, n_in)
        nn.functional.cross_entropy(model(x), y).backward()
        out.append(model.weight.grad.detach().reshape(-1).clone())
    return out


def reduced_grads(rank: int, world: int, name: str, ratio: float, iters: int
                  ) -> dict[str, Any]:
    """One-weight model (one bucket): per iteration, each rank's local gradient of every
    rank and the gradient DDP's hook left; and the residual after each iteration."""
    import gradbed.ddp

    n_in = 40
    torch.manual_seed(0)
    model = nn.Linear(n_in, 4, bias=False)
    ref = nn.Linear(n_in, 4, bias=False)
    ddp = DDP(model)
    state, hook = gradbed.ddp.hook(name, ratio=ratio)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    seen: dict[str, Any] = {"local": [], "reduced": [], "residual": []}
    for it in range(iters):
        ref.load_state_dict(model.state_dict())
        seen["local"].append(local_grads(ref, it, world, n_in))
        opt.zero_grad()
        x, y = batch(it, rank, n_in)
        nn.functional.cross_entropy(ddp(x), y).backward()
        seen["reduced"].append(model.weight.grad.detach().reshape(-1).clone())
        fb = getattr(state.sender, "feedback", None)
        res = fb.residual("bucket0") if fb is not None else None
        seen["residual"].append(None if res is None else res.clone())
        opt.step()
    return seen


def _sent_over(fn: Any, times: int) -> float:
    """This rank's TCP bytes acked per call of ``fn`` (the ranks call it in step)."""
    dist.barrier()
    before = _acked_when_settled()
    for _ in range(times):
        fn()
    after = _acked_when_settled()
    dist.barrier()
    return (after - before) / times


#: How long the last segments' ACKs may take on a loaded machine before the test fails.
SETTLE_TIMEOUT_S = 30.0


def _acked_when_settled() -> int:
    """This rank's TCP bytes acked (``gradbed.ddp.wire.own_tcp_bytes``) once every byte it
    has written is acked: no socket of its own has a segment unacked or a byte unsent. A
    finished collective has written all it sends (gloo waits for its sends), so from then
    on the count is exact, however long the ACKs take."""
    from agents.net.tcpinfo import read_tcp_info
    from gradbed.ddp.wire import own_tcp_bytes

    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        pending = 0
        for name in os.listdir("/proc/self/fd"):
            try:
                if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                    continue
                sock = socket.socket(fileno=os.dup(int(name)))
            except OSError:  # the listing's own descriptor, closed
                continue
            with sock:
                if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET,
                                                                          socket.AF_INET6):
                    continue
                info = read_tcp_info(sock)
            pending += info.unacked_pkts + (info.notsent_bytes or 0)
        if pending == 0:
            return own_tcp_bytes()[0]
        assert time.monotonic() < deadline, f"{pending} segments and bytes never acked"
        time.sleep(0.002)


def framing(rank: int, world: int) -> dict[str, float]:
    """gloo's bytes per collective beyond its payload's formula, measured with a 4 KB
    all_reduce and all_gather (a tensor of a few floats skips some of the ring's messages
    and shows less: 285 bytes against about 1,155 for any size from 1 KB up, 3 ranks)."""
    t = torch.zeros(1024)
    outs = [torch.zeros(1024) for _ in range(world)]
    ar = _sent_over(lambda: dist.all_reduce(t), 20) - 2 * (world - 1) / world * 4096
    ag = _sent_over(lambda: dist.all_gather(outs, t), 20) - (world - 1) * 4096
    return {"allreduce": ar, "allgather": ag}


def hook_bytes(rank: int, world: int, names: list[str], iters: int) -> dict[str, Any]:
    """For each hook: this rank's TCP bytes acked per compressed iteration, the buckets'
    dense sizes, and the model's parameter shapes."""
    import gradbed.ddp

    out: dict[str, Any] = {"framing": framing(rank, world)}
    for name in names:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
        ddp = DDP(model, bucket_cap_mb=4)
        state, hook = gradbed.ddp.hook(name, ratio=0.01)
        ddp.register_comm_hook(state, hook)
        records: list[Any] = []
        state.listeners.add(records.append)
        x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(rank))

        def step(ddp: DDP = ddp, x: torch.Tensor = x) -> None:
            ddp.zero_grad()
            ddp(x).square().mean().backward()

        for _ in range(2):  # dense iterations, and DDP's bucket rebuild
            step()
        out[name] = {"sent": _sent_over(step, iters),
                     "buckets": sorted({(r.bucket, r.raw_bytes) for r in records
                                        if r.iteration >= 2}),
                     "shapes": [tuple(p.shape) for p in model.parameters()]}
    return out


def agreement(rank: int, world: int) -> dict[str, Any]:
    """Each rank offers another measured rate; every rank gets the minimum, and the keep
    the adaptive policy derives from it is the same everywhere."""
    from gradbed.ddp.adaptive import AdaptiveKeep
    from gradbed.ddp.record import BucketRecord

    planned = 100e6
    keep = AdaptiveKeep(planned)
    # Iterations 0 and 1: rank r moved 1 MB in (r + 1) x 80 ms (100 Mbit/s / (r + 1)).
    for it in (0, 1):
        dur = int((rank + 1) * 80e6)
        keep.record(BucketRecord(it, 0, "topk", "allgather", 10**6, 10**6, 1e6, 1.0, 0, 0,
                                 dur))
        d = keep.decide(it + 1, 0, 10**6)
    return {"agreed": keep.agreed_bps, "keep": d.keep, "mine": keep.measured_bps(1),
            "nan": math.isnan(d.keep)}


def adaptive_keeps(rank: int, world: int, iters: int) -> list[tuple[int, int, float, str]]:
    """The adaptive top-k hook on 127.0.0.1 (planned 1 Gbit/s): every bucket's
    (iteration, bucket, keep, collective) from the compressed iterations."""
    import gradbed.ddp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    ddp = DDP(model, bucket_cap_mb=0.5)
    state, hook = gradbed.ddp.hook("topk", policy="adaptive", planned_mbps=1000)
    ddp.register_comm_hook(state, hook)
    records: list[Any] = []
    state.listeners.add(records.append)
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(rank))
    for _ in range(iters):
        ddp.zero_grad()
        ddp(x).square().mean().backward()
    return [(r.iteration, r.bucket, r.keep, r.collective) for r in records
            if r.iteration >= 2]


def everything(rank: int, world: int, iters: int, byte_hooks: list[str]) -> dict[str, Any]:
    """All of the above in one group (each group costs a fork per rank and a rendezvous),
    then the modules of the controller, the topology or Mininet that this rank loaded while
    it built and ran every hook (its parent loaded none: the module docstring)."""
    out = {"adaptive": adaptive_keeps(rank, world, 6),
           "topk": reduced_grads(rank, world, "topk", 0.05, iters),
           "fp16": reduced_grads(rank, world, "fp16", 1.0, 3),
           "agreement": agreement(rank, world),
           "bytes": hook_bytes(rank, world, byte_hooks, iters)}
    out["loaded"] = sorted(m for m in sys.modules
                           if m.split(".")[0] in ("controller", "topo", "mininet"))
    out["gradbed_loaded"] = sorted(m for m in sys.modules if m.split(".")[0] == "gradbed")
    return out


if __name__ == "__main__":
    _main(sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]))
