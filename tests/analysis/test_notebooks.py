"""The analysis notebooks execute cell by cell in a real Jupyter kernel (nbclient) on a run,
and are committed without outputs."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.support import real_run
from tests.support.make_fake_run import make_fake_run

NB_DIR = Path(__file__).resolve().parents[2] / "analysis" / "notebooks"
NOTEBOOKS = ("throughput.ipynb", "compare.ipynb")


def execute(name: str) -> nbformat.NotebookNode:
    """Run every cell of the notebook in a fresh python3 kernel; a failing cell raises
    ``CellExecutionError`` naming the cell. The kernelspec's ``python`` resolves to this
    interpreter (the venv), so the kernel imports the same ``analysis``."""
    nb = nbformat.read(NB_DIR / name, as_version=4)
    client = NotebookClient(nb, kernel_name="python3", timeout=180,
                            resources={"metadata": {"path": str(NB_DIR)}})
    client.execute()
    return nb


def _images(nb: nbformat.NotebookNode) -> int:
    """How many outputs carry a rendered PNG (a figure shown inline, as display_data or
    as the execute_result of a cell ending in a Figure)."""
    return sum(1 for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
               if "image/png" in o.get("data", {}))


def _outputs(nb: nbformat.NotebookNode) -> list[str]:
    return [o.get("output_type", "") for c in nb.cells if c.cell_type == "code"
            for o in c.get("outputs", [])]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebooks_are_committed_without_outputs(name: str) -> None:
    nb = nbformat.read(NB_DIR / name, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
    # They only call the analysis package.
    imports = [ln for c in code for ln in c.source.splitlines()
               if ln.startswith(("import ", "from "))]
    assert all(ln.startswith(("from analysis", "import os")) for ln in imports), imports


@pytest.fixture(scope="session")
def real_run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return real_run.real_run(tmp_path_factory.mktemp("real"))


@pytest.mark.mininet
def test_notebooks_execute_on_a_real_run(real_run_dir: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADBED_RUN", str(real_run_dir))
    monkeypatch.setenv("GRADBED_RUNS", str(real_run_dir))
    for name in NOTEBOOKS:
        nb = execute(name)
        assert _images(nb) >= 2, f"{name} drew fewer than two figures: {_outputs(nb)}"


@pytest.mark.slow
def test_notebooks_execute_on_a_synthetic_sweep(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    make_fake_run(tmp_path / "sweep" / "topk", compressor="topk", seed=1)
    make_fake_run(tmp_path / "sweep" / "dense", compressor="none", adaptive=False, seed=2)
    make_fake_run(tmp_path / "sweep" / "topk-50", compressor="topk", rate_mbps=50.0, seed=3)
    monkeypatch.setenv("GRADBED_RUN", str(tmp_path / "sweep" / "topk"))
    monkeypatch.setenv("GRADBED_RUNS", str(tmp_path / "sweep" / "*"))
    for name in NOTEBOOKS:
        nb = execute(name)
        outs = _outputs(nb)
        assert "error" not in outs
        assert "display_data" in outs, f"{name} drew no figure"


def test_a_failing_cell_fails_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor is not lenient: a notebook pointed at a missing run fails in its
    first code cell with the loader's error."""
    from nbclient.exceptions import CellExecutionError

    monkeypatch.setenv("GRADBED_RUN", str(tmp_path / "no-such-run"))
    with pytest.raises(CellExecutionError, match="RunLoadError"):
        execute("throughput.ipynb")
