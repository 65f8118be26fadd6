"""The package layout stays true (docs/architecture.md): lower folders never import higher
ones, no modules import each other in a circle, and no module uses another module's
private (``_``) names.

Each module's imports of ``unbroken`` (at any depth: inside functions and under
``TYPE_CHECKING`` too) are parsed; a failure names the module, the line and the import.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

import unbroken
import unbroken.testing

PACKAGE = Path(unbroken.__file__).parent

# unit -> the units it may import (besides itself). A unit is a top-level module or folder.
LEAVES = {"errors": set(), "_version": set(), "report": set(), "env": set()}
ALLOWED: dict[str, set[str]] = {
    **LEAVES,
    "storage": {"errors", "env"},
    "format": {"storage", "errors", "env", "_version"},
    "live": {"format", "errors"},
    "core": {"live", "format", "storage", "errors", "report"},
    # What the training loop's Checkpointer remembers across calls (run/run.py).
    "run": {"core", "live", "format", "storage", "errors", "env"},
    "proof": {"live", "format", "storage", "errors", "env"},
    # The local tier: node folders in memory, replicas, the restore from them.
    "tiers": {"core", "live", "format", "storage", "errors", "report"},
    "checkpointer": {"run", "tiers", "core", "live", "format", "storage", "errors", "report"},
    "testing": {"proof", "live", "format", "storage", "errors"},
    "tools": {"checkpointer", "core", "live", "format", "storage", "proof"} | set(LEAVES),
    "integrations": {
        "checkpointer",
        "run",
        "core",
        "live",
        "format",
        "storage",
        "proof",
        "errors",
        "report",
    },
    "cli": {"tools", "testing", "checkpointer", "core", "live", "format", "storage", "proof"}
    | set(LEAVES),
    "__init__": {"checkpointer", "tiers", "tools", "errors", "report", "_version"},
}
MAX_LINES = 500


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _unit(module: tuple[str, ...]) -> str:
    """('format', 'tree') -> 'format'; () (the package itself) -> '__init__'."""
    return module[0] if module else "__init__"


def _module_path(path: Path) -> tuple[str, ...]:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


class Import(NamedTuple):
    line: int
    written: str  # the import as written, for messages
    module: tuple[str, ...]  # the module of ours it reaches (``from pkg import mod``: pkg.mod)
    name: str | None  # the name it takes from that module (None: the module itself)
    bound: str  # the name it binds here


def _our_imports(path: Path) -> Iterator[Import]:
    """Every import of ours in ``path``, one per name imported."""
    known = {_module_path(p) for p in _modules()}
    module = _module_path(path)
    package = module if path.name == "__init__.py" else module[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "unbroken":
                    bound = alias.asname or parts[0]
                    yield Import(node.lineno, f"import {alias.name}", tuple(parts[1:]), None, bound)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = base + tuple(node.module.split(".") if node.module else ())
            elif node.module and node.module.split(".")[0] == "unbroken":
                target = tuple(node.module.split(".")[1:])
            else:
                continue
            for alias in node.names:
                written = f"from {'.' * node.level}{node.module or ''} import {alias.name}"
                bound = alias.asname or alias.name
                if (*target, alias.name) in known:
                    yield Import(node.lineno, written, (*target, alias.name), None, bound)
                else:
                    yield Import(node.lineno, written, target, alias.name, bound)


def layout_violations() -> list[str]:
    problems = []
    for path in _modules():
        unit = _unit(_module_path(path))
        rel = path.relative_to(PACKAGE.parent)
        if unit not in ALLOWED:
            problems.append(f"{rel}: unit {unit!r} has no row in ALLOWED (add it, with its rule)")
            continue
        for imp in _our_imports(path):
            target = _unit(imp.module)
            if target != unit and target not in ALLOWED[unit]:
                problems.append(
                    f"{rel}:{imp.line}: `{imp.written}` ({unit} may not import {target})"
                )
    return problems


def _name(module: tuple[str, ...]) -> str:
    return ".".join(("unbroken", *module))


def circles() -> list[list[str]]:
    """Every set of modules that import each other in a loop (strongly connected
    components of the import graph), each as sorted module names."""
    graph = {
        _module_path(p): {i.module for i in _our_imports(p) if i.module != _module_path(p)}
        for p in _modules()
    }
    order: dict[tuple[str, ...], int] = {}
    low: dict[tuple[str, ...], int] = {}
    stack: list[tuple[str, ...]] = []
    found = []

    def visit(v: tuple[str, ...]) -> None:  # Tarjan's algorithm
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(_name(m) for m in group))

    for v in graph:
        if v not in order:
            visit(v)
    return sorted(found)


def private_uses() -> list[str]:
    """Every use of another module's private name: ``from mod import _x``, or ``mod._x``
    where ``mod`` is a module of ours imported here."""
    problems = []
    for path in _modules():
        here = _module_path(path)
        rel = path.relative_to(PACKAGE.parent)
        modules = {}
        for imp in _our_imports(path):
            if imp.name is None:
                modules[imp.bound] = imp.module
            elif imp.module != here and imp.name.startswith("_") and not imp.name.startswith("__"):
                problems.append(f"{rel}:{imp.line}: imports {imp.name} from {_name(imp.module)}")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
                and modules[node.value.id] != here
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                used = _name(modules[node.value.id])
                problems.append(f"{rel}:{node.lineno}: uses {node.attr} of {used}")
    return problems


def test_lower_folders_never_import_higher_ones():
    assert layout_violations() == []


def test_no_modules_import_each_other_in_a_circle():
    assert circles() == []


def test_no_module_uses_another_modules_private_names():
    assert private_uses() == []


def _fake_package(tmp_path, subpackage: str, modules: dict[str, str]):
    """A package ``unbroken`` under ``tmp_path`` with one subpackage holding ``modules``
    (file name -> source)."""
    fake = tmp_path / "unbroken"
    (fake / subpackage).mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / subpackage / "__init__.py").write_text("")
    for name, source in modules.items():
        (fake / subpackage / name).write_text(source)
    return fake


def test_the_rule_catches_an_offending_import(tmp_path, monkeypatch):
    """The checker itself can fail: a format module importing core is named."""
    bad = "def f():\n    from ..core import saving\n    return saving\n"
    fake = _fake_package(tmp_path, "format", {"bad.py": bad})
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert layout_violations() == [
        "unbroken/format/bad.py:2: `from ..core import saving` (format may not import core)"
    ]


def test_the_circle_and_private_rules_catch_offenders(tmp_path, monkeypatch):
    """The checkers can fail: two modules importing each other (one inside a function, one
    under TYPE_CHECKING) are a circle; a private name imported or used is named."""
    a = "def f():\n    from .b import _helper\n    return _helper\n"
    b = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n"
    b += "def _helper():\n    return a._cache\n"
    fake = _fake_package(tmp_path, "storage", {"a.py": a, "b.py": b})
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert circles() == [["unbroken.storage.a", "unbroken.storage.b"]]
    assert private_uses() == [
        "unbroken/storage/a.py:2: imports _helper from unbroken.storage.b",
        "unbroken/storage/b.py:5: uses _cache of unbroken.storage.a",
    ]


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_over_the_size_limit(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{path.name}: {lines} lines; split it by concern"


def test_public_import_paths():
    assert unbroken.__all__ == sorted(unbroken.__all__)
    for name in unbroken.__all__:
        assert getattr(unbroken, name) is not None
    for name in unbroken.testing.__all__:
        assert callable(getattr(unbroken.testing, name))
