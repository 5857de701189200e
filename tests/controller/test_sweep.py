"""Tests of ``gradbed sweep`` (controller/sweep.py): grid parsing, expansion and up-front
validation without root, the tables it writes, and one real sweep in Mininet (the demo's,
shared with test_demo.py)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.core import config as cfgmod
from agents.net.control import control_path
from controller import sweep
from tests.support import real_run

REPO = Path(__file__).resolve().parents[2]


def _base() -> dict:
    return tomllib.loads((REPO / "configs" / "test_tiny.toml").read_text())


def test_grid_arg_parses_typed_values() -> None:
    assert sweep.parse_grid_arg("compress.name=none,topk") == ("compress.name", ("none", "topk"))
    key, vals = sweep.parse_grid_arg("net.bottleneck_mbps=10, 100,1000.5")
    assert key == "net.bottleneck_mbps" and vals == (10, 100, 1000.5)
    assert sweep.parse_grid_arg("net.offload=true,false")[1] == (True, False)
    for bad in ("compress.name", "name=a,b", "net.workers=1,,2"):
        with pytest.raises(cfgmod.ConfigError):
            sweep.parse_grid_arg(bad)


def test_expand_is_cartesian_last_key_fastest_with_repeats() -> None:
    spec = sweep.parse_sweep(_base(), ["compress.name=none,topk,dgc",
                                       "net.bottleneck_mbps=10,100"], repeat=2)
    combos = sweep.expand(spec)
    assert len(combos) == 3 * 2 * 2
    assert [c.index for c in combos] == list(range(12))
    assert combos[0].values == (("compress.name", "none"), ("net.bottleneck_mbps", 10))
    assert combos[1].values == combos[0].values and combos[1].repeat == 1
    assert combos[2].values == (("compress.name", "none"), ("net.bottleneck_mbps", 100))
    assert combos[-1].values == (("compress.name", "dgc"), ("net.bottleneck_mbps", 100))
    pairs = {c.values for c in combos}
    assert len(pairs) == 6
    # Repeat r runs with run.seed + r, so repeats are different samples, not copies.
    assert combos[1].overrides(7)[-1] == "run.seed=8"
    assert not any(o.startswith("run.seed") for o in combos[0].overrides(7))


def test_toml_grid_and_command_line_merge() -> None:
    data = _base()
    data["sweep"] = {"name": "s", "repeat": 3,
                     "grid": {"compress.name": ["none", "topk"], "net": {"workers": [1, 2]}}}
    spec = sweep.parse_sweep(data, ["net.workers=3"], repeat=None)
    assert spec.name == "s" and spec.repeat == 3
    assert dict(spec.grid) == {"compress.name": ("none", "topk"), "net.workers": (3,)}
    assert "sweep" not in spec.base  # stripped: ExperimentConfig has no [sweep]
    assert len(sweep.validate(spec)) == 2 * 3


def test_overrides_round_trip_through_config() -> None:
    spec = sweep.parse_sweep(_base(), ["compress.name=none,qsgd", "compress.ratio=0.01,1",
                                       "net.offload=false,true"])
    cfgs = sweep.validate(spec)
    got = {(c.compress.name, c.compress.ratio, c.net.offload) for c in cfgs}
    assert got == {(n, r, o) for n in ("none", "qsgd") for r in (0.01, 1.0)
                   for o in (False, True)}
    assert sweep.toml_literal("topk") == '"topk"' and sweep.toml_literal(10) == "10"


@pytest.mark.parametrize("grid,needle", [
    (["net.bottleneck_mbps=10,-5"], "net.bottleneck_mbps = -5"),
    (["compress.name=none,bogus"], "compress.name = 'bogus'"),
    (["net.nope=1,2"], "net.nope: unknown field"),
    (["compress.ratio=0.5,0.5"], "repeated value"),
])
def test_validation_names_field_and_combination_before_running(grid: list[str],
                                                               needle: str) -> None:
    with pytest.raises(cfgmod.ConfigError) as e:
        sweep.validate(sweep.parse_sweep(_base(), grid, source="x.toml"))
    assert needle in str(e.value) and "x.toml" in str(e.value)


def test_bad_sweep_table_and_empty_grid() -> None:
    data = _base()
    with pytest.raises(cfgmod.ConfigError, match="empty grid"):
        sweep.parse_sweep(data)
    data["sweep"] = {"grids": {}}
    with pytest.raises(cfgmod.ConfigError, match=r"sweep\.grids: unknown field"):
        sweep.parse_sweep(data)
    data["sweep"] = {"grid": {"compress.name": []}}
    with pytest.raises(cfgmod.ConfigError, match="non-empty list"):
        sweep.parse_sweep(data)
    data["sweep"] = {"grid": {"compress.name": ["none"]}, "repeat": 0}
    with pytest.raises(cfgmod.ConfigError, match="sweep.repeat"):
        sweep.parse_sweep(data)


def test_shipped_sweep_config_is_the_5x3_grid() -> None:
    spec = sweep.load_sweep(REPO / "configs" / "sweep.toml")
    cfgs = sweep.validate(spec)
    assert len(cfgs) == 15
    assert {c.compress.name for c in cfgs} == {"none", "topk", "dgc", "qsgd", "powersgd"}
    assert {c.net.bottleneck_mbps for c in cfgs} == {10.0, 100.0, 1000.0}
    assert all(c.run.target_accuracy > 0 for c in cfgs)


def test_tables_have_one_row_per_run_with_failures(tmp_path: Path) -> None:
    spec = sweep.parse_sweep(_base(), ["compress.name=none,topk"])
    a, b = sweep.expand(spec)
    ok = sweep.RunResult(a, status="ok", run_dir=tmp_path / "run-a", wall_s=12.0, summary={
        "workers": 2, "iterations": 12, "bytes_up_per_iter": 2_000_000.0,
        "iter_time_s_mean": 0.25, "final_accuracy": 0.9, "time_to_target_s": 3.5,
        "iterations_to_target": 6, "wall_s": 12.0})
    bad = sweep.RunResult(b, status="failed", error="exit 1: PS | exploded", wall_s=3.0)
    sweep.write_tables(tmp_path, spec, [ok, bad], target=0.5)
    rows = list(csv.DictReader(open(tmp_path / "sweep.csv")))
    assert [r["compress.name"] for r in rows] == ["none", "topk"]
    assert rows[0]["status"] == "ok" and float(rows[0]["bytes_up_per_worker_iter"]) == 1e6
    assert rows[1]["status"] == "failed" and "exploded" in rows[1]["error"]
    assert rows[1]["final_accuracy"] == "" and float(rows[1]["wall_s"]) == 3.0
    md = (tmp_path / "sweep.md").read_text().splitlines()
    assert len(md) == 4 and "time to 0.5 acc (s)" in md[0] and "wall" not in md[0]
    assert "2 MB" in md[2] and "0.900" in md[2]
    assert "PS \\| exploded" in md[3]  # a pipe in an error must not break the table
    assert not list(tmp_path.glob(".*.tmp"))


def test_cli_dry_run_and_config_error_exit_codes() -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "controller.cli", "sweep", *args],
                              cwd=REPO, capture_output=True, text=True, timeout=60)

    p = cli("configs/test_tiny.toml", "--grid", "compress.name=none,topk", "--dry-run")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ['1: compress.name="none"', '2: compress.name="topk"']
    p = cli("configs/test_tiny.toml", "--grid", "net.workers=2,100", "--dry-run")
    assert p.returncode == 2 and "net.workers = 100" in p.stderr


def test_deep_run_dirs_get_their_control_socket_under_run_gradbed(tmp_path: Path) -> None:
    """A deep --out would make RUN/control.sock longer than AF_UNIX allows (108 bytes):
    the socket moves to /run/gradbed and RUN/control.path says where, for every agent."""
    deep = tmp_path / ("d" * 60) / ("e" * 60) / "run-x"
    deep.mkdir(parents=True)
    path = control_path(deep)
    assert len(os.fsencode(path)) <= 100 and path.parent == Path("/run/gradbed")
    assert (deep / "control.path").read_text().strip() == str(path)
    assert control_path(deep) == path  # agents resolve the same path
    shallow = Path(tempfile.mkdtemp(prefix="gb", dir="/tmp"))
    assert control_path(shallow) == shallow.resolve() / "control.sock"
    shutil.rmtree(shallow)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    # pytest's tmp_path is too deep for the runs' AF_UNIX control sockets (108 bytes).
    d = Path(tempfile.mkdtemp(prefix="gbsw", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.mininet
def test_a_real_sweep_writes_both_rows(tmp_path_factory: pytest.TempPathFactory) -> None:
    # The demo's shortened sweep (test_demo.py reads the same one): a real two-run sweep.
    sweep_dir, p = real_run.demo_sweep(tmp_path_factory.mktemp("sweep"))
    assert sweep_dir.name.startswith("sweep-demo-"), sweep_dir
    iterations = int(real_run.DEMO_SHORT[0].split("=")[1])
    rows = list(csv.DictReader(open(sweep_dir / "sweep.csv")))
    assert [r["compress.name"] for r in rows] == ["none", "topk"]
    assert all(r["status"] == "ok" and int(r["iterations"]) == iterations for r in rows), rows
    # topk at ratio 0.03 sends far fewer bytes than dense.
    assert float(rows[1]["bytes_up_per_iter"]) < 0.3 * float(rows[0]["bytes_up_per_iter"])
    for r in rows:
        run_dir = sweep_dir / r["run_dir"]
        assert json.loads((run_dir / "summary.json").read_text())["iterations"] == iterations
    md = (sweep_dir / "sweep.md").read_text().splitlines()
    assert len(md) == 2 + 2
    assert (sweep_dir / "report" / "index.html").exists()
    assert (sweep_dir / "base.toml").exists() and len(list((sweep_dir / "logs").iterdir())) == 2


# -- orchestration without root: a fake ``gradbed run`` stands in for the interpreter --------

FAKE_RUN = r'''#!{python}
"""Fake of ``python -m controller.cli run BASE --out DIR --no-report --no-progress --set k=v ...``."""
import json, os, signal, sys, time
from pathlib import Path
args = sys.argv[1:]
out = Path(args[args.index("--out") + 1])
sets = dict(a.split("=", 1) for a in args[args.index("--no-progress") + 1:] if a != "--set")
name = json.loads(sets["compress.name"])
if name == "topk":
    print("gradbed run: config error: pretend the PS exploded", file=sys.stderr)
    sys.exit(1)
run_dir = out / f"run-{name}"
run_dir.mkdir()
if name == "randomk":  # a run that timed out: its own summary and status 5 say so
    (run_dir / "summary.json").write_text(json.dumps(
        {"workers": 2, "iterations": 5, "stop_reason": "timeout after 8 s",
         "interrupted": False}))
    print(run_dir)
    sys.exit(5)
interrupted = False
if name == "dgc":
    (out / "dgc-started").touch()
    try:
        time.sleep(30)
    except KeyboardInterrupt:
        interrupted = True
summary = {"workers": 2, "iterations": 3 if interrupted else 12, "bytes_up_per_iter": 8e5,
           "iter_time_s_mean": 0.1, "final_accuracy": 0.8, "wall_s": 1.5,
           "stop_reason": "interrupted" if interrupted else "completed",
           "interrupted": interrupted}
(run_dir / "summary.json").write_text(json.dumps(summary))
print(run_dir)
sys.exit(130 if interrupted else 0)
'''


@pytest.fixture
def fake_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    exe = tmp_path / "fake-python"
    exe.write_text(FAKE_RUN.replace("{python}", sys.executable))
    exe.chmod(0o755)
    monkeypatch.setattr(sweep.sys, "executable", str(exe))
    return exe


def test_failed_run_is_a_row_and_the_sweep_goes_on(short_tmp: Path, fake_python: Path) -> None:
    spec = sweep.parse_sweep(_base(), ["compress.name=none,topk,qsgd"])
    sweep_dir, done, _ = sweep.run_sweep(spec, short_tmp, progress=False)
    assert [r.status for r in done] == ["ok", "failed", "ok"]
    assert "pretend the PS exploded" in done[1].error and done[1].error.startswith("exit 1")
    rows = list(csv.DictReader(open(sweep_dir / "sweep.csv")))
    assert [(r["compress.name"], r["status"]) for r in rows] == [
        ("none", "ok"), ("topk", "failed"), ("qsgd", "ok")]
    assert rows[0]["run_dir"] == "run-none" and float(rows[0]["bytes_up_per_iter"]) == 8e5
    assert "sweep" not in tomllib.loads((sweep_dir / "base.toml").read_text())
    assert json.loads((sweep_dir / "sweep.json").read_text())["combinations"] == 3
    # Each run skips its own report: the sweep writes one for all of them.
    assert " run " in (sweep_dir / "logs" / "001.log").read_text().splitlines()[0]
    assert "--no-report" in (sweep_dir / "logs" / "001.log").read_text().splitlines()[0]


def test_ctrl_c_stops_the_sweep_and_keeps_the_table(short_tmp: Path, fake_python: Path) -> None:
    import os
    import signal
    import threading
    import time

    spec = sweep.parse_sweep(_base(), ["compress.name=none,dgc,qsgd"])

    def interrupt_when_dgc_runs() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if list(short_tmp.glob("sweep-*/dgc-started")):
                time.sleep(0.2)
                os.kill(os.getpid(), signal.SIGINT)  # what a terminal's Ctrl-C sends
                return
            time.sleep(0.05)

    t = threading.Thread(target=interrupt_when_dgc_runs, daemon=True)
    t.start()
    sweep_dir, done, _ = sweep.run_sweep(spec, short_tmp, progress=False)
    t.join()
    assert [r.status for r in done] == ["ok", "interrupted"]
    rows = list(csv.DictReader(open(sweep_dir / "sweep.csv")))
    assert [(r["compress.name"], r["status"]) for r in rows] == [("none", "ok"),
                                                                 ("dgc", "interrupted")]
    assert rows[1]["iterations"] == "3"  # the interrupted run's own summary is kept


def test_the_sweep_exits_with_a_failed_runs_status_and_shows_each(
        short_tmp: Path, fake_python: Path) -> None:
    base = short_tmp / "base.toml"
    base.write_text((REPO / "configs" / "test_tiny.toml").read_text())
    rc = sweep.sweep_main([str(base), "--grid", "compress.name=none,randomk,qsgd", "--out",
                           str(short_tmp), "--no-progress"])
    assert rc == 5  # the timed-out run's own status (controller/exit_status.py)
    rows = list(csv.DictReader(open(next(short_tmp.glob("sweep-*/sweep.csv")))))
    assert [(r["compress.name"], r["status"], r["exit_status"]) for r in rows] == [
        ("none", "ok", "0"), ("randomk", "failed", "5"), ("qsgd", "ok", "0")]
