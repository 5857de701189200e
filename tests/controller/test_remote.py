"""The pure parts of a run's agents on other servers (``controller.remote``): their command
line and environment there, the alignment of their events onto the controller's clock,
and the unpacking of a server's run directory. No root, no ssh."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from agents.core import config as cfgmod
from agents.core.events import clock_fields
from controller.remote import REMOTE_ROOT, RemoteAgents, align_line, remote_env, unpack_aligned
from controller.roles.torchrun import torchrun_spec
from controller.run import Experiment
from topo.cluster import REPO, Cluster, SshAccess
from topo.shapes import shape_spec

SPREAD = ['cluster.servers=["localhost", "10.99.0.2"]', 'cluster.pins={worker="10.99.0.2"}']


def _remote(run_dir: Path) -> RemoteAgents:
    spec = shape_spec(cfgmod.load("configs/test_tiny.toml", SPREAD))
    return RemoteAgents(Cluster(spec, SshAccess()), run_dir, run_dir / "control.sock",
                        lambda _line: None)


def test_every_clock_monotonic_field_of_the_schema_is_a_clock_field():
    assert clock_fields("send_done") == ("ts_ns", "start_ns")
    assert clock_fields("recv_done") == ("ts_ns", "first_ns")
    assert clock_fields("pp_action") == ("ts_ns", "start_ns", "end_ns")
    assert clock_fields("iter_done") == ("ts_ns", "start_ns")
    assert clock_fields("no such event") == ("ts_ns",)


def test_an_event_from_another_server_moves_onto_this_clock_and_keeps_the_rest():
    row = {"ts_ns": 2_000_000_000_500, "node": "w0", "iter": 3, "event": "send_done",
           "bytes": 1234, "send_s": 0.5, "start_ns": 2_000_000_000_100}
    out = json.loads(align_line(json.dumps(row), lambda _ns: 2_000_000_000_000))
    assert out == {**row, "ts_ns": 500, "start_ns": 100}
    # A byte count is no clock, whatever its size; a cut line is left for the loaders.
    assert json.loads(align_line(json.dumps(row), lambda _ns: 0)) == row
    assert align_line('{"ts_ns": 12, "ev', lambda _ns: 5) == '{"ts_ns": 12, "ev'


def test_another_servers_agent_gets_its_run_directory_and_only_gradbeds_variables(tmp_path):
    run_dir = tmp_path / "tiny-1"
    remote = _remote(run_dir)
    assert remote.is_remote("w0") and not remote.is_remote("ps")
    base = {"PATH": "/usr/bin", "HOME": "/root", "PYTHONPATH": "/x",
            "GRADBED_STRICT_EVENTS": "1"}
    env = {**base, "PYTHONPATH": f"{REPO}:/x", "OMP_NUM_THREADS": "1"}
    assert remote_env(env, base) == {"PYTHONPATH": f"{REPO}:/x", "OMP_NUM_THREADS": "1",
                                     "GRADBED_STRICT_EVENTS": "1"}
    argv = remote.argv_for("w0", ["python", "-m", "agents.dp.worker", "--run-dir",
                                  str(run_dir), "--out", f"{run_dir}/x.pt",
                                  "--other", f"{run_dir}-2"], env, base)
    there = str(REMOTE_ROOT / "tiny-1")
    assert argv == ["env", "-C", str(REPO), "GRADBED_STRICT_EVENTS=1", "OMP_NUM_THREADS=1",
                    f"PYTHONPATH={REPO}:/x", "python", "-m", "agents.dp.worker",
                    "--run-dir", there, "--out", f"{there}/x.pt", "--other", f"{run_dir}-2"]


def _tar(members: dict[str, bytes], link: str = "") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if link:
            info = tarfile.TarInfo(link)
            info.type = tarfile.SYMTYPE
            info.linkname = "/etc/passwd"
            tar.addfile(info)
    return buf.getvalue()


def test_a_servers_directory_unpacks_aligned_and_never_outside_or_over_the_controllers(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "w0.log").write_text("the controller's copy\n")
    line = json.dumps({"ts_ns": 5_000, "node": "w0", "iter": 0, "event": "iter_done"})
    data = _tar({"./events/w0.jsonl": (line + "\n").encode(), "./ps_final_weights.pt": b"W",
                 "./logs/w0.log": b"the server's copy\n", "../escaped": b"no"},
                link="./events/link.jsonl")
    written = unpack_aligned(data, run_dir, lambda _ns: 1_000)
    assert sorted(p.relative_to(run_dir).as_posix() for p in written) == \
        ["events/w0.jsonl", "ps_final_weights.pt"]
    assert json.loads((run_dir / "events" / "w0.jsonl").read_text())["ts_ns"] == 4_000
    assert (run_dir / "logs" / "w0.log").read_text() == "the controller's copy\n"
    assert not (tmp_path / "escaped").exists() and not (run_dir / "events" / "link.jsonl").exists()
    # A link a user left in a run directory is never written through.
    outside, linked = tmp_path / "outside", tmp_path / "linked"
    outside.mkdir()
    linked.mkdir()
    (linked / "events").symlink_to(outside)
    assert unpack_aligned(data, linked, lambda _ns: 0) == [linked / "logs" / "w0.log",
                                                           linked / "ps_final_weights.pt"]
    assert list(outside.iterdir()) == []


def test_a_run_placed_over_servers_is_accepted_with_the_clusters_ssh_access():
    cfg = cfgmod.load("configs/test_tiny.toml", [*SPREAD, 'cluster.user="root"'])
    exp = Experiment(cfg, progress=False)
    assert exp._access == SshAccess.from_config(cfg.cluster)
    assert Experiment(cfgmod.load("configs/test_tiny.toml"), progress=False)._access is None


def test_torchrun_across_servers_reaches_its_servers_over_ssh():
    cfg = cfgmod.load("configs/test_tiny.toml", SPREAD)
    exp = Experiment(cfg, progress=False, spec=torchrun_spec(shape_spec(cfg)))
    assert exp._access == SshAccess.from_config(cfg.cluster)
