"""The import arrows of docs/architecture.md hold: the import-linter contracts in ``.importlinter`` pass
on the code as it is, and fail as soon as one forbidden import is added."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("gradbed", "agents", "controller", "topo", "traces", "analysis")
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    """Run this venv's ``lint-imports`` on the tree at ``root`` (its packages first on the
    path, so a copy is analysed, not the installed checkout)."""
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} missing: import-linter is a dev dependency "
                    "(pip install -e '.[dev]')")
    return subprocess.run([str(LINT_IMPORTS), "--config", str(root / ".importlinter")],
                          cwd=root, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=120)


def copy_tree(dst: Path) -> Path:
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, dst / pkg,
                        ignore=shutil.ignore_patterns("__pycache__", "*.ipynb", "data"))
    shutil.copy(REPO / ".importlinter", dst / ".importlinter")
    return dst


def test_contracts_hold() -> None:
    done = lint(REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.mark.parametrize(("module", "line", "contract"), [
    # An agent reaching up into the controller: the layers contract.
    ("agents/dp/worker.py", "from controller import driver", "The controller is on top"),
    # The core importing the torch side of agents.
    ("agents/core/config.py", "import agents.compress", "The core (agents.core)"),
    # One role wing using another's internals: the pipeline reaching into the DP wing.
    ("agents/pipeline/stage.py", "from agents.dp import aggregate",
     "No role wing imports another"),
    # A shared wing reaching up into a role wing.
    ("agents/net/wire.py", "from agents.moe import mesh", "role wings sit on the shared"),
    # A function-level (lazy) import counts as much as a top-level one.
    ("analysis/metrics.py", "def f():\n    from agents.workloads import base",
     "import only the core of agents"),
])
def test_a_forbidden_import_breaks_the_contracts(tmp_path: Path, module: str, line: str,
                                                 contract: str) -> None:
    root = copy_tree(tmp_path)
    assert lint(root).returncode == 0  # the copy is as clean as the checkout
    with open(root / module, "a", encoding="utf-8") as fh:
        fh.write(f"\n{line}\n")
    done = lint(root)
    assert done.returncode != 0, done.stdout
    assert contract in broken_section(done.stdout), done.stdout


def broken_section(report: str) -> str:
    """The part of lint-imports' report that names the broken contracts."""
    head, sep, tail = report.partition("Broken contracts")
    return tail if sep else ""


def test_an_import_cycle_between_siblings_breaks_the_contracts(tmp_path: Path) -> None:
    root = copy_tree(tmp_path)
    # agents.core.registry is imported by agents.core.config; the reverse closes a cycle.
    with open(root / "agents/core/registry.py", "a", encoding="utf-8") as fh:
        fh.write("\nfrom agents.core import config  # noqa\n")
    done = lint(root)
    assert done.returncode != 0
    assert "No import cycles" in broken_section(done.stdout), done.stdout
