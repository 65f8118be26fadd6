"""Branches of a run's history: a resume from an older step forks a new branch.

Restoring a step S while newer steps are committed (a rollback, or a fallback past a
damaged checkpoint) starts a branch that abandons them. Nothing changes on disk until the
branch's first save: just before that save commits, the committed steps newer than S are
renamed aside (``.retired-step_*``, see :meth:`CheckpointDir.retire`) and listed under
``retired`` in the resume event of the lineage. So ``restore()``, which takes the newest
committed step, always follows the newest lineage, retention never counts the abandoned
steps, and nothing is deleted silently. A crash after the resume but before that save
leaves the abandoned steps the newest (the branch was never committed), which is what a
relaunch should resume.
"""

from __future__ import annotations

from typing import Any

from ..storage.interface import CheckpointDir
from . import collective


def abandoned_steps(ckdir: CheckpointDir, fork: int) -> list[int]:
    """Committed steps newer than ``fork``; rank 0 lists them, every rank gets its list."""
    return collective.on_rank0(lambda: [s for s in ckdir.steps() if s > fork]) or []


def amend_last_event(lineage: list[dict[str, Any]], **fields: Any) -> list[dict[str, Any]]:
    """A copy of ``lineage`` whose last event also carries ``fields``.

    Never changes the list or its events in place: an in-flight asynchronous save still
    writes the lineage it was given.
    """
    if not lineage:
        return lineage
    return [*lineage[:-1], {**lineage[-1], **fields}]
