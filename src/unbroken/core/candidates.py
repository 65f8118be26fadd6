"""Which checkpoint ``restore()`` reads: committed steps newest first, listed again when
a concurrent save prunes, retires or re-saves the one being read.

A training job saving into the folder (with ``keep_last``) while another process
restores from it is normal use; a step that vanishes under a reader is not damage, and
the reader goes on with what is committed now (docs/reliability.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from ..errors import CheckpointError, CheckpointNotFoundError
from ..storage import interface
from ..storage.interface import CheckpointDir, Identity, Location
from . import collective

logger = logging.getLogger(__name__)
MAX_RELISTS = 100  # how often checkpoints may vanish while one restore() reads them


def vanished(folder: Location, seen: Identity | None) -> bool:
    """Whether ``folder`` stopped being the checkpoint whose ``identity()`` was
    ``seen`` (taken before reading it): pruned, retired or re-saved by a concurrent save.
    Its read errors are then no damage: list the steps again. Rank 0 decides for all."""
    return collective.from_rank0(interface.vanished(folder, seen))


class Candidates:
    """The steps ``restore()`` tries, newest first (just ``step`` if given), the same on
    every rank; false while none is left to try.

    A step that a concurrent save pruned, retired or re-saved while it was being read is
    no damage: when reading the step just yielded failed, call :meth:`relisted` first.
    Collective, like the reads.

    Args:
        ckdir: the run folder.
        step: the step asked for, or None (the newest sound one).
        list_steps: ``(ckdir, step) -> steps newest first``, collective (cleans leftovers
            if no save is under way): ``candidate_steps`` of the restore path.

    Example::

        for chosen in (candidates := Candidates(ckdir, None, candidate_steps)):
            try:
                ...  # read_manifest, restore
                break
            except CorruptCheckpointError:
                if candidates.relisted():
                    continue
                ...  # the damage: skip it, or raise
    """

    def __init__(
        self,
        ckdir: CheckpointDir,
        step: int | None,
        list_steps: Callable[[CheckpointDir, int | None], list[int]],
    ) -> None:
        self._ckdir, self._step, self._list = ckdir, step, list_steps
        self._pending = list_steps(ckdir, step)
        self._current: int | None = None
        self._seen: Identity | None = None
        self._damaged: set[int] = set()
        self._relists = 0

    def __bool__(self) -> bool:
        return bool(self._pending)

    def __iter__(self) -> Iterator[int]:
        while self._pending:
            self._current = self._pending.pop(0)
            self._seen = self._ckdir.step_path(self._current).identity()
            yield self._current

    def relisted(self) -> bool:
        """After reading the step just yielded failed: True if it vanished while being read
        (the steps were listed again, less those found damaged, and iteration goes on
        with them); False if it is still there, so the failure is damage.

        Raises:
            CheckpointNotFoundError: nothing is left (all removed while being read).
            CheckpointError: checkpoints vanished more than ``MAX_RELISTS`` times.
        """
        assert self._current is not None
        folder = self._ckdir.step_path(self._current)
        if not vanished(folder, self._seen):
            self._damaged.add(self._current)
            return False
        if self._relists >= MAX_RELISTS:
            raise CheckpointError(
                f"the checkpoints in {self._ckdir.root} were pruned or replaced "
                f"{self._relists} times while being read: keep more of them (keep_last) "
                "while other processes restore"
            )
        self._relists += 1
        listed = self._list(self._ckdir, self._step)
        self._pending = [s for s in listed if s not in self._damaged]
        if not self._pending:
            raise CheckpointNotFoundError(
                f"the checkpoints in {self._ckdir.root} were removed while being read"
                + (f"; damaged: steps {sorted(self._damaged)}" if self._damaged else "")
            )
        logger.info("step %d vanished while being read; steps listed again", self._current)
        return True
