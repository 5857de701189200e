"""The event schema is code (agents/core/events.py): every event the project emits is
declared with its fields, and an undeclared one fails."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from agents.core import events
from agents.core.events import EVENTS, EventLog, UndeclaredEvent, check
from tests.support.make_fake_run import make_fake_run

REPO = Path(__file__).resolve().parents[3]
SOURCES = ("agents", "controller", "topo", "traces", "analysis", "gradbed")


def emit_calls() -> list[tuple[str, int, str, list[str]]]:
    """``(file, line, event, [field, ...])`` of every ``X.emit("literal", ...)`` call."""
    found = []
    for pkg in SOURCES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "emit" and node.args):
                    fields = [k.arg for k in node.keywords if k.arg not in (None, "iter")]
                    for event in literal_names(node.args[0]):
                        found.append((str(path.relative_to(REPO)), node.lineno, event, fields))
    return found


def literal_names(expr: ast.expr) -> list[str]:
    """The event names an emit's first argument can take: a string literal, or either
    branch of ``"a" if cond else "b"``."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return [expr.value]
    if isinstance(expr, ast.IfExp):
        return literal_names(expr.body) + literal_names(expr.orelse)
    return []


def test_the_environment_is_strict_in_tests() -> None:
    assert events.strict_default()


def test_every_emit_in_the_source_is_declared() -> None:
    calls = emit_calls()
    assert len(calls) >= 40, calls  # the scan found the emit calls at all
    for where, line, event, fields in calls:
        try:
            check(event, dict.fromkeys(fields))
        except UndeclaredEvent as e:
            pytest.fail(f"{where}:{line}: {e}")


def test_every_declared_event_is_emitted_somewhere() -> None:
    # eval and final_eval carry a workload's evaluate() dict (**metrics), still by name.
    emitted = {event for _, _, event, _ in emit_calls()}
    assert set(EVENTS) - emitted == set(), "declared but never emitted"


def test_every_event_has_a_meaning_and_every_field_a_description() -> None:
    assert len(EVENTS) >= 35
    for et in EVENTS.values():
        assert et.meaning and et.by, et
        assert all(isinstance(v, str) and v for v in et.fields.values()), et


def test_an_undeclared_event_or_field_fails_in_strict_mode(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "w0.jsonl", "run", "w0", strict=True)
    log.emit("iter_done", iter=3, iter_s=0.5, bytes_up=10)
    with pytest.raises(UndeclaredEvent, match="'iter_finished' is not declared"):
        log.emit("iter_finished", iter=3)
    with pytest.raises(UndeclaredEvent, match="undeclared field.*iter_ms"):
        log.emit("iter_done", iter=3, iter_ms=500)
    log.close()
    rows = [json.loads(x) for x in (tmp_path / "w0.jsonl").read_text().splitlines()]
    assert [r["event"] for r in rows] == ["iter_done"]  # nothing undeclared was written


def test_outside_tests_an_undeclared_event_is_written_with_one_warning(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = EventLog(tmp_path / "w0.jsonl", "run", "w0", strict=False)
    log.emit("iter_finished", iter=3)
    log.emit("iter_finished", iter=4)
    log.close()
    assert capsys.readouterr().err.count("iter_finished") == 1
    assert len((tmp_path / "w0.jsonl").read_text().splitlines()) == 2


def test_the_fake_run_fixture_follows_the_schema(tmp_path: Path) -> None:
    run = make_fake_run(tmp_path / "fake", jsonl_only=True)
    n = 0
    for path in (run / "events").glob("*.jsonl"):
        for row in map(json.loads, path.read_text().splitlines()):
            fields = {k: v for k, v in row.items() if k not in events.COMMON_COLUMNS}
            check(row["event"], fields)
            n += 1
    assert n > 100


def test_the_schema_tells_how_to_declare_an_event() -> None:
    doc = events.__doc__ or ""
    assert "Declaring a new event type" in doc and "_declare(" in doc
