"""The README's demo section tells the truth: the config it quotes is configs/demo.toml's,
the command is the one scripts/demo.sh runs, and the output it shows has the rows the
sweep prints (summary.json's own keys) with a verdict that agrees with its numbers."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from analysis.metrics import GLOSSARY
from controller.verdict import ROWS, verdict
from tests.support.readme_demo import blocks, output
from tests.support.readme_demo import section as demo_section

REPO = Path(__file__).resolve().parents[2]
DEMO = tomllib.loads((REPO / "configs" / "demo.toml").read_text())
DEMO_SH = (REPO / "scripts" / "demo.sh").read_text()


def test_the_quoted_config_is_demo_toml() -> None:
    (quoted,) = blocks("toml")
    data = tomllib.loads(quoted)
    for section, table in data.items():
        for key, value in table.items():
            assert DEMO.get(section, {}).get(key) == value, \
                f"README quotes {section}.{key} = {value!r}; configs/demo.toml has " \
                f"{DEMO.get(section, {}).get(key)!r}"
    for needed in ("run.iterations", "net.bottleneck_mbps", "workload.name",
                   "compress.ratio", "compress.error_feedback"):
        section, key = needed.split(".")
        assert key in data.get(section, {}), f"README's demo config should show {needed}"


def test_the_quoted_command_is_what_demo_sh_runs() -> None:
    run = re.search(r"gradbed (sweep configs/demo\.toml[^\"\n]*?)(?: \"\$@\")?\n", DEMO_SH)
    assert run, "scripts/demo.sh runs no demo sweep"
    assert f"gradbed {run.group(1).strip()}" in demo_section()


def test_the_quoted_output_has_the_rows_the_sweep_prints() -> None:
    labels, rows, _ = output()
    grid = re.search(r"--grid compress\.name=([\w,]+)", DEMO_SH)
    assert grid and labels == grid.group(1).split(",")
    assert list(rows) == [k for k, _, _ in ROWS], "README's rows drifted from the sweep's"
    assert set(rows) <= set(GLOSSARY), "a row is not a summary.json key"


def test_the_quoted_verdict_agrees_with_the_quoted_numbers() -> None:
    labels, rows, line = output()

    def summary(col: int) -> dict[str, float]:
        return {k: float(rows[k][col]) for k in ("iter_time_s_p50", "final_accuracy",
                                                 "bottleneck_utilization")}

    dense, topk = summary(0), summary(1)
    expected = verdict(dense, topk, labels[1])
    # The table is rounded to 3 places, the verdict is computed from the unrounded
    # summaries: the words must match, the figures within rounding.
    assert expected.split(":")[1] == line.split(":")[1]
    got = re.search(r"took ([\d.]+)x dense's and it ended ([\d.]+) points (above|below)", line)
    want = re.search(r"took ([\d.]+)x dense's and it ended ([\d.]+) points (above|below)",
                     expected)
    assert got and want
    assert float(got.group(1)) == pytest.approx(float(want.group(1)), abs=0.02)
    assert float(got.group(2)) == pytest.approx(float(want.group(2)), abs=0.15)
    assert got.group(3) == want.group(3) or float(got.group(2)) < 0.15
