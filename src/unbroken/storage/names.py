"""The names inside a run folder, the same on a local disk and on an object store.

::

    DIR/step_00000200/          a committed checkpoint: it holds MANIFEST, its commit record
    DIR/.partial-<step>-<id>/   a save in progress (local): never listed, never loaded
    DIR/.trash-<step>-<id>/     a checkpoint being deleted (local): never listed
    DIR/.retired-<step>-<id>/   a checkpoint of an abandoned branch: never listed, kept
    DIR/.replaced-<step>-<id>/  the old copy of a re-saved step, until the new one commits
    DIR/.lock                   the save lock (local)
    DIR/.run-lock               held by the open Checkpointer that records the run (local)

The commit record (``manifest.json``) is written last; storage knows of it only that its
presence commits a step and that it is a JSON object whose ``files`` names the step's
files (``unbroken.format.manifest`` owns the rest).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import uuid
from collections.abc import Sequence
from pathlib import PurePath
from typing import Any

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LOCK = ".lock"
RUN_LOCK = ".run-lock"
PARTIAL = ".partial-"
TRASH = ".trash-"
RETIRED = ".retired-"
REPLACED = ".replaced-"
LEFTOVERS = (PARTIAL, TRASH)
# Files of other tools' checkpoints: a folder holding some and none of ours is refused.
FOREIGN_MARKERS = (".metadata", ".distcp", ".pt", ".pth", ".ckpt", ".safetensors", ".bin")
# ASCII digits and the whole name: ``\d`` also takes other scripts' digits and ``$`` a
# name ending in a newline, which named a step whose folder is not there.
_STEP_RE = re.compile(r"step_([0-9]{8,})", re.ASCII)
_ASIDE_RE = re.compile(r"(step_[0-9]{8,})-([0-9A-Za-z]+)", re.ASCII)
_STEP_PREFIX = "step_"
_warned: set[str] = set()
_warned_lock = threading.Lock()


def step_dir_name(step: int) -> str:
    """``200`` -> ``step_00000200``."""
    return f"step_{step:08d}"


def step_of(name: str) -> int | None:
    """The step a folder name says (``step_00000200`` -> 200), or None.

    Only the name :func:`step_dir_name` gives that step is one: another spelling of it
    (other scripts' digits, a trailing newline, more leading zeros) would be listed as a
    step whose folder is not there. Such a name is ignored, and logged once.
    """
    m = _STEP_RE.fullmatch(name)
    if m and step_dir_name(int(m.group(1))) == name:
        return int(m.group(1))
    if name.startswith(_STEP_PREFIX):
        _warn_odd(name)
    return None


def folder_step(path: str | os.PathLike | Any) -> int | None:
    """The step a folder's name says (a path, a store path or a name), or None: a step
    folder's, or that of the old copy of a re-saved step (``.replaced-step_*-<id>``),
    which is read as the step while a re-save that died left it aside."""
    name = getattr(path, "name", None)
    name = name if isinstance(name, str) else PurePath(os.fspath(path)).name
    return aside_step(name, REPLACED) if name.startswith(REPLACED) else step_of(name)


def aside_step(name: str, prefix: str) -> int | None:
    """The step of a folder set aside under ``prefix`` (``.retired-step_00000200-<id>``
    -> 200), or None if ``name`` is not one."""
    original = aside_target(name, prefix)
    return None if original is None else step_of(original)


def aside_name(prefix: str, name: str) -> str:
    """A new, unique name for the step folder ``name`` set aside under ``prefix``."""
    return f"{prefix}{name}-{uuid.uuid4().hex[:12]}"


def aside_target(name: str, prefix: str) -> str | None:
    """The step folder a folder set aside under ``prefix`` came from (its name), or None."""
    if not name.startswith(prefix):
        return None
    m = _ASIDE_RE.fullmatch(name.removeprefix(prefix))
    if m is None or step_of(m.group(1)) is None:
        _warn_odd(name)
        return None
    return m.group(1)


def _warn_odd(name: str) -> None:
    """Log, once per process, a name that looks like one of ours and is not."""
    with _warned_lock:
        if name in _warned:
            return
        _warned.add(name)
    logger.warning(
        "ignoring %s in a checkpoint folder: its name is not one unbroken writes "
        "(step_ and the step in ASCII digits, 8 or more, no other leading zeros, nothing "
        "after); rename or remove it",
        ascii(name),
    )


def log_retired(moved: Sequence[tuple[Any, Any]]) -> None:
    """Log the committed steps an abandoned branch retired: (step folder, where it went)."""
    if moved:
        logger.warning(
            "retired %s of an abandoned branch: kept as %s",
            ", ".join(path.name for path, _ in moved),
            ", ".join(aside.name for _, aside in moved),
        )
