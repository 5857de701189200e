"""The README's demo section, parsed: its code blocks and the output it quotes (the
README's tests and the demo's real run both read it)."""

from __future__ import annotations

import re
from pathlib import Path

from analysis.metrics import GLOSSARY
from controller.verdict import ROWS

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def section() -> str:
    """The README's demo section, from its heading to the next."""
    start = README.index("\n## The demo")
    end = README.index("\n## ", start + 1)
    return README[start:end]


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", section(), re.S)


def output() -> tuple[list[str], dict[str, list[str]], str]:
    """The quoted output: the runs' labels, each row's figures by key, the verdict line."""
    (out,) = blocks("text")
    lines = out.splitlines()
    keys = {k for k, _, _ in ROWS}
    head = next(i for i, ln in enumerate(lines) if ln.split() and ln.split()[0] == "none")
    rows = {ln.split()[0]: ln.split()[1:] for ln in lines[head + 1:]
            if ln.split() and ln.split()[0] in keys | set(GLOSSARY)}
    (line,) = [ln for ln in lines if ln.startswith("verdict:")]
    return lines[head].split(), rows, line


def readme_rows() -> list[str]:
    """The summary keys the README's quoted demo output shows, in order."""
    return list(output()[1])
