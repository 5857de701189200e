"""The combine waits for the whole dispatch (``moe.combine_after_dispatch``, DISPATCH_DONE):
3 expert hosts over a real loopback TCP mesh, one of them slow to take in its tokens. With
the wait, no host starts its combine before the slow host holds its dispatch, so no
combine frame shares a link with a dispatch still under way; without it the early hosts
start theirs at once (the case the benchmark's busiest link showed, docs/moe.md)."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import pytest

from agents.core.config import WorkloadConfig
from agents.core.moe_config import MoEConfig
from agents.moe.hosts import ExpertHost
from agents.moe.mesh import Mesh, file_keys
from agents.moe.model import load_data
from tests.agents.moe.test_moe_transparency import free_ports

SLOW_HOST = 2
SLOW_S = 0.3  # the slow host reads each dispatch message this much later


def run_step(combine_after_dispatch: bool) -> dict[int, list[Any]]:
    cfg = dataclasses.replace(MoEConfig(), hosts=3, experts=6, layers=2, top_k=2,
                              d_model=16, d_hidden=16,
                              combine_after_dispatch=combine_after_dispatch)
    data = load_data("digits")
    base = free_ports(cfg.hosts)
    addrs = [("127.0.0.1", base + h) for h in range(cfg.hosts)]
    phases: dict[int, list[Any]] = {}
    errors: list[BaseException] = []

    def host(h: int) -> None:
        try:
            with Mesh(h, addrs, 7, run_id="order", keys=file_keys(b"order", h, cfg.hosts)
                      ) as mesh:
                if h == SLOW_HOST:
                    recv = mesh._recv_counted  # reads one peer's dispatch (TOKENS) message

                    def slow_recv(*args: Any) -> Any:
                        time.sleep(SLOW_S)
                        return recv(*args)
                    mesh._recv_counted = slow_recv  # type: ignore[method-assign]
                eh = ExpertHost(cfg, data, h, mesh, seed=0,
                                train=WorkloadConfig(batch_size=8, lr=0.05, momentum=0.9))
                eh.train_step(0)
                phases[h] = eh.log.phases
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=host, args=(h,)) for h in range(cfg.hosts)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    assert len(phases) == cfg.hosts
    return phases


def first_combine_and_last_dispatch(phases: dict[int, list[Any]], layer: int
                                    ) -> tuple[int, int]:
    combine = min(p.start_ns for ps in phases.values() for p in ps
                  if p.name == "combine" and p.layer == layer)
    dispatch = max(p.end_ns for ps in phases.values() for p in ps
                   if p.name == "dispatch_tokens" and p.layer == layer)
    return combine, dispatch


@pytest.mark.parametrize("combine_after_dispatch", [True, False])
def test_combine_waits_for_every_host_dispatch(combine_after_dispatch: bool) -> None:
    phases = run_step(combine_after_dispatch)
    for layer in (0, 1):
        combine, dispatch = first_combine_and_last_dispatch(phases, layer)
        if combine_after_dispatch:
            # Every host's combine began after the slow host held its dispatch.
            assert combine >= dispatch, (layer, (dispatch - combine) / 1e6)
            done = [p for ps in phases.values() for p in ps
                    if p.name == "dispatch_done" and p.layer == layer]
            assert len(done) == 3 and all(p.bytes_up == p.bytes_down > 0 for p in done)
        else:
            # The early hosts' combine began while the slow host still took its tokens in.
            assert dispatch - combine > SLOW_S / 2 * 1e9, (layer, (dispatch - combine) / 1e6)
