"""Retention: how many committed checkpoints a run keeps (``keep_last``)."""

from __future__ import annotations

from ..format.folder_check import check_folder
from ..storage.interface import CheckpointDir
from . import collective


def apply_retention(ckdir: CheckpointDir, newest: int, keep_last: int | None) -> None:
    """Unlist (then delete in the background) all but the ``keep_last`` newest committed
    checkpoints; rank 0 acts, errors are agreed on every rank. ``newest``, the checkpoint
    just committed, is never removed, however steps are ordered."""
    if keep_last is None:
        return

    def prune() -> None:
        check_folder(ckdir.step_path(newest))  # delete nothing until the new one reads back
        steps = ckdir.steps()
        doomed = [s for s in steps if s != newest][: max(0, len(steps) - keep_last)]
        for s in doomed:
            ckdir.remove(s)

    collective.agree(prune, only_rank0=True)
