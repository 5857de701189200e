"""gradbed works from any folder and as an installed package.

Config file names resolve relative to the config (shipped data through importlib.resources),
run directories are absolute and belong to the user who ran sudo, the agents keep the user's
PYTHONPATH, the probe survives a machine without modprobe or ethtool, a run that fails to
start leaves a directory that loads, the wheel ships configs/ and traces/data/ but not the
tests, and the command line behaves (--version, -h, a closed stdout).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from agents.core import config as cfgmod
from analysis.load import load_run
from controller import rundir
from controller.agent_env import agent_environment
from controller.paths import load_config, resolve_config_file, resolve_path

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def gradbed(*args: str, cwd: Path, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "controller.cli", *args], cwd=cwd,
                          env=env or ENV, capture_output=True, text=True, timeout=timeout)


# -- file names in a config ------------------------------------------------------------------


def test_paths_in_a_config_are_relative_to_the_config_file(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "mine.log").write_text("0 10\n1 20\n")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "down.log").write_text("0 5\n")
    conf = tmp_path / "exp" / "x.toml"
    conf.write_text('[trace]\nup = "mine.log"\n[background]\nkind = "flows"\n'
                    'flow_cdf = "traces/data/pareto_flows.cdf"\n'
                    '[topo.traces]\n"w0.up" = "mine.log"\n')
    monkeypatch.chdir(tmp_path / "elsewhere")
    cfg = load_config(conf, ["trace.down='down.log'"])
    assert cfg.trace.up == str(tmp_path / "exp" / "mine.log")          # the config's folder
    assert cfg.trace.down == str(tmp_path / "elsewhere" / "down.log")  # --set: the cwd
    assert cfg.topo.traces == {"w0.up": str(tmp_path / "exp" / "mine.log")}  # a table of them
    shipped = Path(cfg.background.flow_cdf)                             # shipped data
    assert shipped.is_absolute() and shipped.is_file()
    assert shipped.parts[-3:] == ("traces", "data", "pareto_flows.cdf")
    # A bare name of shipped data works too; an unknown file stays absolute for the error.
    assert Path(resolve_path("cellular_like.log", tmp_path)).is_file()
    assert resolve_path("nope.log", tmp_path) == str(tmp_path / "nope.log")
    assert resolve_path("", tmp_path) == "" and resolve_path("/abs/x", tmp_path) == "/abs/x"


def test_the_run_directory_records_absolute_paths(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from controller.run import Experiment

    monkeypatch.chdir(tmp_path)
    cfg = cfgmod.from_dict({"trace": {"up": "traces/data/step_100_20_100.log"}})
    exp = Experiment(cfg, out_root=Path("runs"), quiet=True)
    assert Path(exp.cfg.trace.up).is_file() and Path(exp.cfg.trace.up).is_absolute()


def test_a_shipped_config_is_found_from_any_folder(tmp_path: Path) -> None:
    assert resolve_config_file("demo.toml").is_file()
    p = gradbed("run", "configs/cellular.toml", "--dry-run", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    trace = str(REPO / "traces" / "data" / "cellular_like.log")
    assert trace in p.stdout  # the dry run names the trace it would replay, by its full path


# -- ownership and environment ---------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="changing owners needs root")
def test_run_directories_made_under_sudo_belong_to_the_user(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    monkeypatch.setenv("SUDO_UID", "65534")
    monkeypatch.setenv("SUDO_GID", "65533")
    monkeypatch.chdir(tmp_path)
    run_dir = rundir.create(Path("new/runs"), "x")
    assert run_dir.is_absolute() and run_dir.parent == tmp_path / "new" / "runs"
    (run_dir / "logs" / "ps.log").write_text("root wrote this during the run\n")
    rundir.hand_over(run_dir)
    for p in (tmp_path / "new", tmp_path / "new" / "runs", run_dir, run_dir / "events",
              run_dir / "logs" / "ps.log"):
        st = p.stat()
        assert (st.st_uid, st.st_gid) == (65534, 65533), p
    assert tmp_path.stat().st_uid == 0  # what existed before is not ours to give away
    monkeypatch.delenv("SUDO_UID")
    assert rundir.invoking_user() is None


def test_the_agents_keep_the_users_pythonpath() -> None:
    env = agent_environment({"PYTHONPATH": f"/opt/cuda-torch{os.pathsep}/repo"}, "/repo",
                            "default")
    assert env["PYTHONPATH"].split(os.pathsep) == ["/repo", "/opt/cuda-torch"]
    assert agent_environment({}, "/repo", "default")["PYTHONPATH"] == "/repo"


# -- the probe on a bare machine -------------------------------------------------------------


def test_probe_says_what_it_could_not_check_without_modprobe_or_ethtool(tmp_path: Path
                                                                       ) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("ip", "tc", "nsenter"):  # a machine with iproute2 but no kmod or ethtool
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    p = gradbed("probe", cwd=tmp_path, env={**ENV, "PATH": str(bin_dir)})
    assert "Traceback" not in p.stderr, p.stderr
    caps = json.loads(p.stdout)
    assert {"modprobe", "ethtool"} <= set(caps["missing_tools"])
    assert "ovs" in caps["unchecked"]["modprobe"]
    assert "gradbed probe: modprobe not found" in p.stderr
    if not os.path.isdir("/sys/module/openvswitch"):
        assert caps["ovs"] is None  # unknown, not "absent"
    if os.geteuid() == 0 and shutil.which("ip"):
        assert p.returncode == 0 and caps["htb"] is True  # the qdisc trials still ran


# -- a run that fails to start ---------------------------------------------------------------


def test_a_run_that_fails_before_its_network_leaves_a_loadable_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The failure is injected where a real one happens first (the kernel probe: a machine
    without ``ip``); everything after it is the real code."""
    import controller.run as run_mod

    def no_ip() -> dict[str, object]:
        raise FileNotFoundError(2, "No such file or directory", "ip")

    monkeypatch.setattr(run_mod, "probe", no_ip)
    monkeypatch.setattr(rundir, "ACTIVE_DIR", tmp_path / "active")
    exp = run_mod.Experiment(cfgmod.from_dict({"run": {"name": "broken"}}),
                             out_root=tmp_path, quiet=True)
    with pytest.raises(FileNotFoundError):
        exp.run()
    assert exp.run_dir is not None
    run = load_run(exp.run_dir)
    assert run.config["run"]["name"] == "broken"
    assert run.meta["schema_version"] and run.meta["incomplete"] is True
    assert run.summary["stop_reason"].startswith("failed to start: ")
    assert exp.exit_status == 3  # controller/exit_status.py: a failed start
    assert "FileNotFoundError" in run.summary["error"] and "'ip'" in run.summary["error"]
    assert not (exp.run_dir / "secret").exists()
    assert list((tmp_path / "active").glob("*")) == []  # no longer a run in progress


# -- the wheel -------------------------------------------------------------------------------


def _source_copy(dst: Path) -> Path:
    skip = shutil.ignore_patterns(".venv", "build", "dist", "runs", "*.egg-info", ".git",
                                  "__pycache__", ".*_cache", ".gpu", "data-cache")
    shutil.copytree(REPO, dst, ignore=skip)
    return dst


@pytest.mark.slow
def test_the_wheel_ships_configs_and_trace_data_not_tests(tmp_path: Path) -> None:
    src = _source_copy(tmp_path / "src")  # building writes build/ into the tree it builds
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(dist), str(src)], check=True, capture_output=True,
                   timeout=300)
    (wheel,) = dist.glob("gradbed-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    data = {p.relative_to(REPO).as_posix() for p in (REPO / "traces" / "data").rglob("*")
            if p.is_file()}
    configs = {p.relative_to(REPO).as_posix() for p in (REPO / "configs").glob("*.toml")}
    assert data and data <= names, data - names
    assert configs and configs <= names, configs - names
    assert not [n for n in names if n.startswith("tests/")]

    # Installed (not a checkout): from a folder far from the source, the shipped config and
    # its shipped trace are found, and the version is the package's.
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(site), str(wheel)], check=True, capture_output=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(site)}
    away = tmp_path / "away"
    away.mkdir()
    p = gradbed("run", "cellular.toml", "--dry-run", cwd=away, env=env)
    assert p.returncode == 0, p.stderr
    assert str(site / "traces" / "data" / "cellular_like.log") in p.stdout
    where = subprocess.run([sys.executable, "-c", "import controller; print(controller.__file__)"],
                           cwd=away, env=env, capture_output=True, text=True, check=True)
    assert where.stdout.startswith(str(site))


# -- the command line ------------------------------------------------------------------------


def test_version_help_and_unknown_commands(tmp_path: Path) -> None:
    p = gradbed("--version", cwd=tmp_path)
    assert p.returncode == 0 and p.stdout.startswith("gradbed ")
    p = gradbed("-h", cwd=tmp_path)
    assert p.returncode == 0 and p.stdout.startswith("usage: gradbed")
    for name in ("run", "sweep", "probe", "cleanup", "report", "trace", "plan"):
        assert name in p.stdout
    p = gradbed("run", "-h", cwd=tmp_path)
    assert p.returncode == 0 and p.stdout.startswith("usage: gradbed run")
    p = gradbed("frobnicate", cwd=tmp_path)
    assert p.returncode == 2 and "invalid choice: 'frobnicate'" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("args", [("-h",), ("run", "configs/demo.toml", "--dry-run")])
def test_a_closed_stdout_ends_quietly(tmp_path: Path, args: tuple[str, ...]) -> None:
    """``gradbed ... | head -0``: the reader is gone before the first write."""
    proc = subprocess.Popen([sys.executable, "-m", "controller.cli", *args], cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode == 141
