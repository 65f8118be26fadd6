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
from ..storage.interface import CheckpointDir
from . import collective

logger = logging.getLogger(__name__)
MAX_RELISTS = 100  # how often checkpoints may vanish while one restore() reads them


class Candidates:
    """The steps ``restore()`` tries, newest first (just ``step`` if given), the same on
    every rank; false while none is left to try.

    A step that a concurrent save pruned, retired or re-saved while it was being read is
    no damage: when reading the step just yielded failed, call :meth:`relisted` first.
    Collective, like the reads.

    Cost on a store, however many steps there are (1,000 junk ``step_*/manifest.json``
    keys, docs/reliability.md): the folder is listed a bounded number of times, each
    step's mark (``CheckpointDir.step_marks``) is taken from that listing, and a step
    whose read failed costs one more request (``step_mark``: did it vanish?).

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
        self._marks = self._list_marks()
        self._current: int | None = None
        self._damaged: set[int] = set()
        self._relists = 0

    def __bool__(self) -> bool:
        return bool(self._pending)

    def __iter__(self) -> Iterator[int]:
        while self._pending:
            self._current = self._pending.pop(0)
            yield self._current

    def relisted(self, *, garbage: bool = False) -> bool:
        """After reading the step just yielded failed: True if it vanished while being read
        (the steps were listed again, less those found damaged, and iteration goes on
        with them); False if it is still there, so the failure is damage.

        ``garbage``: what was read is no checkpoint's at all (not one that vanished: a
        save never writes such bytes), so it is damage without asking the store.

        Raises:
            CheckpointNotFoundError: nothing is left (all removed while being read).
            CheckpointError: checkpoints vanished more than ``MAX_RELISTS`` times.
        """
        assert self._current is not None
        if garbage or not self._vanished(self._current):
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
        self._marks = self._list_marks()
        if not self._pending:
            raise CheckpointNotFoundError(
                f"the checkpoints in {self._ckdir.root} were removed while being read"
                + (f"; damaged: steps {sorted(self._damaged)}" if self._damaged else "")
            )
        logger.info("step %d vanished while being read; steps listed again", self._current)
        return True

    def _list_marks(self) -> dict[int, str]:
        """Rank 0's marks of the committed steps, from one listing; collective."""
        if not self._pending:
            return {}
        return collective.on_rank0(self._ckdir.step_marks) or {}

    def _vanished(self, step: int) -> bool:
        """Whether ``step`` stopped being the checkpoint listed before it was read
        (pruned, retired or re-saved meanwhile): its read errors are then no damage.
        Rank 0 decides for all."""
        seen = self._marks.get(step)
        return collective.on_rank0(lambda: seen is None or self._ckdir.step_mark(step) != seen)
