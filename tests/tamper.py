"""Tampering with a committed checkpoint's manifest, as an attacker or a damaged disk
would: the one place the tests read, edit, re-seal and rewrite ``manifest.json``.

The manifest's checksum has no key, so anyone who edits a manifest can recompute it:
:func:`edit` and :func:`write` re-seal with the writer's own digest, as an attacker
would, and what the library then refuses it refuses for the content, not the checksum.
:func:`alter` edits the text and leaves the old checksum, which must then fail.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unbroken.format import manifest

MANIFEST = "manifest.json"
INF = "\x00inf\x00"  # stands for the JSON number 1e999 (which parses as inf) until written
NEG_INF = "\x00-inf\x00"


def read(folder: Path) -> dict:
    """The manifest of the checkpoint in ``folder``, as plain JSON (no validation)."""
    return json.loads((Path(folder) / MANIFEST).read_text())


def sealed(doc: dict) -> str:
    """``doc`` re-sealed and serialized (``INF`` written as ``1e999``): its
    ``manifest_checksum`` is recomputed over everything else."""
    body = dict(doc)
    body.pop("manifest_checksum", None)
    try:
        body["manifest_checksum"] = manifest._digest(body)  # re-sealed: no key to stop it
    except (ValueError, TypeError):  # 1e999 cannot be digested; nor can it be sealed
        body["manifest_checksum"] = "0" * 32
    out = json.dumps(body, indent=1)
    return out.replace(json.dumps(INF), "1e999").replace(json.dumps(NEG_INF), "-1e999")


def write(folder: Path, doc: dict, *, seal: bool = True) -> None:
    """``doc`` as the manifest of the checkpoint in ``folder``: re-sealed, or with
    ``seal=False`` as it is (its checksum, if any, left as it was)."""
    (Path(folder) / MANIFEST).write_text(sealed(doc) if seal else json.dumps(doc))


def edit(folder: Path, change: Callable[[dict], Any], *, seal: bool = True) -> dict:
    """Apply ``change`` to the manifest in ``folder`` (in place, on the parsed document)
    and write it back, re-sealed unless ``seal=False``; the edited document."""
    doc = read(folder)
    change(doc)
    write(folder, doc, seal=seal)
    return doc


def edited_copy(
    root: Path, to: Path, change: Callable[[dict], Any], *, step: int = 2, seal: bool = True
) -> Path:
    """A copy of the run folder ``root`` at ``to`` whose step ``step`` has ``change`` in
    its manifest (re-sealed unless ``seal=False``); ``to``."""
    shutil.copytree(root, to)
    edit(to / f"step_{step:08d}", change, seal=seal)
    return to


def alter(folder: Path, old: str, new: str) -> None:
    """Replace ``old`` (which must occur) by ``new`` in the manifest's text, leaving its
    checksum as it was: damage the checksum must catch."""
    path = Path(folder) / MANIFEST
    text = path.read_text()
    assert old in text, f"{old!r} is not in {path}"
    path.write_text(text.replace(old, new))
