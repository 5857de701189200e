"""Bandwidth-trace loaders, generators, the replayer and the ASTRA-sim gradient profiles."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from agents.core.bandwidth import (
    BandwidthTrace,
    TraceError,
    load_csv,
    load_mahimahi,
    load_rate_log,
    load_trace,
)
from traces import generate
from traces.gradients import load_gradient_sizes, load_profile
from traces.replay import TraceReplayer

SHARED = Path(os.environ.get("GRADBED_SHARED_TRACES",
                           Path(__file__).resolve().parents[2].parent / "shared" / "traces"))
REPO_DATA = Path(__file__).resolve().parents[2] / "traces" / "data"


def shared(rel: str) -> Path:
    path = SHARED / rel
    if not path.exists():
        pytest.skip(f"{path} is absent: the real traces live in ../shared/traces, which a "
                    f"fresh clone does not have")
    return path


# -- real traces ---------------------------------------------------------------------------


def test_pantheon_100mbps_mean_within_half_percent() -> None:
    tr = load_trace(shared("pantheon/100mbps.trace"))
    assert abs(tr.mean_mbps() - 100.0) / 100.0 < 0.005
    # Mahimahi's loop length is the last timestamp.
    assert tr.period_s == pytest.approx(59.999)


@pytest.mark.parametrize("rel, mean_mbps, opportunities", [
    ("mahimahi/Verizon-LTE-short.down", 5.0, 58_655),
    ("mahimahi/TMobile-LTE-short.down", 16.7, 194_846),
])
def test_cellular_means(rel: str, mean_mbps: float, opportunities: int) -> None:
    tr = load_mahimahi(shared(rel))
    assert tr.mean_mbps() == pytest.approx(mean_mbps, rel=0.01)
    # The mean is exactly the opportunities' bits over the period: no packet lost in binning.
    bits = tr.bytes_between(0.0, tr.period_s) * 8
    assert bits == pytest.approx(opportunities * 1500 * 8, rel=1e-9)


@pytest.mark.parametrize("rel, mean_mbps", [("pantheon/12mbps.trace", 12.0),
                                            ("pantheon/108mbps.trace", 108.0),
                                            ("pantheon/10-every-200.trace", 0.6)])
def test_short_period_pantheon_traces(rel: str, mean_mbps: float) -> None:
    # One-line files loop every millisecond; 10-every-200 delivers 10 packets at each 200 ms.
    assert load_trace(shared(rel)).mean_mbps() == pytest.approx(mean_mbps, rel=1e-9)


# -- malformed input -----------------------------------------------------------------------


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("name, text, line, words", [
    ("empty.trace", "", 1, "empty"),
    ("blank.down", "\n\n", 1, "empty"),
    ("word.up", "0\n1\nabc\n", 3, "not an integer"),
    ("float.trace", "0\n1.5\n", 2, "not an integer"),
    ("back.trace", "0\n5\n7\n6\n", 4, "backwards"),
    ("neg.trace", "0\n-3\n", 2, "negative"),
    ("zero.trace", "0\n0\n", 2, "0 ms"),
    ("empty.log", "# only a comment\n", 1, "empty"),
    ("word.log", "0 10\n1 fast\n", 2, "not a number"),
    ("nan.log", "0 10\n1 nan\n", 2, "not a finite"),
    ("back.log", "0 10\n2 20\n1 30\n", 3, "backwards"),
    ("same.log", "0 10\n0 20\n", 2, "repeats"),
    ("negrate.log", "0 10\n\n# gap\n1 -5\n", 4, "negative"),
    ("fields.log", "0 10\n1 2 3\n", 2, "expected"),
    ("empty.csv", "time_s,rate_mbps\n", 1, "empty"),
    ("header.csv", "t,r\n0,1\n", 1, "header"),
    ("cell.csv", "time_s,rate_mbps\n0,1\n1,x\n", 3, "not a number"),
    ("back.csv", "time_s,rate_mbps\n0,1\n2,1\n1,1\n", 4, "backwards"),
    ("cols.csv", "time_s,rate_mbps\n0,1,2\n", 2, "columns"),
])
def test_malformed_inputs_name_file_and_line(tmp_path: Path, name: str, text: str, line: int,
                                             words: str) -> None:
    path = _write(tmp_path, name, text)
    with pytest.raises(TraceError) as err:
        load_trace(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}:{line}:"), msg
    assert words in msg


def test_missing_file_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "nope.trace")


def test_dispatch_by_content_and_extension(tmp_path: Path) -> None:
    mm = _write(tmp_path, "noext", "0\n0\n10\n")
    assert load_trace(mm).period_s == pytest.approx(0.010)
    log = _write(tmp_path, "rates.txt", "# t rate\n0 10\n1.5 20  # comment\n")
    tr = load_trace(log)
    assert tr.times_s == (0.0, 1.5) and tr.rates_mbps == (10.0, 20.0)
    csv = _write(tmp_path, "rates.dat", "time_s,rate_mbps\n0,5\n2,7\n")
    assert load_trace(csv).rates_mbps == (5.0, 7.0)
    assert load_csv(_write(tmp_path, "r.csv", "time_s,rate_mbps\n0,5\n")).rates_mbps == (5.0,)


def test_rate_log_starting_late_keeps_its_times(tmp_path: Path) -> None:
    tr = load_rate_log(_write(tmp_path, "late.log", "2 10\n4 20\n"))
    assert tr.times_s == (0.0, 4.0)
    assert tr.rate_at(3.9) == 10.0 and tr.rate_at(4.0) == 20.0
    assert tr.period_s == pytest.approx(6.0)  # last step lasts one median step


def test_mahimahi_binning_of_a_known_file(tmp_path: Path) -> None:
    # 3 packets in [0, 100) ms, 1 in [100, 200), period 250 ms (last line): 0.05 s tail window.
    path = _write(tmp_path, "k.trace", "0\n10\n99\n150\n250\n")
    tr = load_mahimahi(path, granularity_s=0.1)
    assert tr.period_s == pytest.approx(0.25)
    # The packet at 250 ms is time 0 of the next loop: bin 0 gets 4 packets.
    assert tr.rates_mbps[0] == pytest.approx(4 * 12000 / 0.1 / 1e6)
    assert tr.rate_at(0.15) == pytest.approx(1 * 12000 / 0.1 / 1e6)
    assert tr.rate_at(0.22) == 0.0
    assert tr.bytes_between(0.0, 0.25) == pytest.approx(5 * 1500)


# -- BandwidthTrace ------------------------------------------------------------------------


def _numeric_integral(tr: BandwidthTrace, t0: float, t1: float, n: int = 20000) -> float:
    dt = (t1 - t0) / n
    return sum(tr.rate_at(t0 + (k + 0.5) * dt) for k in range(n)) * dt * 1e6 / 8


def test_bytes_between_matches_integration_of_rate() -> None:
    rng = random.Random(7)
    tr = generate.steps([(0.0, 10.0), (0.3, 50.0), (1.1, 0.0), (1.5, 25.0)], 2.0)
    for _ in range(20):
        t0 = rng.uniform(0.0, 5.0)
        t1 = t0 + rng.uniform(0.0, 6.0)
        exact = tr.bytes_between(t0, t1)
        assert exact == pytest.approx(_numeric_integral(tr, t0, t1), rel=2e-3, abs=50.0)
    # Additivity and looping.
    assert tr.bytes_between(0.0, 3.3) == pytest.approx(tr.bytes_between(0.0, 1.7)
                                                       + tr.bytes_between(1.7, 3.3))
    assert tr.bytes_between(0.0, 6.0) == pytest.approx(3 * tr.bytes_between(0.0, 2.0))
    assert tr.bytes_between(0.0, 2.0) == pytest.approx(tr.mean_mbps() * 1e6 / 8 * 2.0)
    with pytest.raises(ValueError):
        tr.bytes_between(2.0, 1.0)


def test_seconds_to_carry_inverts_bytes_between() -> None:
    rng = random.Random(11)
    # A zero-rate step, and one at the end of the period, so the inverse must skip both.
    tr = generate.steps([(0.0, 10.0), (0.3, 50.0), (1.1, 0.0), (1.5, 25.0), (1.9, 0.0)], 2.0)
    for _ in range(200):
        t0 = rng.uniform(0.0, 7.0)
        n = rng.uniform(1.0, 40_000.0)
        s = tr.seconds_to_carry(t0, n)
        assert tr.bytes_between(t0, t0 + s) == pytest.approx(n, rel=1e-9, abs=1e-6)
        # ... and it is the least such time: a hair earlier carries less.
        assert s == 0.0 or tr.bytes_between(t0, t0 + max(0.0, s - 1e-6)) < n
    # Starting inside the zero-rate step waits for the next step.
    assert tr.seconds_to_carry(1.2, 1.0) == pytest.approx(0.3, abs=1e-6)
    # Spanning several loops: each period carries the mean rate's bytes.
    period_bytes = tr.bytes_between(0.0, 2.0)
    assert tr.seconds_to_carry(0.0, 3 * period_bytes) == pytest.approx(2 * 2.0 + 1.9, abs=1e-6)
    assert tr.bytes_between(0.0, tr.seconds_to_carry(0.0, 3 * period_bytes)) == \
        pytest.approx(3 * period_bytes)
    assert tr.seconds_to_carry(0.5, 0.0) == 0.0
    with pytest.raises(ValueError, match="allows no bytes"):
        generate.steps([(0.0, 0.0)], 1.0).seconds_to_carry(0.0, 1.0)


def test_rate_at_loops_and_steps_merge() -> None:
    tr = generate.steps([(0.0, 100.0), (20.0, 20.0), (40.0, 100.0)], 60.0)
    assert tr.rate_at(19.99) == 100.0 and tr.rate_at(20.0) == 20.0
    assert tr.rate_at(60.0 + 25.0) == 20.0 and tr.rate_at(-1.0) == 100.0
    assert tr.steps(0.1) == [(0.0, 100.0), (20.0, 20.0), (40.0, 100.0)]
    # A window straddling a boundary carries the mean rate, preserving bytes.
    st = generate.steps([(0.0, 10.0), (0.05, 30.0)], 0.2).steps(0.1)
    assert st == [(0.0, pytest.approx(20.0)), (0.1, 30.0)]


def test_invalid_trace_specs() -> None:
    with pytest.raises(TraceError, match="first step"):
        BandwidthTrace((1.0,), (10.0,), 2.0)
    with pytest.raises(TraceError, match="not after"):
        BandwidthTrace((0.0, 2.0, 1.0), (1.0, 2.0, 3.0), 5.0)
    with pytest.raises(TraceError, match="period_s"):
        BandwidthTrace((0.0, 2.0), (1.0, 2.0), 2.0)
    with pytest.raises(TraceError, match="rate_mbps"):
        generate.constant(-1.0, 10.0)


# -- generators and writers ----------------------------------------------------------------


def test_generators() -> None:
    sq = generate.square(10.0, 50.0, 5.0, 60.0)
    assert sq.mean_mbps() == pytest.approx(30.0)
    assert sq.rate_at(2.0) == 50.0 and sq.rate_at(7.0) == 10.0
    a = generate.random_walk(10.0, 2.0, 0.1, 30.0, seed=1, lo_mbps=1.0, hi_mbps=20.0)
    b = generate.random_walk(10.0, 2.0, 0.1, 30.0, seed=1, lo_mbps=1.0, hi_mbps=20.0)
    c = generate.random_walk(10.0, 2.0, 0.1, 30.0, seed=2, lo_mbps=1.0, hi_mbps=20.0)
    assert a == b and a != c
    assert all(1.0 <= r <= 20.0 for r in a.rates_mbps)
    assert 7.0 < a.mean_mbps() < 13.0  # mean reversion keeps it near 10
    assert generate.constant(42.0, 3.0).mean_mbps() == 42.0


def test_mahimahi_round_trip(tmp_path: Path) -> None:
    tr = generate.steps([(0.0, 30.0), (1.0, 6.0), (2.5, 60.0)], 4.0)
    path = tmp_path / "rt.trace"
    generate.write_mahimahi(tr, path)
    back = load_mahimahi(path, granularity_s=0.5)
    assert back.period_s == pytest.approx(4.0)
    assert back.mean_mbps() == pytest.approx(tr.mean_mbps(), rel=1e-3)
    for t in (0.25, 1.25, 2.25, 3.25):
        # One 1500-byte packet of quantisation per window at most, plus the wrapped last one.
        assert abs(back.rate_at(t) - tr.rate_at(t)) <= 2 * 12000 / 0.5 / 1e6 + 1e-9


def test_rate_log_round_trip(tmp_path: Path) -> None:
    tr = generate.random_walk(20.0, 3.0, 0.25, 10.0, seed=3)
    path = tmp_path / "rt.log"
    generate.write_rate_log(tr, path)
    back = load_rate_log(path)
    assert (back.times_s, back.rates_mbps, back.period_s) == (tr.times_s, tr.rates_mbps,
                                                               tr.period_s)
    assert not list(tmp_path.glob(".rt.log.*"))  # the atomic write left no temp file


def test_shipped_traces_match_the_generator(tmp_path: Path) -> None:
    assert generate.main(["--out", str(tmp_path)]) == 0
    shipped = sorted(p.name for p in REPO_DATA.iterdir())
    assert shipped == sorted(p.name for p in tmp_path.iterdir())
    for name in shipped:
        assert (REPO_DATA / name).read_bytes() == (tmp_path / name).read_bytes(), name
    step = load_trace(REPO_DATA / "step_100_20_100.log")
    assert step.rates_mbps == (100.0, 20.0, 100.0) and step.period_s == 60.0
    assert load_trace(REPO_DATA / "step_100_20_100.trace").mean_mbps() == pytest.approx(
        step.mean_mbps(), rel=1e-4)


# -- replayer ------------------------------------------------------------------------------


class FakeClock:
    def __init__(self, ns: int) -> None:
        self.ns = ns

    def advance(self, s: float) -> int:
        self.ns += round(s * 1e9)
        return self.ns


def test_replayer_with_fake_clock() -> None:
    tr = generate.steps([(0.0, 100.0), (20.0, 20.0), (40.0, 100.0)], 60.0)
    clock = FakeClock(5_000)
    rp = TraceReplayer(tr, start_ns=clock.ns)
    first = rp.due(clock.ns)
    assert [(c.t_ns, c.rate_mbps, c.index) for c in first] == [(5_000, 100.0, 0)]
    assert rp.due(clock.ns) == []
    assert rp.next_deadline_ns() == 5_000 + 20_000_000_000
    assert rp.due(clock.advance(19.999)) == []
    [c] = rp.due(clock.advance(0.001))
    assert (c.rate_mbps, c.index, c.loop, c.t_ns) == (20.0, 1, 0, 5_000 + 20_000_000_000)
    # The wrap from 100 back to 100 is not a change: next is the 20 at 80 s.
    rp.due(clock.advance(20.0))
    assert rp.next_deadline_ns() == 5_000 + 80_000_000_000
    late = rp.due(clock.advance(100.0))  # now at 140 s: a caller that slept gets every change
    assert [(c.rate_mbps, c.loop) for c in late] == [(20.0, 1), (100.0, 1), (20.0, 2)]
    assert rp.rate_at_ns(clock.ns) == 20.0


def test_replayer_applied_rates_deliver_the_trace_bytes() -> None:
    # Integrating the replayed step function over time gives the trace's own byte count.
    tr = generate.random_walk(10.0, 2.0, 0.05, 3.0, seed=5)
    rp = TraceReplayer(tr, granularity_s=0.1, start_ns=0)
    t_ns, rate, total = 0, 0.0, 0.0
    for now in range(0, 6_000_000_001, 10_000_000):  # poll every 10 ms for two loops
        for ch in rp.due(now):
            total += rate * 1e6 / 8 * (ch.t_ns - t_ns) / 1e9
            t_ns, rate = ch.t_ns, ch.rate_mbps
    total += rate * 1e6 / 8 * (6_000_000_000 - t_ns) / 1e9
    assert total == pytest.approx(tr.bytes_between(0.0, 6.0), rel=1e-9)


def test_replayer_constant_trace_sets_rate_once() -> None:
    rp = TraceReplayer(generate.constant(50.0, 1.0), start_ns=0)
    assert [c.rate_mbps for c in rp.due(0)] == [50.0]
    assert rp.due(10**12) == [] and rp.next_deadline_ns() is None


# -- gradient profiles ---------------------------------------------------------------------


def test_resnet50_profile() -> None:
    prof = load_profile(shared("gradients/Resnet50_DataParallel.txt"))
    assert prof.parallelism == "DATA" and len(prof.layers) == 54
    assert prof.total_comm_bytes() == 102_011_648
    sizes = load_gradient_sizes(shared("gradients/Resnet50_DataParallel.txt"))
    assert sizes[0] == ("conv1", 37632, 13003 + 12864 + 32291)
    assert sum(s for _, s, _ in sizes) == 102_011_648


@pytest.mark.parametrize("text, line, words", [
    ("", 1, "empty"),
    ("DATA\n", 2, "layer-count"),
    ("BOGUS\n1\n", 1, "parallelism"),
    ("DATA\nx\n", 2, "not an integer"),
    ("DATA\n1\nl -1 1 NONE 0 1 NONE 0 1 ALLREDUCE 8\n", 3, "12 fields"),
    ("DATA\n1\nl -1 1 NONE 0 1 NONE 0 1 ALLSEND 8 1\n", 3, "comm type"),
    ("DATA\n1\nl -1 1 NONE 0 1 NONE 0 1 ALLREDUCE -8 1\n", 3, "negative"),
    ("DATA\n2\nl -1 1 NONE 0 1 NONE 0 1 ALLREDUCE 8 1\n", 2, "declares 2"),
])
def test_malformed_profiles(tmp_path: Path, text: str, line: int, words: str) -> None:
    path = _write(tmp_path, "w.txt", text)
    with pytest.raises(TraceError) as err:
        load_profile(path)
    assert str(err.value).startswith(f"{path}:{line}:") and words in str(err.value)



@pytest.mark.parametrize("field", ["up", "down"])
def test_gradbed_run_names_a_bad_trace_before_building_anything(
        tmp_path: Path, field: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`gradbed run` loads the config's traces first: a malformed one is an error naming
    the config, the field, the file and the line, and no run directory is made (the same
    check runs with --dry-run)."""
    from controller import cli

    bad = tmp_path / "bad.log"
    bad.write_text("0 5\n1 abc\n")
    repo = Path(__file__).resolve().parents[2]
    config = repo / "configs" / "test_tiny.toml"
    for extra in (["--dry-run"], []):
        rc = cli.main(["run", str(config), "--out", str(tmp_path / "runs"),
                       "--set", f'trace.{field}="{bad}"', *extra])
        assert rc == 2
        err = capsys.readouterr().err
        assert f"test_tiny.toml: trace.{field}: {bad}:2: rate_mbps 'abc' is not a number" in err
    missing = tmp_path / "missing.log"
    assert cli.main(["run", str(config), "--dry-run", "--set",
                     f'trace.{field}="{missing}"']) == 2
    assert f"{missing}: cannot read" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


# -- big inputs (a 200 MB trace read whole took 4.4 GB and 37 s) -------------------


def test_a_big_rate_log_streams_in_bounded_time_and_memory(tmp_path):
    import time
    import tracemalloc

    path = tmp_path / "big.log"
    n = 50_000
    with open(path, "w") as f:  # 50k lines (0.84 MB), the rate changing every 100 ms
        f.writelines(f"{i / 1000:.3f} {10 + (i // 100) % 7}.000000\n" for i in range(n))
    t0 = time.monotonic()
    load_rate_log(path)
    took_s = time.monotonic() - t0
    tracemalloc.start()
    tr = load_rate_log(path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(tr.times_s) == n // 100 and tr.period_s == pytest.approx(50.0)
    out_bytes = len(tr.times_s) * 2 * 32  # two tuples of floats: pointer + float object
    bound = 4 * out_bytes + 200_000  # 0.33 MB; the loader peaks at 0.04 MB
    # Holding the file's text (or a line list, ~4 MB) could not stay under the bound.
    assert path.stat().st_size > 2 * bound
    assert peak < bound, (peak, out_bytes)
    assert took_s < 5, took_s  # 0.15 s idle, 0.7 s at load average 10 on 2 cores


def test_a_big_mahimahi_trace_streams_in_bounded_memory(tmp_path):
    import tracemalloc

    path = tmp_path / "big.down"
    with open(path, "w") as f:  # 120k opportunities: 12 per ms for 10 s, 144 Mbit/s
        for ms in range(1, 10_001):
            f.write(f"{ms}\n" * 12)
    tracemalloc.start()
    tr = load_mahimahi(path, granularity_s=0.1)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert tr.mean_mbps() == pytest.approx(144.0)
    # 100 windows, not 120k timestamps (4 MB as a list) nor the file's 0.59 MB of text:
    # the loader peaks at 0.02 MB.
    bound = 250_000
    assert path.stat().st_size > 2 * bound
    assert peak < bound, peak


@pytest.mark.parametrize("name,text,line", [
    ("fast.log", "0 100\n1 4800000\n2 100\n", 2),
    ("fast.csv", "time_s,rate_mbps\n0 ,100\n1,20000\n", 3),
    ("fast.down", "1\n" + "2\n" * 100_000 + "1000\n", 100_001),  # 12 Gbit/s in 0-0.1 s
])
def test_a_rate_above_the_shapers_maximum_names_its_line(tmp_path, name, text, line):
    from topo.spec import RATE_MAX_MBPS

    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceError, match=rf"^{path}:{line}: .*above the shaper's maximum "
                                         rf"of 10000 Mbit/s"):
        load_trace(path, max_rate_mbps=RATE_MAX_MBPS)
    load_trace(path)  # without a maximum it loads (the trace itself is well formed)
