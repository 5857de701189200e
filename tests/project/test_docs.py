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
    for needed in ("bash scripts/demo.sh", "bash scripts/test.sh", '"stop_reason"',
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


def test_benchmark_figures_are_dated_with_the_machine() -> None:
    text = (REPO / "docs" / "benchmarks.md").read_text()
    assert re.search(r"Measured 20\d\d-\d\d-\d\d", text)
    assert "2 vCPUs" in text and "no GPU" in text
