"""Run an unmodified ``torch.distributed`` script's ranks on loopback, each a fork of one
process that has imported torch: the reference runs the Mininet tests compare with, and the
DDP hook tests' gloo groups (``tests/support/ddp_ranks.py`` as the script).

    python -m tests.support.fork_ranks NPROC SCRIPT.py [ARGS...]

Each rank gets what torchrun gives a rank of a one-node run (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR`` 127.0.0.1,
``MASTER_PORT``; ``OMP_NUM_THREADS`` 1 unless set), runs the script as ``__main__`` with its argv and its folder first on
``sys.path``, and exits with the script's status. What it saves over ``torchrun --standalone``
is only CPU: torchrun's agent and every rank would each import torch again, and each DDP
rank torch._dynamo (together about 5 s of CPU per rank on a 2-core machine), beside the
emulated run the reference is compared with.

The rendezvous store is this process's, as torchrun's agent hosts it
(``TORCHELASTIC_USE_AGENT_STORE``: every rank a client): it listens on a port the kernel
picks and keeps from the start. A port found free and handed to rank 0 to bind seconds
later could meanwhile become another process's (a gloo listener of a test beside this one,
in the same namespace), and the ranks would then wait on a stranger until a timeout.

A rank leaves by ``os._exit`` once the script returns (the kernel closes its sockets), and
the script's ``dist.destroy_process_group()`` does nothing here: gloo's destructor joins its
worker threads while holding the GIL, and a worker that is releasing a finished
collective's tensors waits for the GIL, so one run in a few dozen hung there for good
(seen in gdb; pytorch/pytorch#56297, #75097). A fork that exits without destructors has
nothing to wait for.

The status is the first failing rank's (the others are then killed: a peer of a dead rank
would wait in its collective for gloo's 30-minute timeout), else 0.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import traceback
from pathlib import Path


def _no_destroy(group: object = None) -> None:
    """The rank's ``destroy_process_group``: nothing (its ``os._exit`` ends the group)."""


def _rank(script: Path, args: list[str], rank: int, world: int, port: int) -> None:
    """In a fork: be rank ``rank`` of the script, then leave with its status (no return)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                      GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    import torch.distributed as dist

    dist.destroy_process_group = _no_destroy  # the module docstring says why
    sys.argv = [str(script), *args]
    sys.path[0] = str(script.parent)  # what ``python SCRIPT.py`` puts first
    code = 0
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:  # noqa: BLE001 - the rank's failure, reported as python would
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(nproc: int, script: Path, args: list[str]) -> int:
    """Fork ``nproc`` ranks of ``script``, wait for them; the exit status (docstring)."""
    # As torchrun does for more than one process per node, and before torch loads its
    # OpenMP: two cores shared by spinning thread pools would slow every step tenfold.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # torch, imported once for every rank (the point of the fork), and torch._dynamo: DDP's
    # constructor reads it, which loads dynamo and sympy, as much CPU again.
    import torch._dynamo  # noqa: F401
    from torch.distributed import TCPStore

    # Held open until the ranks are done: port 0, the kernel's pick, bound from now on.
    store = TCPStore("127.0.0.1", 0, nproc + 1, is_master=True, wait_for_workers=False)
    port = store.port
    pids = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _rank(script, args, rank, nproc, port)
        pids.append(pid)
    status = 0
    while pids:
        pid, st = os.wait()
        pids.remove(pid)
        code = os.waitstatus_to_exitcode(st)
        if code and not status:
            status = code if code > 0 else 128 - code
            for other in pids:
                os.kill(other, signal.SIGKILL)
    return status


if __name__ == "__main__":
    if len(sys.argv) < 3 or not sys.argv[1].isdigit():
        sys.exit("usage: python -m tests.support.fork_ranks NPROC SCRIPT.py [ARGS...]")
    sys.exit(run(int(sys.argv[1]), Path(sys.argv[2]).resolve(), sys.argv[3:]))
