"""The size limits of every package (docs/architecture.md, "Size limits"): no class reaches
400 lines and no function's body runs past 60 lines (its docstring not counted), except the
few named below with the reason each is better read whole. A class or function that grows
past them fails here, whichever change adds the lines. tests/ and benchmarks/ are not
measured: a test reads best as the one scenario it checks."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLASS_LINES_MAX = 399
FUNCTION_BODY_LINES_MAX = 60
# The packages measured: all of gradbed's code.
PACKAGES = ("agents", "controller", "topo", "analysis", "traces", "gradbed")

# qualified name -> why it stays one class
LONG_CLASSES: dict[str, str] = {}

# qualified name -> why it stays one function
LONG_FUNCTIONS = {
    "agents/moe/hosts.py:MeshRunner.__call__":
        "one MoE layer's exchanges in the order they happen on the wire (counts, "
        "dispatch, dispatch done, the experts, combine); each step reads the counts "
        "the ones before it agreed on",
}


def _sizes(path: Path) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(class name, lines) and (qualified function name, body lines without docstring)."""
    classes: list[tuple[str, int]] = []
    functions: list[tuple[str, int]] = []
    rel = path.relative_to(REPO).as_posix()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                assert child.end_lineno is not None
                classes.append((f"{rel}:{prefix}{child.name}",
                                child.end_lineno - child.lineno + 1))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = child.body
                if (body and isinstance(body[0], ast.Expr)
                        and isinstance(body[0].value, ast.Constant)
                        and isinstance(body[0].value.value, str) and len(body) > 1):
                    body = body[1:]
                assert body[-1].end_lineno is not None
                functions.append((f"{rel}:{prefix}{child.name}",
                                  body[-1].end_lineno - body[0].lineno + 1))
                visit(child, f"{prefix}{child.name}.")
    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return classes, functions


def _all_sizes() -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    classes: list[tuple[str, int]] = []
    functions: list[tuple[str, int]] = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            c, f = _sizes(path)
            classes += c
            functions += f
    return classes, functions


def _over(sizes: list[tuple[str, int]], limit: int, named: dict[str, str]
          ) -> tuple[list[str], list[str]]:
    """(what runs past ``limit`` unnamed, what is named but no longer past it)."""
    found = dict(sizes)
    too_long = [f"{name}: {n} lines" for name, n in sizes if n > limit and name not in named]
    stale = [name for name in named if found.get(name, 0) <= limit]
    return too_long, stale


def test_the_walk_covers_every_package():
    classes, _ = _all_sizes()
    for package in PACKAGES:
        found = [name for name, _ in classes if name.startswith(f"{package}/")]
        assert found, f"the walk found no class in {package}/: is it there?"


def test_no_class_reaches_400_lines_but_the_named_ones():
    classes, _ = _all_sizes()
    too_long, stale = _over(classes, CLASS_LINES_MAX, LONG_CLASSES)
    assert not too_long, too_long
    assert not stale, f"named as long but now within the limit (drop them): {stale}"


def test_no_function_runs_past_60_lines_but_the_named_ones():
    _, functions = _all_sizes()
    too_long, stale = _over(functions, FUNCTION_BODY_LINES_MAX, LONG_FUNCTIONS)
    assert not too_long, too_long
    assert not stale, f"named as long but now within the limit (drop them): {stale}"


def test_the_walk_measures_what_it_should(monkeypatch):
    """A long function and a long class written here are found, docstrings aside."""
    src = REPO / "agents" / "zz_size_probe.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    text = (f'def long():\n    """doc\n\n    more doc"""\n{body}\n\n\n'
            f'def short():\n    """{"doc " * 5}\n' + '\n' * 70 + '    """\n    return 1\n')
    monkeypatch.setattr(Path, "read_text", lambda self, encoding=None: text)
    _, functions = _sizes(src)
    assert dict(functions) == {"agents/zz_size_probe.py:long": 61,
                               "agents/zz_size_probe.py:short": 1}
