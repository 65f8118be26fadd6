"""The package layout stays true: lower folders never import higher ones (docs/architecture.md).

Each module's imports of ``unbroken`` (at any depth, including inside functions) are parsed
and checked against the table below; a failure names the module, the line and the import.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import unbroken
import unbroken.testing

PACKAGE = Path(unbroken.__file__).parent

# unit -> the units it may import (besides itself). A unit is a top-level module or folder.
LEAVES = {"errors": set(), "_version": set(), "report": set()}
ALLOWED: dict[str, set[str]] = {
    **LEAVES,
    "format": {"errors"},
    "live": {"format", "errors"},
    "core": {"live", "format", "errors", "report", "_version"},
    "proof": {"live", "format", "errors"},
    "checkpointer": {"core", "live", "format", "proof", "errors", "report"},
    "testing": {"proof", "live", "format", "errors"},
    "tools": {"checkpointer", "core", "live", "format", "proof", "errors", "report", "_version"},
    "integrations": {"checkpointer", "core", "live", "format", "proof", "errors", "report"},
    "cli": {"tools", "testing", "checkpointer", "core", "live", "format", "proof"} | set(LEAVES),
    "__init__": {"checkpointer", "errors", "report", "_version"},
}
MAX_LINES = 400


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _unit(module: tuple[str, ...]) -> str:
    """('format', 'tree') -> 'format'; () (the package itself) -> '__init__'."""
    return module[0] if module else "__init__"


def _module_path(path: Path) -> tuple[str, ...]:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imported_units(path: Path) -> list[tuple[int, str, str]]:
    """(line, import as written, unit of ours it reaches) for every import in ``path``."""
    module = _module_path(path)
    package = module if path.name == "__init__.py" else module[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "unbroken":
                    found.append((node.lineno, f"import {alias.name}", _unit(tuple(parts[1:]))))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = base + tuple(node.module.split(".") if node.module else ())
            elif node.module and node.module.split(".")[0] == "unbroken":
                target = tuple(node.module.split(".")[1:])
            else:
                continue
            written = f"from {'.' * node.level}{node.module or ''} import "
            if target:
                names = ", ".join(a.name for a in node.names)
                found.append((node.lineno, written + names, _unit(target)))
            else:  # from the package root: each name is a unit of its own
                found.extend((node.lineno, written + a.name, a.name) for a in node.names)
    return found


def layout_violations() -> list[str]:
    problems = []
    for path in _modules():
        unit = _unit(_module_path(path))
        rel = path.relative_to(PACKAGE.parent)
        if unit not in ALLOWED:
            problems.append(f"{rel}: unit {unit!r} has no row in ALLOWED (add it, with its rule)")
            continue
        for line, written, target in _imported_units(path):
            if target != unit and target not in ALLOWED[unit]:
                problems.append(f"{rel}:{line}: `{written}` ({unit} may not import {target})")
    return problems


def test_lower_folders_never_import_higher_ones():
    assert layout_violations() == []


def test_the_rule_catches_an_offending_import(tmp_path, monkeypatch):
    """The checker itself can fail: a format module importing core is named."""
    fake = tmp_path / "unbroken"
    (fake / "format").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "format" / "__init__.py").write_text("")
    (fake / "format" / "bad.py").write_text(
        "def f():\n    from ..core import saving\n    return saving\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert layout_violations() == [
        "unbroken/format/bad.py:2: `from ..core import saving` (format may not import core)"
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
