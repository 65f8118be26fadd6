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
_STEP_RE = re.compile(r"^step_(\d{8,})$")


def step_dir_name(step: int) -> str:
    """``200`` -> ``step_00000200``."""
    return f"step_{step:08d}"


def step_of(name: str) -> int | None:
    """The step a folder name says (``step_00000200`` -> 200), or None."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def folder_step(path: str | os.PathLike | Any) -> int | None:
    """The step a folder's name says (a path, a store path or a name), or None."""
    name = getattr(path, "name", None)
    return step_of(name if isinstance(name, str) else PurePath(os.fspath(path)).name)


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
    original = name.removeprefix(prefix).rsplit("-", 1)[0]
    return original if step_of(original) is not None else None


def log_retired(moved: Sequence[tuple[Any, Any]]) -> None:
    """Log the committed steps an abandoned branch retired: (step folder, where it went)."""
    if moved:
        logger.warning(
            "retired %s of an abandoned branch: kept as %s",
            ", ".join(path.name for path, _ in moved),
            ", ".join(aside.name for _, aside in moved),
        )
