"""controller.runlog: where each line of a run goes. A status line into run.log (with the
time) and on the terminal; an echoed command (``$ ...``) into run.log and the controller's
events, never on the terminal; a line for run.log only neither on the terminal nor in the
events; nothing on a terminal that hung up; nothing written after close. Unit (no root)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agents.core.events import EventLog, read_jsonl
from controller.runlog import RunLog


def _opened(tmp_path: Path, show: bool, hung_up: list[bool]) -> tuple[RunLog, EventLog]:
    log = RunLog(show, lambda: hung_up[0])
    events = EventLog.for_node(tmp_path, "r", "controller")
    log.open(tmp_path / "run.log", events)
    return log, events


def test_each_line_goes_where_its_kind_belongs(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    log, events = _opened(tmp_path, show=True, hung_up=[False])
    log.say("building the network")
    log.say("$ tc qdisc add dev x root handle 1: htb")
    log.note("$ A=1 torchrun x.py  # in w0")
    log.close()
    events.close()
    log.say("after close")  # the terminal only
    lines = (tmp_path / "run.log").read_text().splitlines()
    assert [re.sub(r"^\d\d:\d\d:\d\d ", "", ln) for ln in lines] == [
        "building the network", "$ tc qdisc add dev x root handle 1: htb",
        "$ A=1 torchrun x.py  # in w0"]
    assert all(re.match(r"^\d\d:\d\d:\d\d ", ln) for ln in lines)
    cmds = [e["cmd"] for e in read_jsonl(tmp_path / "events" / "controller.jsonl")
            if e["event"] == "tc"]
    assert cmds == ["tc qdisc add dev x root handle 1: htb"]
    assert capsys.readouterr().err.splitlines() == ["building the network", "after close"]


def test_a_hung_up_or_quiet_terminal_gets_nothing_and_run_log_everything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hung_up = [False]
    log, events = _opened(tmp_path, show=True, hung_up=hung_up)
    hung_up[0] = True
    log.say("after SIGHUP")
    log.close()
    events.close()
    quiet = RunLog(False, lambda: False)
    quiet.say("quiet run")
    assert capsys.readouterr().err == ""
    assert (tmp_path / "run.log").read_text().endswith(" after SIGHUP\n")
