"""The recipes of docs/integrations, as the pages print them.

A page (of ``docs/integrations``, or given as a path: ``docs/fine-tuning.md``) marks each runnable script with ``<!-- recipe: NAME -->`` on the line before its
fenced ``python`` block; the tests write that block to a file unchanged and run it, so a
page cannot drift from code that works.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "integrations"
_MARKED = re.compile(r"<!-- recipe: (?P<name>[\w-]+) -->\n```python\n(?P<code>.*?)\n```", re.S)


def recipes(page: str | Path) -> dict[str, str]:
    """Every marked recipe on ``docs/integrations/<page>`` (or the page at a path), by name."""
    text = (DOCS / page).read_text(encoding="utf-8")  # an absolute path replaces DOCS
    return {m["name"]: m["code"] + "\n" for m in _MARKED.finditer(text)}


def write_recipe(page: str | Path, name: str, folder: Path) -> Path:
    """The recipe ``name`` of ``page`` as a script in ``folder``."""
    found = recipes(page)
    assert name in found, f"{page} has no recipe {name!r} (has {sorted(found)})"
    script = folder / f"{name}_recipe.py"
    script.write_text(found[name], encoding="utf-8")
    return script
