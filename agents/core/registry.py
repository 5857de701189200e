"""Registries: build a workload, compressor or policy by the name a config gives it.

Every algorithm lives in its own module and registers itself with a decorator; nothing
keeps a second list of names. Adding one is one new file (plus its test) in the package
its :class:`RegistryKind` names, decorated with that kind's decorator::

    # agents/workloads/my_net.py
    from agents.workloads.base import Workload, register_workload

    @register_workload("my_net")
    class MyNet(Workload): ...

Two ways to learn the names, for two layers:

- :meth:`Registry.names` (and :meth:`Registry.get`, :meth:`Registry.build`) import every
  module of the kind's package, so each registers itself; that is where the classes are
  needed (the agents, the controller).
- :meth:`RegistryKind.declared` reads the same modules' source without importing them (no torch)
  and collects the names their decorators give. The config validation in the core uses it
  to reject an unknown name with the list of known ones before anything starts, without
  importing upward. ``tests/agents/core/test_registry.py`` checks that both agree for every kind.

A decorator names its entry either by argument (``@register_workload("digits_mlp")``) or,
for a bare decorator (``@register``), by the class attribute ``name = "..."``.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import pkgutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class UnknownName(ValueError):
    """A name that no module of the kind's package registers; the message lists the known."""


@dataclass(frozen=True)
class RegistryKind:
    """Where one kind of registered thing lives: its ``package`` and the ``decorator``
    (function name) its modules register with. ``label`` names it in error messages."""

    label: str
    package: str
    decorator: str

    def modules(self) -> Iterator[tuple[str, Path]]:
        """``(module name, source file)`` of every module of the package, not imported."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(f"{self.label} package {self.package!r} not found")
        for info in pkgutil.iter_modules(spec.submodule_search_locations):
            if info.ispkg:
                continue
            for root in spec.submodule_search_locations:
                path = Path(root) / f"{info.name}.py"
                if path.is_file():
                    yield f"{self.package}.{info.name}", path
                    break

    def declared(self) -> tuple[str, ...]:
        """The names this kind's modules register, read from their source; sorted."""
        return _declared(self)

    def check(self, name: str, field: str) -> None:
        """Raise :class:`UnknownName` naming ``field`` when ``name`` is not declared."""
        known = self.declared()
        if name not in known:
            raise UnknownName(f"{field} = {name!r}: not a registered {self.label}; "
                              f"must be one of {', '.join(known)}")


@functools.cache
def _declared(kind: RegistryKind) -> tuple[str, ...]:
    found: set[str] = set()
    for _, path in kind.modules():
        text = path.read_text(encoding="utf-8")
        # A module that never spells the decorator's name cannot register with it; only
        # the others are parsed. Every ``gradbed run`` checks its config before its agents'
        # warm process starts, so this is on each run's critical path.
        if kind.decorator not in text:
            continue
        for node in _definitions(ast.parse(text, filename=str(path))):
            for deco in node.decorator_list:
                name = _decorated_name(deco, kind.decorator, node)
                if name is not None:
                    found.add(name)
    return tuple(sorted(found))


def _definitions(node: ast.AST) -> Iterator[ast.ClassDef | ast.FunctionDef]:
    """Every class and function definition in ``node``, at any depth. Definitions are
    statements, and statements nest only in statement lists (bodies, handlers, match
    cases): the walk skips the expressions, most of a module's nodes."""
    for _, value in ast.iter_fields(node):
        for child in value if isinstance(value, list) else ():
            if isinstance(child, ast.ClassDef | ast.FunctionDef):
                yield child
            if isinstance(child, ast.stmt | ast.excepthandler | ast.match_case):
                yield from _definitions(child)


def _callee(expr: ast.expr) -> str | None:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        return expr.attr
    return None


def _decorated_name(deco: ast.expr, decorator: str,
                    node: ast.ClassDef | ast.FunctionDef) -> str | None:
    if isinstance(deco, ast.Call) and _callee(deco.func) == decorator:
        if deco.args and isinstance(deco.args[0], ast.Constant) and isinstance(
                deco.args[0].value, str):
            return deco.args[0].value
        return None
    if _callee(deco) == decorator and isinstance(node, ast.ClassDef):
        for stmt in node.body:
            target = (stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                      else stmt.target if isinstance(stmt, ast.AnnAssign) else None)
            value = stmt.value if isinstance(stmt, ast.Assign | ast.AnnAssign) else None
            if (isinstance(target, ast.Name) and target.id == "name"
                    and isinstance(value, ast.Constant) and isinstance(value.value, str)):
                return value.value
    return None


class Registry(Generic[T]):
    """Name -> entry (a class or a factory) for one :class:`RegistryKind`.

    Entries are added by the decorator :meth:`register` when their module is imported;
    every lookup first imports all modules of the kind's package, so a name never depends
    on which modules someone happened to import before.
    """

    def __init__(self, kind: RegistryKind) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._loaded = False

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register the decorated class or function as ``name``."""
        def deco(entry: T) -> T:
            self.add(name, entry)
            return entry
        return deco

    def add(self, name: str, entry: T) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"{self.kind.label} name must be a non-empty string, got {name!r}")
        old = self._entries.get(name)
        if old is not None and old is not entry:
            raise ValueError(f"{self.kind.label} {name!r} registered twice ({old!r} and "
                             f"{entry!r})")
        self._entries[name] = entry

    def load(self) -> None:
        """Import every module of the package (each registers what it defines)."""
        if self._loaded:
            return
        for module, _ in self.kind.modules():
            importlib.import_module(module)
        self._loaded = True

    def names(self) -> tuple[str, ...]:
        """Every registered name, sorted."""
        self.load()
        return tuple(sorted(self._entries))

    def get(self, name: str, field: str | None = None) -> T:
        """The entry registered as ``name``; :class:`UnknownName` lists the known names."""
        if name not in self._entries:
            self.load()
        try:
            return self._entries[name]
        except KeyError:
            what = f"{field} = {name!r}" if field else repr(name)
            raise UnknownName(f"{what}: not a registered {self.kind.label}; must be one of "
                              f"{', '.join(self.names())}") from None

    def build(self, name: str, **params: Any) -> Any:
        """Call the entry registered as ``name`` with ``params`` (construct it)."""
        factory: Any = self.get(name)
        return factory(**params)


# The kinds of the project, defined once: the packages their modules live in and the
# decorator they register with. The registries themselves live next to their entries
# (agents.workloads.base.WORKLOADS, agents.compress.base, agents.core.policies.base,
# agents.core.schedules.registry).
WORKLOAD = RegistryKind("workload", "agents.workloads", "register_workload")
COMPRESSOR = RegistryKind("compressor", "agents.compress", "register")
RATIO_POLICY = RegistryKind("ratio policy", "agents.core.policies", "register_ratio_policy")
RATE_POLICY = RegistryKind("rate policy", "agents.core.policies", "register_rate_policy")
SCHEDULE = RegistryKind("pipeline schedule", "agents.core.schedules", "register")
# The kinds the core's config checks read by name. Shapes and roles use the same Registry
# type from their own packages (topo.shapes.SHAPES, controller.roles.ROLES), which the core
# cannot import.
KINDS = (WORKLOAD, COMPRESSOR, RATIO_POLICY, RATE_POLICY, SCHEDULE)
