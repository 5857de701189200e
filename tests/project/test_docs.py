"""The README is a front door and docs/ holds the rest: a short README
with no section named after an issue, a docs/ index naming every document, links that
resolve, and benchmark figures that say when and on what machine they were taken."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))


def test_the_readme_is_short_and_names_no_issue_or_history() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    headings = [ln for ln in text.splitlines() if ln.startswith("#")]
    for doc in [README, *DOCS]:
        for ln in doc.read_text().splitlines():
            if ln.startswith("#"):
                assert not re.search(r"\bissue\s*\d", ln, re.I), (doc.name, ln)
                assert not re.search(r"\bsession\b|\bchangelog\b|\bhistory\b", ln, re.I), ln
    for needed in ("bash scripts/demo.sh", "bash scripts/test.sh", "stop_reason",
                   "| section | what it sets |"):
        assert needed in text, needed
    assert any("docs/" in h for h in headings)


def test_the_docs_index_names_every_document_and_every_link_resolves() -> None:
    text = README.read_text()
    assert DOCS, "docs/ is empty"
    for doc in DOCS:
        assert f"(docs/{doc.name})" in text, f"README's docs/ index lacks {doc.name}"
    for doc in [README, *DOCS]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.name}: broken link {target}"


def test_benchmarks_are_one_table_with_a_dated_row_per_benchmark() -> None:
    text = (REPO / "docs" / "benchmarks.md").read_text()
    assert "2 vCPUs" in text and "no GPU" in text
    assert '{"name": ' not in text, "JSON lines belong in git's history, not in the table"
    rows = [ln for ln in text.splitlines() if ln.startswith("|")]
    head = [c.strip() for c in rows[0].strip("|").split("|")]
    assert head == ["benchmark", "what it measures", "target", "latest figure", "date",
                    "machine and load"]
    assert sum(ln.startswith("#") for ln in text.splitlines()) == 1, "one table, no sections"
    named = []
    for row in rows[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]
        assert len(cells) == len(head), row
        assert all(cells), f"empty cell in {row}"
        assert re.fullmatch(r"20\d\d-\d\d-\d\d\b.*", cells[4]), f"no date: {row}"
        assert re.search(r"load|quiet|shared", cells[5]), f"no load: {row}"
        named.append(cells[0].strip("`"))
    assert len(named) == len(set(named)), "one row per benchmark"
    shipped = {p.stem for p in (REPO / "benchmarks").glob("*.py") if not p.stem.startswith("_")}
    assert set(named) == shipped, (set(named) ^ shipped)
