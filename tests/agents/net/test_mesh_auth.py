"""Per-agent keys on the stage and expert meshes (agents/net/link.py): a peer with a
wrong key, a peer claiming another's index, and a frame replayed on a live link are each
refused with an error naming the connection, and the real peers still connect."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from agents.core import config as cfgmod
from agents.core.nodes import stage_links
from agents.core.schedules import Kind
from agents.moe.mesh import Mesh, file_keys
from agents.net import auth, codec, handshake, protocol
from agents.net.codec import FrameError, MsgType
from agents.pipeline.stage import Stage, StageError
from controller import warm
from controller.loopback.dp import Agent, connect, free_port
from controller.loopback.hostile import CapturingProxy
from controller.loopback.pipeline import make_run_dir
from controller.roles import RoleContext, plan_commands
from tests.agents.moe.test_moe_transparency import free_ports
from topo.shapes import shape_spec

SECRET = b"mesh auth test secret"
RUN = "mesh-auth"
TAG = codec.run_tag(RUN, codec.PUBLIC_SECRET)


def test_bundles_hold_only_their_own_links() -> None:
    master = auth.new_master()
    links = stage_links(1, 0, 3, 2)  # replica 1's stage 0 of 3: its replica, and the PS
    assert sorted(b for _, _, b in links) == ["ps", "r1s1", "r1s2"]
    b = auth.decode_bundle(auth.bundle_for(master, "h4", links).encode())
    assert b.link_key("stage", "r1s0", "r1s1") == auth.pair_key(master, "stage", "r1s1", "r1s0")
    with pytest.raises(KeyError, match=r"no key for link stage/r0s1\|r1s0"):
        b.link_key("stage", "r1s0", "r0s1")  # another replica's stage: not a neighbour
    assert auth.pair_key(master, "stage", "s0", "s1") != auth.pair_key(master, "expert",
                                                                      "s0", "s1")


# -- the expert mesh ----------------------------------------------------------------------

def _impostor(addr: tuple[str, int], *, me: int, key: bytes, out: dict[str, Any]) -> None:
    """Dial ``addr`` as expert host ``me`` with ``key``; record how it was refused."""
    s = connect(addr[1])
    try:
        handshake.dial(s, protocol.Dialer(RUN, "expert", me, key, welcome_from=("expert", 0)),
                       run_tag=TAG, name="impostor", timeout_s=10)
        out["result"] = "accepted"
    except handshake.HandshakeError as e:
        out["result"] = str(e)
    finally:
        s.close()


def _host(h: int, addrs: list[tuple[str, int]], keys: dict[int, bytes],
          out: dict[int, Any], after: threading.Thread | None = None, steps: int = 1) -> None:
    if after is not None:
        after.join()
    try:
        with Mesh(h, addrs, TAG, run_id=RUN, keys=keys, timeout_s=20) as mesh:
            got = []
            for step in range(steps):
                sends = {j: torch.full((4,), float(10 * h + j)) for j in mesh.peers}
                got.append(mesh.exchange(MsgType.TOKENS, step, 0, sends,
                                         dict.fromkeys(mesh.peers, 4)))
            out[h] = got
    except BaseException as e:  # noqa: BLE001  (the test asserts on it)
        out[h] = e


@pytest.mark.loopback
@pytest.mark.parametrize("attack", ["wrong key", "another host's index"])
def test_expert_mesh_refuses_an_impostor(attack: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    base = free_ports(3)
    addrs = [("127.0.0.1", base + h) for h in range(3)]
    keys = {h: file_keys(SECRET, h, 3) for h in range(3)}
    # Host 2 claims to be host 1 with the key it shares with host 0 (it holds no other
    # key host 0 would take); an outsider claims host 1 with a key of its own.
    key = keys[2][0] if attack == "another host's index" else b"x" * 32
    seen: dict[str, Any] = {}
    imp = threading.Thread(target=_impostor, args=(addrs[0],),
                           kwargs=dict(me=1, key=key, out=seen))
    out: dict[int, Any] = {}
    threads = [threading.Thread(target=_host, args=(0, addrs, keys[0], out))]
    threads += [threading.Thread(target=_host, args=(h, addrs, keys[h], out),
                                 kwargs=dict(after=imp)) for h in (1, 2)]
    for t in [imp, *threads]:
        t.start()
    for t in threads:
        t.join(60)
    assert "proof: expert 1 failed the challenge" in seen["result"], seen
    assert "impostor" in seen["result"]  # the dialer's error names its connection
    printed = capsys.readouterr().out
    assert "expert host 0: refused 1 connection(s) from 127.0.0.1 (handshake failed): " \
        "expert host 0 <- 127.0.0.1:" in printed
    assert "expert 1: refused: proof: expert 1 failed the challenge" in printed
    for h in range(3):  # the real hosts connected and exchanged after the refusal
        assert not isinstance(out[h], BaseException), out[h]
        (got,) = out[h]
        for j, t in got.items():
            assert torch.equal(t, torch.full((4,), float(10 * j + h)))


@pytest.mark.loopback
def test_expert_dialer_refuses_a_host_without_the_key() -> None:
    """The dialer checks the acceptor too: WELCOME's MAC proves it holds the pair key."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    wrong = {1: b"y" * 32}

    def fake_host0() -> None:
        conn, _ = srv.accept()
        try:
            handshake.answer(conn, protocol.Answerer(RUN, "expert",
                                                     protocol.keys_by_index(wrong)),
                             run_tag=TAG, name="fake host 0", welcome=("expert", 0),
                             timeout_s=10)
        except handshake.HandshakeError:
            pass
        finally:
            conn.close()

    t = threading.Thread(target=fake_host0)
    t.start()
    s = connect(port)
    with pytest.raises(handshake.HandshakeError, match="real host 1: expert 1: refused: .*"
                                                       "proof: expert 1 failed the challenge"):
        # The fake host refuses our proof (it holds another key) before it could
        # forge a WELCOME; either way we never accept it.
        handshake.dial(s, protocol.Dialer(RUN, "expert", 1, file_keys(SECRET, 1, 2)[0],
                                          welcome_from=("expert", 0)),
                       run_tag=TAG, name="real host 1", timeout_s=10)
    s.close()
    t.join()
    srv.close()


@pytest.mark.loopback
def test_expert_mesh_refuses_a_replayed_frame() -> None:
    base = free_ports(2)
    addrs = [("127.0.0.1", base), ("127.0.0.1", base + 1)]
    tap = CapturingProxy(base)
    tap.start()
    keys = {h: file_keys(SECRET, h, 2) for h in range(2)}
    # Each host's step 0 done: host 0's needs host 1's frame, which the tap keeps before
    # it forwards it (waiting for host 1 alone raced the tap's thread).
    done = [threading.Event(), threading.Event()]
    proceed = threading.Event()
    out: dict[int, Any] = {}

    def host(h: int) -> None:
        # Host 1 reaches host 0 through the tap: what an on-path attacker records.
        view = list(addrs) if h == 0 else [("127.0.0.1", tap.port), addrs[1]]
        try:
            with Mesh(h, view, TAG, run_id=RUN, keys=keys[h], timeout_s=20) as mesh:
                # Both exchanges carry the same step and chunk, so the replayed frame
                # passes every header check and only its MAC can tell.
                for step in range(2):
                    out[(h, step)] = mesh.exchange(MsgType.TOKENS, 0, 0,
                                                   {1 - h: torch.full((4,), float(h))},
                                                   {1 - h: 4})
                    if step == 0:
                        done[h].set()
                        proceed.wait(20)
        except BaseException as e:  # noqa: BLE001
            out[h] = e

    threads = [threading.Thread(target=host, args=(h,)) for h in range(2)]
    for t in threads:
        t.start()
    assert all(d.wait(30) for d in done)
    frames = [raw for h, raw in tap.frames() if h.msg_type == MsgType.TOKENS]
    assert len(frames) == 1  # host 1's step-0 frame, as it crossed the link
    tap.inject(frames[0])  # ...sent again before host 1's step-1 frame
    proceed.set()
    for t in threads:
        t.join(60)
    err = out[0]
    assert isinstance(err, FrameError), out
    assert "expert host 0 <- 127.0.0.1:" in str(err)  # names the connection
    assert "fails its MAC" in str(err)


# -- the stage mesh -----------------------------------------------------------------------

def _stages(tmp: Path) -> tuple[Stage, Stage, Path]:
    run_dir, cfg = make_run_dir(tmp, ["pipeline.stages=2", "pipeline.micro_batches=2",
                                      "pipeline.micro_batch_size=4", "run.iterations=1"])
    peers = [("127.0.0.1", free_port()), ("127.0.0.1", free_port())]
    secret = (run_dir / "secret").read_bytes()
    s1 = Stage(cfg, run_dir, run_dir.name, secret, 1, peers)
    s0 = Stage(cfg, run_dir, run_dir.name, secret, 0, list(peers))
    return s0, s1, run_dir


def _connect_all(*stages: Stage) -> dict[int, Any]:
    out: dict[int, Any] = {}

    def go(st: Stage) -> None:
        try:
            st.links.connect()
            out[st.s] = "ok"
        except BaseException as e:  # noqa: BLE001
            out[st.s] = e

    ts = [threading.Thread(target=go, args=(st,)) for st in stages]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return out


def _close(*stages: Stage) -> None:
    for st in stages:
        st.links.close()
        st.log.close()


@pytest.mark.loopback
@pytest.mark.parametrize("attack", ["wrong key", "another stage's index"])
def test_stage_mesh_refuses_an_impostor(tmp_path: Path, attack: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    s0, s1, run_dir = _stages(tmp_path)
    # Stage 1 accepts only its upstream stage (handshake index 0). An impostor either
    # claims index 0 without the key, or is another stage (index 5, say) holding a real
    # key of this mesh that is not stage 1's.
    me, key = ((0, b"z" * 32) if attack == "wrong key" else
               (5, auth.pair_key(auth.file_master(b"s3cret-for-tests-only-0123456789"),
                                 "stage", "s0", "s1")))
    seen: dict[str, Any] = {}

    def impostor() -> None:
        s = connect(s1.links.peers_addr[1][1])
        try:
            handshake.dial(s, protocol.Dialer(run_dir.name, "stage", me, key,
                                              welcome_from=("stage", 1)),
                           run_tag=s1.links.tag, name="impostor", timeout_s=10)
            seen["result"] = "accepted"
        except handshake.HandshakeError as e:
            seen["result"] = str(e)
        finally:
            s.close()

    out: dict[int, Any] = {}
    t1 = threading.Thread(target=lambda: out.update(_connect_all(s1)))
    t1.start()
    impostor()
    out.update(_connect_all(s0))
    t1.join(60)
    try:
        assert out == {0: "ok", 1: "ok"}, out
        why = ("proof: stage 0 failed the challenge" if attack == "wrong key" else
               "hello.worker: stage 5 is not a stage this end accepts (stages [0])")
        assert why in seen["result"], seen
        err = capsys.readouterr().err
        assert "s1: stage s1 <- 127.0.0.1:" in err and why in err  # names the connection
        events = (run_dir / "events" / "s1.jsonl").read_text()
        assert "frame_error" in events
    finally:
        _close(s0, s1)


@pytest.mark.loopback
def test_stage_mesh_refuses_a_replayed_frame(tmp_path: Path) -> None:
    s0, s1, _ = _stages(tmp_path)
    tap = CapturingProxy(s1.links.peers_addr[1][1])
    tap.start()
    s0.links.peers_addr = [s0.links.peers_addr[0], ("127.0.0.1", tap.port)]  # stage 0 -> tap -> 1
    out = _connect_all(s0, s1)
    try:
        assert out == {0: "ok", 1: "ok"}, out
        numel = int(torch.Size(s1.compute.in_shape[0]).numel())
        assert s0.links.down is not None
        s0.links.down.link.send_message([torch.randn(numel)], msg_type=MsgType.ACTIVATION,
                                  worker=0, iteration=0, chunk=0)
        act = s1.links.take(Kind.RECV_ACT, 0, 0)
        assert act.numel() == numel  # the real frame was taken
        frames = [raw for h, raw in tap.frames() if h.msg_type == MsgType.ACTIVATION]
        tap.inject(frames[0])
        for _ in range(200):
            if s1.links.inbox.failure is not None:
                break
            threading.Event().wait(0.05)
        assert s1.links.inbox.failure is not None
        assert "stage s1 <- 127.0.0.1:" in s1.links.inbox.failure and "fails its MAC" in s1.links.inbox.failure
        with pytest.raises(StageError, match="fails its MAC"):
            s1.links.take(Kind.RECV_ACT, 1, 0)
    finally:
        _close(s0, s1)


def test_roles_hand_each_agent_only_its_own_links(tmp_path: Path) -> None:
    """The runner writes ``bundle_for(master, host, cmd.links)`` down each agent's stdin:
    every link a role names has that agent at one end, and each pair of neighbours names
    the same link (so both ends derive one key)."""
    repo = Path(__file__).resolve().parents[3]
    cfg = cfgmod.load(repo / "configs/pipeline.toml",
                      ["pipeline.stages=3", "pipeline.replicas=2", "topo.hosts=7"])
    every = [c for _, c in plan_commands(RoleContext(cfg, shape_spec(cfg), tmp_path, "PY"))]
    names = {c.host: {auth.link_name(m, a, b) for m, a, b in c.links} for c in every}
    mine = {c.host: {a for _, a, _ in c.links} for c in every}
    assert [len(mine[h]) for h in sorted(mine)] == [1] * 7  # one own name each
    assert names["gbh4"] == {"stage/r1s0|r1s1", "stage/r1s1|r1s2", "stage/ps|r1s1"}
    assert len(names["gbh6"]) == 6 and all("ps|" in n for n in names["gbh6"])  # the PS
    assert "stage/r0s1|r1s1" not in set().union(*names.values())  # not neighbours
    assert names["gbh0"] & names["gbh1"] == {"stage/r0s0|r0s1"}


@pytest.mark.loopback
def test_expert_hosts_read_their_keys_from_the_controllers_bundle(tmp_path: Path) -> None:
    """``agents.moe.expert --auth stdin`` takes its mesh keys from the bundle on its stdin
    (``auth.agent_keys``, as the stage and the pipeline PS do), with no RUN/secret: two
    hosts whose bundles hold their link train a step; a host whose bundle lacks it stops
    at start-up, naming the missing link."""
    import subprocess
    import sys

    from agents.moe.mesh import mesh_links
    from tests.agents.moe.test_moe_offload_training import BASE

    repo = Path(__file__).resolve().parents[3]
    master = b"controller master key for the test"

    def start(run_dir: Path, overrides: list[str], links: dict[int, list[auth.Link]]
              ) -> list[Agent]:
        """Start hosts ``links`` (of 2) as the controller does, each bundle on stdin."""
        (run_dir / "events").mkdir(parents=True)
        cfg = cfgmod.load(repo / "configs" / "digits.toml",
                          [*overrides, "run.iterations=1", f"net.port={free_ports(2)}"])
        (run_dir / "config.toml").write_text(cfgmod.dumps(cfg))
        procs = []
        for h in links:
            p = warm.spawn([sys.executable, "-m", "agents.moe.expert", "--run-dir",
                            str(run_dir), "--host", str(h), "--auth", "stdin"],
                           cwd=repo, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
            assert p.stdin is not None
            p.stdin.write(auth.bundle_for(master, f"e{h}", links[h]).encode())
            p.stdin.flush()
            procs.append(p)
        return procs

    def finish(procs: list[Agent]) -> list[tuple[int, str]]:
        out = []
        for p in procs:
            assert p.stdin is not None and p.stdout is not None
            try:
                text = p.stdout.read().decode()  # ends when the agent exits
                out.append((p.wait(timeout=60), text))
            finally:
                if p.poll() is None:
                    p.kill()
                p.stdin.close()
        return out

    good = finish(start(tmp_path / "good", BASE, {h: mesh_links(h, 2) for h in (0, 1)}))
    assert [rc for rc, _ in good] == [0, 0], good
    assert not (tmp_path / "good" / "secret").exists()
    rc1, text1 = finish(start(tmp_path / "bad", BASE, {1: []}))[0]
    assert rc1 != 0 and "expert host 1: " in text1 and "expert/e0|e1" in text1, text1
