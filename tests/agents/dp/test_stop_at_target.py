"""``run.stop_at_target``: the PS ends a data-parallel run, completed, at its first
evaluation that reaches ``run.target_accuracy``, and every agent exits cleanly, the
workers' uploads of the next iteration, begun before BYE reached them, included."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

from agents.core import config as cfgmod
from agents.dp.worker import PSClosed, _said_bye
from agents.net import loop
from analysis.load import load_events
from controller.loopback.dp import make_run_dir, start_ps, start_worker, wait_agents

REPO = Path(__file__).resolve().parents[3]
TARGET = 0.6


@pytest.mark.parametrize("overrides, field, needle", [
    (["run.stop_at_target=true", "run.target_accuracy=0"], "run.stop_at_target", "needs run.target_accuracy > 0"),
    (["run.stop_at_target=true", "run.target_accuracy=0.5", "topo.shape='fabric'",
      "topo.role='stage'"], "run.stop_at_target", "data-parallel PS only"),
])
def test_a_config_that_cannot_stop_at_its_target_is_refused(
        overrides: list[str], field: str, needle: str) -> None:
    with pytest.raises(cfgmod.ConfigError) as e:
        cfgmod.load(REPO / "configs" / "digits.toml", overrides)
    assert field in str(e.value) and needle in str(e.value), str(e.value)


def test_the_ps_stops_at_the_first_evaluation_reaching_the_target(tmp_path: Path) -> None:
    iterations = 200
    run_dir, cfg = make_run_dir(tmp_path, [
        "net.workers=3", f"run.iterations={iterations}", "run.eval_every=2",
        f"run.target_accuracy={TARGET}", "run.stop_at_target=true"])
    ps = start_ps(run_dir)
    workers = [start_worker(run_dir, k, cfg.net.port) for k in range(cfg.net.workers)]
    rc, worker_rcs = wait_agents(ps, workers, 120, 60)
    logs = "\n".join((run_dir / f"{n}.log").read_text() for n in ("ps", "w0", "w1", "w2"))
    assert rc == 0 and worker_rcs == [0, 0, 0], logs
    ev = load_events(run_dir)
    evals = ev[ev["event"] == "eval"].sort_values("iter")
    acc = evals["accuracy"].to_list()
    assert acc[-1] >= TARGET and all(a < TARGET for a in acc[:-1]), acc
    done = ev[ev["event"] == "ps_done"].iloc[0]
    assert done["reason"] == "completed" and bool(done["at_target"]), done.to_dict()
    last = int(evals["iter"].iloc[-1])
    assert last + 1 < iterations, "the run did not stop early"
    assert int(ev[ev["event"] == "ps_iter_done"]["iter"].max()) == last
    # Every worker finished the iterations the PS stepped, and no further.
    assert set(ev[ev["event"] == "iter_done"].groupby("node")["iter"].max()) == {last}
    assert not (ev["event"] == "worker_error").any()


def test_the_drain_reads_until_each_peer_closes_and_no_longer_than_its_deadline() -> None:
    """What a worker still sends after BYE is read and thrown away until it closes; a peer
    that never closes is left after the deadline."""
    done_a, peer_a = socket.socketpair()
    open_b, peer_b = socket.socketpair()
    for s in (done_a, open_b):
        s.setblocking(False)

    def last_upload() -> None:
        peer_a.sendall(b"x" * 3_000_000)
        peer_a.close()
    sender = threading.Thread(target=last_upload)
    sender.start()  # more than the socket buffers hold: it finishes only while drained
    t0 = time.monotonic()
    loop.EventLoop.drain_until_closed([loop.Transport(done_a, "a")], 30.0)
    sender.join(timeout=5)
    assert not sender.is_alive() and time.monotonic() - t0 < 10
    t0 = time.monotonic()
    loop.EventLoop.drain_until_closed([loop.Transport(open_b, "b")], 0.5)
    assert 0.5 <= time.monotonic() - t0 < 5
    for s in (done_a, open_b, peer_b):
        s.close()


def test_a_send_cut_short_after_bye_ends_the_worker_only_when_the_ps_said_bye() -> None:
    bye: Future[tuple[int, int]] = Future()
    bye.set_exception(PSClosed("PS said BYE"))
    other: Future[tuple[int, int]] = Future()
    other.set_exception(ConnectionResetError("reset"))
    still: Future[tuple[int, int]] = Future()
    assert _said_bye(bye, 1.0)
    assert not _said_bye(other, 1.0)
    assert not _said_bye(still, 0.05)
