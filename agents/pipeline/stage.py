"""A pipeline stage: one process per stage, running its schedule on its layer slices.

Run inside a stage host as ``python -m agents.pipeline.stage --run-dir RUN --stage S [--replica R]
--peers H0:P0,H1:P1,...`` (the addresses of this replica's stages, in order). It:

1. builds the workload's model (an ``nn.Sequential``), cuts it into ``stages * chunks``
   pieces by ``pipeline.balance`` (or evenly by parameter count) and keeps its own: piece
   ``chunk * p + stage`` for each chunk (one chunk; two for the two-group schedule);
2. connects to its downstream neighbour and accepts its upstream one (a ring for the
   two-group schedule), each an authenticated :class:`agents.net.link.Link` under the key
   only the link's two ends hold (from the controller through stdin), with a MAC and a
   sequence number on every frame;
3. runs its schedule (:mod:`agents.core.schedules`, validated first) action by action:
   forwards and backwards of micro-batches, recomputation, optimizer steps. Activations
   go downstream (``ACTIVATION``) and gradients upstream (``GRADIENT_BACK``) through the
   frame codec, the frame's ``iteration`` field carrying the micro-batch id and ``chunk``
   the receiving chunk.

The work is three parts, each its own file: :mod:`agents.pipeline.runtime` steps the
schedule's actions, :mod:`agents.pipeline.links` moves the bytes (one sender thread and
one reader thread per connection) and :mod:`agents.pipeline.compute` runs the layers with
their 2BW weight versions. This module builds the three and ends the run.

Every received byte is hostile: a message must be the next one the neighbour's schedule
sends on that connection (:mod:`agents.pipeline.conversation`: kind, micro-batch, chunk,
sender, in order, BYE last) and decode to exactly the shape the model gives at that
boundary; otherwise the stage stops with a ``frame_error`` naming the peer.

Compression (``pipeline.act_compress`` / ``grad_compress``: fp16 or top-k) applies per
message; gradients may keep an error-feedback residual per boundary (``R = G - sent``).
With ``pipeline.recompute`` a forward runs without autograd and keeps only its input; the
schedule's ``R`` action re-runs it with autograd just before the stage waits for the
downstream gradient. Activation bytes held are counted exactly: every tensor autograd saves
(``torch.autograd.graph.saved_tensors_hooks``) plus the stashed inputs.

With ``--ps HOST:PORT`` the stage also talks to the pipeline's PS (:mod:`agents.pipeline.stage_ps`)
over one more connection: with ``pipeline.replicas = d > 1`` every optimizer step sends the
chunk's slice gradient (``GRAD``) and waits for the mean over the d replicas (``UPDATE``);
replica 0 sends its slice weights (``SLICE_WEIGHTS``) after the steps the PS evaluates at
(``run.eval_every``, and the last), so the PS can measure held-out accuracy. ``d > 1``
needs the PS.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

import agents.compress  # noqa: F401  (registers every compressor)
from agents.core import config as cfgmod
from agents.core.events import EventLog
from agents.core.nodes import stage_links, stage_node
from agents.net import auth, codec, wire
from agents.net.control import liveness_client
from agents.pipeline.common import LockedLog, StageError, build_schedule
from agents.pipeline.compute import StageCompute
from agents.pipeline.links import StageLinks
from agents.pipeline.runtime import Runtime
from agents.workloads.device import make_deterministic, memory_stats

__all__ = ["Stage", "StageError", "main", "parse_peers"]


class Stage:
    """Stage ``stage`` of replica ``replica``: its compute, its links and the runtime
    that steps its schedule over both."""

    def __init__(self, cfg: cfgmod.ExperimentConfig, run_dir: Path, run_id: str,
                 secret: bytes, stage: int, peers: list[tuple[str, int]], replica: int = 0,
                 ps: tuple[str, int] | None = None, keys: auth.KeyBundle | None = None
                 ) -> None:
        """``secret`` names the run (the frames' tag); ``keys``: this stage's bundle with
        the key of every link it is an end of (without it, derived from ``secret`` as
        ``--auth file`` does: tests and runs by hand)."""
        pc = cfg.pipeline
        if len(peers) != pc.stages:
            raise ValueError(f"--peers: {len(peers)} addresses for {pc.stages} stages")
        if pc.replicas > 1 and ps is None:
            raise ValueError(f"--ps: pipeline.replicas = {pc.replicas} averages the stage "
                             "gradients through the PS; give its HOST:PORT")
        self.cfg, self.s, self.replica = cfg, stage, replica
        self.node = stage_node(replica, stage, pc.replicas)
        keys = keys or auth.file_bundle(secret, self.node,
                                        stage_links(replica, stage, pc.stages, pc.replicas))
        self.log = LockedLog(EventLog.for_node(run_dir, run_id, self.node))
        self.schedule = build_schedule(pc, cfg.run.iterations)
        self.compute = StageCompute(cfg, self.schedule, stage, replica)
        self.links = StageLinks(cfg, self.schedule, stage=stage, replica=replica,
                                run_id=run_id, tag=codec.run_tag(run_id, secret), keys=keys,
                                peers=peers, ps=ps, log=self.log,
                                in_shape=self.compute.in_shape,
                                out_shape=self.compute.out_shape)
        self.runtime = Runtime(cfg, self.schedule, self.compute, self.links, self.log)

    def run(self) -> int:
        self.links.connect()
        self.links.connect_ps()
        self.log.emit("stage_ready", stage=self.s, replica=self.replica,
                      chunks=self.schedule.chunks, schedule=self.cfg.pipeline.schedule,
                      params=self.compute.params, actions=len(self.runtime.actions))
        try:
            self.runtime.run()
            self.links.finish()
            self._save()
        finally:
            self.links.close()
        return 0

    def _save(self) -> None:
        """The final weights (``RUN/<node>_final_weights.pt``) and ``pp_done``."""
        lk = self.links
        out = {c: self.compute.final_params(c).clone() for c in self.compute.versions}
        run_dir = self.log.path.parent.parent
        torch.save(out, run_dir / f"{self.node}_final_weights.pt")
        self.log.emit("pp_done", stage=self.s, replica=self.replica,
                      peak_held_bytes=self.compute.peak_held_bytes,
                      bytes_down=lk.down.bytes_sent if lk.down else 0,
                      bytes_up=lk.up.bytes_sent if lk.up else 0)
        if self.compute.device.type == "cuda":
            self.log.emit("device_memory", **memory_stats(self.compute.device))


def parse_peers(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--peers: {item!r} is not HOST:PORT")
        out.append((host, int(port)))
    return out


def main(argv: list[str] | None = None, on_error: Callable[[str], None] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agents.pipeline.stage",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--stage", required=True, type=int)
    ap.add_argument("--replica", type=int, default=0)
    ap.add_argument("--peers", required=True, help="HOST:PORT of every stage of this replica")
    ap.add_argument("--ps", default=None, help="HOST:PORT of the pipeline's PS (averages "
                    "the replicas' stage gradients, evaluates; needed with d > 1)")
    auth.add_auth_argument(ap)
    args = ap.parse_args(argv)
    cfg = cfgmod.load(args.run_dir / "config.toml")
    # With --auth stdin the bundle holds this agent's control key and the key of each link
    # it is an end of (agents.net.link), which only the link's two ends hold.
    keys, secret = auth.agent_keys(args.auth, args.run_dir, codec.PUBLIC_SECRET)
    # Heartbeats on the control channel: a hung agent is declared lost by the controller.
    liveness_client(args.run_dir, keys, timeout_s=cfg.guard.handshake_timeout_s)
    torch.set_num_threads(1)
    make_deterministic(cfg.run.deterministic)
    ps = parse_peers(args.ps)[0] if args.ps else None
    st = Stage(cfg, args.run_dir, args.run_dir.name, secret, args.stage,
               parse_peers(args.peers), args.replica, ps, keys)
    return wire.run_agent(st.run, name=lambda: st.node,
                          errors=(StageError, ConnectionError, codec.FrameError, OSError),
                          code=2, on_error=lambda e: st.log.emit("stage_error", error=e),
                          close=st.log.close)


if __name__ == "__main__":
    wire.exit_process(main())
