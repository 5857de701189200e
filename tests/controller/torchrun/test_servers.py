"""The pieces of a torchrun run's hosts on other servers that need no server: the command
a server runs for a host, the server check (run here by sh against real paths), the
server sampler's lines, its run in this machine's own namespace, and the tree stop on
real processes. Root for the sampler (sock_diag in a namespace) and the stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from controller.roles.torchrun import RankPlan
from controller.torchrun import host_sampler
from controller.torchrun.host_sampler import WatchedHost
from controller.torchrun.servers import (
    MISSING_EXIT,
    ServerUser,
    check_script,
    forwarded_env,
    server_argv,
)
from controller.torchrun.sockdiag import ConnSample
from controller.torchrun.stop import alive, stop_trees
from topo.cluster import REPO

PLAN = RankPlan("gbh1", "10.0.0.11", 1, (1,), ("/usr/bin/python3", "-m", "torch.distributed.run",
                                                "train.py"),
                {"GLOO_SOCKET_IFNAME": "gbh1-eth0", "GRADBED_HOST": "gbh1"})


def test_a_server_runs_the_plan_in_the_folder_as_the_user_and_writes_its_pid_first() -> None:
    user = ServerUser("alice", 1001, 1002, "/home/alice")
    argv = server_argv(PLAN, "/srv/exp", "/run/gradbed/remote/r/torchrun-pids/gbh1", user,
                       {"GRADBED_STRICT_EVENTS": "1", "GLOO_SOCKET_IFNAME": "eth9"})
    assert argv[:4] == ["sh", "-c", 'echo $$ > "$0" && exec "$@"',
                        "/run/gradbed/remote/r/torchrun-pids/gbh1"]
    assert argv[4:7] == ["env", "-C", "/srv/exp"]
    # The plan's variables win over forwarded ones; the user's identity is the server's.
    assert "GLOO_SOCKET_IFNAME=gbh1-eth0" in argv and "GLOO_SOCKET_IFNAME=eth9" not in argv
    assert {"GRADBED_STRICT_EVENTS=1", "HOME=/home/alice", "USER=alice"} <= set(argv)
    i = argv.index("setpriv")
    assert argv[i:i + 5] == ["setpriv", "--reuid=1001", "--regid=1002", "--init-groups", "--"]
    assert tuple(argv[i + 5:]) == PLAN.argv
    assert "setpriv" not in server_argv(PLAN, "/srv", "/p", None, {})


def test_the_pid_wrapper_gives_the_pid_of_what_it_runs(tmp_path: Path) -> None:
    plan = RankPlan("h", "ip", 0, (0,), ("sh", "-c", "echo $$"), {})
    pid_file = tmp_path / "pid"
    out = subprocess.run(server_argv(plan, str(tmp_path), str(pid_file), None, {}),
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == pid_file.read_text().strip()


def test_only_gradbed_s_and_torch_s_variables_cross_to_a_server() -> None:
    env = {"PATH": "/x", "HOME": "/root", "SUDO_UID": "5", "GRADBED_WARM": "0",
           "TORCH_CPP_LOG_LEVEL": "INFO", "OMP_NUM_THREADS": "1", "PYTHONPATH": "/r",
           "NCCL_DEBUG": "WARN"}
    assert forwarded_env(env) == {"GRADBED_WARM": "0", "TORCH_CPP_LOG_LEVEL": "INFO",
                                  "OMP_NUM_THREADS": "1", "PYTHONPATH": "/r",
                                  "NCCL_DEBUG": "WARN"}


def _check(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=False)


def test_the_server_check_names_the_first_missing_path_or_user(tmp_path: Path) -> None:
    train = tmp_path / "train.py"
    train.write_text("pass\n")
    good = {"torchrun.script": str(train), "torchrun.python": sys.executable,
            "cwd": str(tmp_path)}
    logs = tmp_path / "logs" / "ranks" / "gbh1"
    ok = _check(check_script(good, "root", [str(logs)], [str(logs)]))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split() == ["0", "0", "/root"] and logs.is_dir()
    assert _check(check_script({**good, "torchrun.python": "python3"}, "", [], [])
                  ).returncode == 0  # a name on the PATH, as --python python3 allows
    for what, bad in (("torchrun.script", str(tmp_path / "nope.py")),
                      ("torchrun.python", str(tmp_path / "nopython")),
                      ("cwd", str(tmp_path / "gone"))):
        p = _check(check_script({**good, what: bad}, "root", [], []))
        assert (p.returncode, p.stdout.strip()) == (MISSING_EXIT, f"missing {what}")
    p = _check(check_script(good, "no-such-user-gradbed", [], []))
    assert (p.returncode, p.stdout.strip()) == (MISSING_EXIT, "missing user")


def test_a_sampler_line_round_trips_and_a_bad_one_is_named() -> None:
    c = ConnSample(7, 2, "ESTABLISHED", "10.0.0.11", 40000, "10.0.0.10", 29500, 100, 200,
                   0, 0, 150, 10, 1e6, final=True)
    row = host_sampler.parse_line(host_sampler.sample_line("gbh1", 5, [c], 1.5, (10, 20)))
    assert row == {"host": "gbh1", "ts_ns": 5, "conns": [c], "cpu_s": 1.5, "iface": (10, 20)}
    with pytest.raises(ValueError, match="without ts_ns"):
        host_sampler.parse_line(json.dumps({"host": "gbh1", "conns": []}))
    hosts = [WatchedHost("gbh1", 12, "gbh1-eth0", "/p")]
    assert host_sampler.decode_spec(host_sampler.encode_spec(hosts, 0.5)) == (hosts, 0.5)


@pytest.mark.skipif(os.geteuid() != 0, reason="sock_diag in a namespace needs root")
def test_the_server_sampler_streams_connections_cpu_and_final_counters(tmp_path: Path) -> None:
    """The program a server runs, run here in this machine's own namespace: a TCP
    connection over loopback shows in its samples, the pid file's tree its CPU, and the
    close of its stdin gives the interface's counters and the end."""
    import socket

    lst = socket.create_server(("127.0.0.1", 0))
    pid_file = tmp_path / "pid"
    pid_file.write_text(str(os.getpid()))
    spec = host_sampler.encode_spec([WatchedHost("me", os.getpid(), "lo", str(pid_file))], 0.05)
    proc = subprocess.Popen([sys.executable, "-m", "controller.torchrun.host_sampler", spec],
                            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    assert json.loads(proc.stdout.readline()) == {"ready": True}
    cli = socket.create_connection(lst.getsockname())
    srv, _ = lst.accept()
    cli.sendall(b"x" * 5000)
    assert srv.recv(10000)
    ports = set()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and lst.getsockname()[1] not in ports:
        row = host_sampler.parse_line(proc.stdout.readline())
        ports |= {c.dport for c in row["conns"]}
        assert row["cpu_s"] is not None and row["cpu_s"] > 0  # this test's own process
    assert lst.getsockname()[1] in ports
    cli.close()
    srv.close()
    lst.close()
    proc.stdin.close()
    rows = [json.loads(ln) for ln in proc.stdout.read().splitlines()]
    assert proc.wait(timeout=10) == 0
    assert rows[-1] == {"end": True}
    assert rows[-2]["host"] == "me" and min(rows[-2]["iface"]) >= 5000


@pytest.mark.skipif(os.geteuid() != 0, reason="the stop's reference is root's")
def test_a_tree_in_sessions_of_its_own_is_stopped_whole(tmp_path: Path) -> None:
    """What torchrun does: each child in a session of its own; one that ignores SIGTERM
    is killed after the grace."""
    from controller.torchrun import stop

    pid_file = tmp_path / "pid"
    root = subprocess.Popen(["sh", "-c", "setsid sleep 300 & setsid sh -c \"trap '' TERM; "
                             "sleep 300\" & wait"], start_new_session=True)
    pid_file.write_text(str(root.pid))
    deadline = time.monotonic() + 10
    from controller.torchrun.busy import descendants

    while time.monotonic() < deadline and len(descendants(root.pid)) < 3:
        time.sleep(0.05)
    tree = [root.pid, *descendants(root.pid)]
    assert len(tree) >= 4
    assert stop.main(["0.5", str(pid_file)]) == 0
    root.wait(timeout=5)
    assert not any(alive(q) for q in tree) and not pid_file.exists()
    assert stop_trees([], 0.1) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="sock_diag in a namespace needs root")
def test_a_server_s_watch_feeds_the_run_s_sampler_on_this_clock(tmp_path: Path) -> None:
    """The controller's side of a server's watch, with ``sh -c`` in place of ssh (the
    server is this machine, its "offset" 1000 s): a connection's bytes reach the run's
    sampler as the host's progress, stamped on this clock, and the counters arrive at
    the stop."""
    import socket

    from agents.core.events import now_ns
    from controller.torchrun.servers import ServerWatch
    from controller.torchrun.sockdiag import ConnSampler

    # This machine's stamps, read as those of a server whose clock runs 1000 s behind,
    # move 1000 s forward.
    offset_ns = -1000 * 10**9
    # A connection to one of this machine's global addresses: not loopback, so it counts
    # as the host's progress (the host's own address is another one).
    addrs = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"],
                           capture_output=True, text=True, check=True).stdout.split()
    ips = [a.split("/")[0] for i, a in enumerate(addrs) if i and addrs[i - 1] == "inet"]
    if not ips:
        pytest.skip("no global IPv4 address here")
    sampler = ConnSampler({}, fed={"me": "10.255.255.254"})
    lst = socket.create_server((ips[0], 0))
    watch = ServerWatch("here", ["sh", "-c"],
                        [WatchedHost("me", os.getpid(), "lo", str(tmp_path / "none"))],
                        sampler, offset_ns, lambda _line: None)
    before = now_ns()
    watch.start()
    watch.wait_ready(timeout_s=30)
    cli = socket.create_connection(lst.getsockname())
    srv, _ = lst.accept()
    cli.sendall(b"y" * 20000)
    got = 0
    while got < 20000:
        got += len(srv.recv(65536))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and sampler.progress["me"][0] < 20000:
        time.sleep(0.05)
    total, at_ns = sampler.progress["me"]
    assert total >= 20000  # to 127.0.0.1 is "local" for a host of another address
    # The server's stamps minus its offset: this clock, not 1000 s off.
    assert before + 1000 * 10**9 <= at_ns <= now_ns() + 1000 * 10**9
    for s in (cli, srv, lst):
        s.close()
    watch.stop()
    assert watch.error is None and watch.iface["me"][1] >= 20000
    assert any(c.final for _, c in sampler.final_connections())


GOOD_CONN = {"cookie": 7, "family": 2, "state": "ESTABLISHED", "src": "10.0.0.11",
             "sport": 40000, "dst": "10.0.0.10", "dport": 29500, "bytes_acked": 100,
             "bytes_received": 200, "bytes_retrans": 0, "total_retrans": 0, "rtt_us": 150,
             "snd_cwnd_pkts": 10, "delivery_rate_bps": 1e6}


@pytest.mark.parametrize(("line", "named"), [
    ("Welcome to server 2!", "not JSON: 'Welcome"),
    ("[1, 2]", "not an object"),
    ('{"error": 5}', "an error that is not a string"),
    ('{"host": 3, "ts_ns": 1, "conns": []}', "host is not a string"),
    ('{"host": "gbh1", "ts_ns": true, "conns": []}', "without ts_ns or conns"),
    ('{"host": "gbh1", "ts_ns": 1, "conns": {}}', "without ts_ns or conns"),
    ('{"host": "gbh1", "ts_ns": 1, "conns": [7]}', "host gbh1: a connection that is not"),
    ('{"host": "gbh1", "ts_ns": 1, "conns": [{"cookie": 1}]}', "a connection without"),
    (json.dumps({"host": "gbh1", "ts_ns": 1, "conns": [{**GOOD_CONN, "evil": 1}]}),
     "unknown field(s) evil"),
    (json.dumps({"host": "gbh1", "ts_ns": 1, "conns": [{**GOOD_CONN, "bytes_acked": -5}]}),
     "bytes_acked is '-5', not a non-negative int"),
    (json.dumps({"host": "gbh1", "ts_ns": 1, "conns": [{**GOOD_CONN, "src": 9}]}),
     "src is '9', not a str"),
    ('{"host": "gbh1", "ts_ns": 1, "conns": [], "cpu_s": "lots"}', "cpu_s is 'lots'"),
    ('{"host": "gbh1", "ts_ns": 1, "conns": [], "cpu_s": NaN}', "cpu_s is 'nan'"),
    ('{"host": "gbh1", "ts_ns": 1, "conns": [], "iface": [1]}', "iface is '[1]'"),
    ('{"host": "gbh1", "ts_ns": 1, "conns": [], "iface": [1, "2"]}', "not [rx_bytes"),
])
def test_a_garbage_line_from_a_server_s_watch_is_refused_naming_what_is_wrong(
        line: str, named: str) -> None:
    """The watch's lines are bytes from another machine: every field is checked."""
    with pytest.raises(ValueError) as e:
        host_sampler.parse_line(line)
    assert named in str(e.value)
    ok = host_sampler.parse_line(json.dumps({"host": "gbh1", "ts_ns": 1,
                                             "conns": [GOOD_CONN], "cpu_s": 0}))
    assert ok["conns"] == [ConnSample(**GOOD_CONN)]


def _fake_watch(tmp_path: Path, script: str) -> tuple[Any, Any]:
    """A ServerWatch whose "ssh" is ``sh -c SCRIPT`` (the real command is ignored)."""
    from controller.torchrun.servers import ServerWatch
    from controller.torchrun.sockdiag import ConnSampler

    sampler = ConnSampler({}, fed={"gbh1": "10.0.0.11"})
    watch = ServerWatch("10.99.0.2", ["sh", "-c", script, "sh"],
                        [WatchedHost("gbh1", 1, "gbh1-eth0", str(tmp_path / "pid"))],
                        sampler, 0, lambda _line: None)
    return watch, sampler


def test_a_server_whose_watch_sends_garbage_is_named_not_a_traceback(tmp_path: Path) -> None:
    from controller.roles.torchrun import TorchrunError

    # Before "ready" (a login banner a server's shell prints): the ranks never start.
    watch, _ = _fake_watch(tmp_path, "echo 'Last login: yesterday'; cat >/dev/null")
    watch.start()
    with pytest.raises(TorchrunError) as e:
        watch.wait_ready(timeout_s=20)
    assert str(e.value).startswith("server 10.99.0.2: line 1 of its ranks' watch refused: "
                                   "not JSON: 'Last login"), e.value
    watch.stop()
    # After "ready": the watch is failed (its hosts read no more bytes), its error names
    # the server and the line; a sample of a host of another server is refused too.
    sample = host_sampler.sample_line("gbh0", 5, [], None)
    watch, sampler = _fake_watch(tmp_path, f"echo '{{\"ready\": true}}'; echo '{sample}'; "
                                           "cat >/dev/null")
    watch.start()
    watch.wait_ready(timeout_s=20)
    deadline = time.monotonic() + 20
    while not watch.failed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert watch.failed
    assert watch.error == ("server 10.99.0.2: line 2 of its ranks' watch refused: a sample "
                           "of host 'gbh0', not one of this server's (gbh1)"), watch.error
    watch.stop()
    assert not sampler.rows


def test_a_server_s_answer_about_the_user_is_checked() -> None:
    from controller.roles.torchrun import TorchrunError
    from controller.torchrun.servers import parse_user

    assert parse_user("s", "alice", "1001 1002 /home/al ice") == ServerUser(
        "alice", 1001, 1002, "/home/al ice")
    for bad in ("", "x 1 /h", "1 2", "1 2 home", "-1 2 /h", "١ 2 /h"):
        with pytest.raises(TorchrunError, match=r"server s: user alice: the check's answer"):
            parse_user("s", "alice", bad)


@pytest.mark.skipif(os.geteuid() != 0, reason="the stop's reference is root's")
def test_a_stopped_rank_runs_its_sigterm_handler_when_stopped(tmp_path: Path) -> None:
    """A SIGSTOPped process is continued after its SIGTERM: its handler runs (without
    SIGCONT it would wait out the grace and die of SIGKILL)."""
    mark = tmp_path / "handled"
    proc = subprocess.Popen(["sh", "-c", f"trap 'touch {mark}; exit 0' TERM; "
                             "while :; do sleep 0.05; done"], start_new_session=True)
    time.sleep(0.3)  # the trap is set
    os.kill(proc.pid, signal.SIGSTOP)
    stop_trees([proc.pid], grace_s=5)
    proc.wait(timeout=5)
    assert mark.exists() and proc.returncode == 0


def _spawn(args: list[str]) -> subprocess.Popen[bytes]:
    """``sh -c 'sleep 300' ARGS...``: a process whose command line holds ``args``."""
    return subprocess.Popen(["sh", "-c", "sleep 300", *args], start_new_session=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="the stop's reference is root's")
def test_a_killed_controller_s_torchrun_trees_and_watch_are_stopped_and_nothing_else(
        tmp_path: Path) -> None:
    """What ``gradbed cleanup`` runs on each server (stop_run), on real processes here:
    the run's torchrun trees from its pid files and the watch naming its directory go;
    a pid file whose pid is no torchrun any more, and another run's watch, stay."""
    from controller.torchrun.stop import PID_DIR, stop_run

    run = tmp_path / "run" / "r1"
    (run / PID_DIR).mkdir(parents=True)
    other = str(tmp_path / "run" / "r2")
    # torchrun's tree: its ranks in sessions of their own, one stopped (SIGSTOP).
    torchrun = subprocess.Popen(["sh", "-c", "setsid sleep 300 & setsid sleep 300 & wait",
                                 "torch.distributed.run"], start_new_session=True)
    (run / PID_DIR / "gbh1").write_text(str(torchrun.pid))
    reused = _spawn(["not-torchrun"])  # the pid a dead torchrun's file names, reused
    (run / PID_DIR / "gbh2").write_text(str(reused.pid))
    watch = _spawn(["-m", "controller.torchrun.host_sampler",
                    json.dumps({"hosts": [{"pid_file": f"{run}/{PID_DIR}/gbh1"}]})])
    others = _spawn(["-m", "controller.torchrun.host_sampler", f"{other}/{PID_DIR}/gbh1"])
    deadline = time.monotonic() + 10
    from controller.torchrun.busy import descendants

    while time.monotonic() < deadline and len(descendants(torchrun.pid)) < 2:
        time.sleep(0.05)
    tree = [torchrun.pid, *descendants(torchrun.pid)]
    os.kill(tree[-1], signal.SIGSTOP)
    try:
        lines = stop_run(str(run), grace_s=5)
        assert lines == ["stopped 3 process(es) of torchrun (gbh1)",
                         f"stopped the ranks' watch (pid {watch.pid})"]
        torchrun.wait(timeout=5)
        watch.wait(timeout=5)
        assert not any(alive(q) for q in tree)
        assert reused.poll() is None and others.poll() is None
        assert not (run / PID_DIR).exists()
    finally:
        for p in (reused, others, watch, torchrun):
            p.kill()
            p.wait()
    with pytest.raises(ValueError, match="no run's directory"):
        stop_run("", 1)


def test_a_host_s_idle_time_counts_from_the_ranks_start_not_the_checks_before() -> None:
    """The servers' checks and the admission rules take seconds over ssh before the
    ranks start: that is no host's idle time for the stall check."""
    from agents.core.events import now_ns
    from controller.torchrun.sockdiag import ConnSampler

    sampler = ConnSampler({}, fed={"gbh1": "10.0.0.11"})
    sampler.feed("gbh1", now_ns(), [ConnSample(**GOOD_CONN)])  # 300 bytes moved, then checks
    moved, before = sampler.progress["gbh1"]
    time.sleep(0.05)
    started = now_ns()
    sampler.mark_start()
    assert sampler.progress["gbh1"][0] == moved == 300
    assert sampler.progress["gbh1"][1] >= started > before


@pytest.mark.skipif(os.geteuid() != 0, reason="sock_diag in a namespace needs root")
def test_bytes_a_process_has_not_read_are_seen_and_name_the_stuck_host() -> None:
    """A rank that stops reading leaves its peers' bytes in its sockets: sock_diag reads
    them (a real connection here), and the sampler counts them for the host whose
    connections to other hosts hold them."""
    import socket

    from controller.torchrun.sockdiag import ConnSampler, HostDiag

    lst = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(lst.getsockname())
    srv, _ = lst.accept()
    cli.sendall(b"z" * 5000)  # never read by srv
    diag = HostDiag("me", os.getpid())
    try:
        deadline = time.monotonic() + 10
        unread = 0
        while unread < 5000 and time.monotonic() < deadline:
            unread = sum(c.unread_bytes for c in diag.dump()
                         if c.sport == lst.getsockname()[1] and c.state == "ESTABLISHED")
        assert unread == 5000
        listening = [c for c in diag.dump() if c.state == "LISTEN"
                     and c.sport == lst.getsockname()[1]]
        assert all(c.unread_bytes == 0 for c in listening)
    finally:
        diag.close()
        for s in (cli, srv, lst):
            s.close()
    sampler = ConnSampler({}, fed={"gbh0": "10.0.0.10", "gbh1": "10.0.0.11"})
    stuck = ConnSample(**{**GOOD_CONN, "unread_bytes": 4096})
    sampler.feed("gbh1", 1, [stuck])
    sampler.feed("gbh0", 1, [ConnSample(**{**GOOD_CONN, "cookie": 8, "src": "10.0.0.10",
                                           "dst": "10.0.0.11"})])
    assert (sampler.unread_bytes("gbh1"), sampler.unread_bytes("gbh0")) == (4096, 0)
    # Closed (its final counters), or to the host itself: not waiting on a peer.
    sampler.feed("gbh1", 2, [ConnSample(**{**GOOD_CONN, "unread_bytes": 4096, "final": True})])
    assert sampler.unread_bytes("gbh1") == 0


def test_a_lost_server_is_waited_for_only_its_grace() -> None:
    """After a failure that came with a sign of a dying server, its control connection
    is given the grace to end: its loss is then the reason; without it, "" in time."""
    from controller.run import wait_lost

    t0 = time.monotonic()
    assert wait_lost(lambda: "server lost: s2 (x)" if time.monotonic() - t0 > 0.3 else "",
                     3.0) == "server lost: s2 (x)"
    assert time.monotonic() - t0 < 2.5
    t1 = time.monotonic()
    assert wait_lost(lambda: "", 0.5) == ""
    assert 0.5 <= time.monotonic() - t1 < 2.5
