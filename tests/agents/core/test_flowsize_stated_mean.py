"""Flow-size files whose first line states their mean (Homa's layout,
agents/core/flowsize.py): the loader reads the points with the interpolation that
reproduces the stated mean within 0.5 %, and warns, naming both means, when none does.

The real CDFs under ../shared/traces/flowsize (HPCC's web-search and Hadoop files) carry
no mean line, so the Homa-layout files here are those real points with the mean that each
reading gives written on top, plus small made-up files for the warning branch."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import pytest

from agents.core.flowsize import MEAN_TOLERANCE, FlowSizeMeanWarning, load_flow_cdf

REPO = Path(__file__).resolve().parents[3]
SHARED = Path(os.environ.get("GRADBED_SHARED_TRACES",
                             REPO.parent / "shared" / "traces")) / "flowsize"
needs_shared = pytest.mark.skipif(
    not SHARED.exists(), reason=f"{SHARED} is absent (real traces live beside the repo; "
                                f"GRADBED_SHARED_TRACES names another place)")

#: Two points, half the flows at 1,000 bytes and half up to 3,000: read linearly the mean
#: is 0.5 * 500 + 0.5 * 2,000 = 1,250 bytes; read as steps 0.5 * 1,000 + 0.5 * 3,000 = 2,000.
POINTS = "0 0\n1000 50\n3000 100\n"


def _load_quietly(path: Path, **kw: object) -> tuple[object, list[str]]:
    said: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlowSizeMeanWarning)  # a warning here fails the test
        cdf = load_flow_cdf(path, log=said.append, **kw)  # type: ignore[arg-type]
    return cdf, said


@pytest.mark.parametrize("stated,reading", [(1250, "linear"), (2000, "step"),
                                            (1255, "linear"), (1991, "step")])
def test_the_reading_that_reproduces_the_stated_mean_is_chosen(tmp_path, stated, reading):
    path = tmp_path / "homa.txt"
    path.write_text(f"{stated}\n{POINTS}")
    cdf, said = _load_quietly(path)
    assert cdf.interpolation == reading
    assert cdf.mean_bytes() == pytest.approx(stated, rel=MEAN_TOLERANCE)
    assert any(f"states a mean of {stated:,} bytes; read {reading}" in m for m in said), said


def test_no_reading_reproduces_it_warns_with_both_means(tmp_path):
    path = tmp_path / "homa.txt"
    path.write_text(f"# a comment line first\n1600\n{POINTS}")
    with pytest.warns(FlowSizeMeanWarning) as caught:
        cdf = load_flow_cdf(path)
    text = str(caught[0].message)
    # 1,250 (linear) is 21.9 % off, 2,000 (step) 25 %: the closer one is used.
    assert cdf.interpolation == "linear"
    assert f"{path}:2: the file states a mean of 1,600 bytes" in text
    assert "linear 1,250 bytes, step 2,000 bytes" in text
    assert "using linear, mean 1,250 bytes (21.9% off)" in text


def test_an_interpolation_asked_for_is_kept_and_warned_about(tmp_path):
    path = tmp_path / "homa.txt"
    path.write_text(f"1250\n{POINTS}")
    with pytest.warns(FlowSizeMeanWarning, match=re.escape("step 2,000 bytes")):
        cdf = load_flow_cdf(path, interpolation="step")
    assert cdf.interpolation == "step"
    cdf, _ = _load_quietly(path, interpolation="linear")
    assert cdf.interpolation == "linear"


def test_a_mean_in_packets_is_compared_in_packets(tmp_path):
    path = tmp_path / "homa_pkts.txt"
    path.write_text("2.25\n1 0\n2 50\n4 100\n")  # linear: 0.5 * 1.5 + 0.5 * 3; step: 3
    cdf, said = _load_quietly(path, packet_bytes=1000, interpolation=None)
    assert cdf.interpolation == "linear" and cdf.mean_bytes() == pytest.approx(2250)
    path.write_text("3\n1 0\n2 50\n4 100\n")
    cdf, said = _load_quietly(path, packet_bytes=1000)
    assert cdf.interpolation == "step" and cdf.mean_bytes() == pytest.approx(3000)
    assert "3,000 bytes (in packets on the line)" in said[0]


@needs_shared
@pytest.mark.parametrize("name", ["WebSearch_distribution.txt", "FbHdp_distribution.txt"])
def test_real_cdfs_with_their_mean_on_top_are_read_as_stated(tmp_path, name):
    points = (SHARED / name).read_text()
    means = {r: load_flow_cdf(SHARED / name, interpolation=r).mean_bytes()
             for r in ("linear", "step")}
    # The two readings of a published CDF differ by more than the tolerance, so the stated
    # mean decides between them.
    assert abs(means["step"] / means["linear"] - 1) > 2 * MEAN_TOLERANCE
    for reading, mean in means.items():
        path = tmp_path / f"{reading}_{name}"
        path.write_text(f"{mean:.0f}\n{points}")
        cdf, _ = _load_quietly(path)
        assert cdf.interpolation == reading
        assert cdf.mean_bytes() == pytest.approx(mean, rel=1e-6)
    # A mean halfway between the two is reproduced by neither.
    path = tmp_path / f"between_{name}"
    path.write_text(f"{(means['linear'] + means['step']) / 2:.0f}\n{points}")
    with pytest.warns(FlowSizeMeanWarning, match=r"no reading reproduces it"):
        load_flow_cdf(path)


def test_gradbed_run_prints_the_warning_before_building_anything(tmp_path, capsys):
    from controller import cli

    path = tmp_path / "homa.cdf"
    path.write_text(f"1600\n{POINTS}")
    rc = cli.main(["run", str(REPO / "configs" / "test_tiny.toml"), "--dry-run",
                   "--set", "net.background_hosts=1", "--set", 'background.kind="flows"',
                   "--set", "background.load_mbps=5", "--set", f'background.flow_cdf="{path}"'])
    err = capsys.readouterr().err
    assert rc == 0
    assert f"background.flow_cdf: warning: {path}:1: the file states a mean of 1,600" in err
