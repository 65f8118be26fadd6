"""The run-folder policy, written once for every medium: the ``CheckpointDir`` role.

::

    DIR/step_00000200/          committed: it holds manifest.json, its commit record
    DIR/.retired-step_*-<id>/   a step of an abandoned branch, kept, never listed
    DIR/.replaced-step_*-<id>/  the old copy of a re-saved step, until the new one commits

A save writes its files where the medium's commit strategy puts a save in progress
(``backend.py``) and commits with the manifest written last: a crash at any instant
leaves the old set of committed steps or the new one. The first save after a resume
from an older step retires the abandoned newer steps first, newest first (a crash in
between leaves the old branch, or a prefix of it, the newest, as if the save had not
started); a failed commit puts them back. Re-saving a step swaps the new copy in
atomically where the medium can; elsewhere the old copy waits aside as
``.replaced-*`` until the new one is committed, and a crash in between is undone by the
next save or restore, which puts it back; until then that copy is listed as the step
and read where it is (``step_copies``), so listing and restoring agree. A committed copy is replaced only if the
caller's rule says so (``other_writer``: storage never reads lineage). Removing a step
unlists it at once, then one background deleter deletes its files.

Readers (restores in other processes, the command-line tools) never take the save lock:
they clean leftovers only while no save holds it (``clean_leftovers_if_idle``); without
locks (an object store) they only put back a replaced copy whose re-save died, with a
create-only write that never lands on a commit. A step that a save prunes, retires or
replaces while it is read is re-listed, not reported as damage (``interface.vanished``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence

from ..errors import CheckpointError
from .backend import Backend
from .deleter import Deleter
from .interface import Location, RunLock
from .names import (
    FOREIGN_MARKERS,
    MANIFEST,
    REPLACED,
    RETIRED,
    aside_name,
    aside_step,
    aside_target,
    log_retired,
    step_dir_name,
    step_of,
)

logger = logging.getLogger(__name__)
_PUT_BACKS = 3  # how often readers may put a step back while a re-save replaces it


class RunFolder:
    """The root folder of one training run's checkpoints, over one medium.

    Thread-safe for one saver (it holds the save lock, where the medium has one) and any
    number of readers.

    Args:
        backend: the medium and its commit strategy (``locate.checkpoint_dir`` picks it).

    Example::

        folder = checkpoint_dir("ckpts/run1")   # or "s3://bucket/run1"
        folder.steps()                          # [100, 200]
    """

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self.root = backend.root
        self._deleter = Deleter(backend.delete_tree)

    @property
    def has_locks(self) -> bool:
        return self._backend.has_locks

    # -- steps ---------------------------------------------------------------------------

    def step_path(self, step: int) -> Location:
        return self.root / step_dir_name(step)

    def steps(self) -> list[int]:
        return sorted(self.step_copies())

    def step_marks(self) -> dict[int, str]:
        return {step: mark for step, (_, mark) in self.step_copies().items()}

    def step_mark(self, step: int) -> str | None:
        mark = self._backend.mark(self.step_path(step))
        if mark is None:  # set aside by a re-save that died? (a listing, only then)
            mark = self.step_copies().get(step, (None, None))[1]
        return mark

    def step_copies(self) -> dict[int, tuple[str, str]]:
        """Every committed step: the name of the folder its checkpoint is read from, and
        its mark (:meth:`step_marks`); one listing.

        That folder is the step folder, or, where a re-save died between setting the
        old copy aside and committing the new one, the ``.replaced-*`` copy, which is
        the step until a save or restore puts it back: listing and restoring agree on
        what exists, and a read-only reader changes nothing to see it."""
        marks = self._backend.marks()
        found = {}
        for name, mark in marks.items():
            step = step_of(name)
            if step is not None:
                found[step] = (name, mark)
        for name, mark in sorted(marks.items()):
            step = aside_step(name, REPLACED) if name.startswith(REPLACED) else None
            if step is not None and step not in found:
                found[step] = (name, mark)
        return found

    def copy_path(self, step: int) -> Location:
        """The folder committed ``step`` is read from (:meth:`step_copies`); its step
        folder if it is not committed."""
        if self._backend.mark(self.step_path(step)) is not None:
            return self.step_path(step)
        name = self.step_copies().get(step, (None, None))[0]
        return self.step_path(step) if name is None else self.root / name

    def steps_without_manifest(self) -> list[int]:
        """Steps whose ``step_*`` folder has no manifest.json, ascending: damaged (a save
        never leaves one: it commits a folder that holds its manifest), never listed nor
        restored; callers report them. Where saves write in place (a store) such a folder
        is a save in progress or an abandoned one, never damage: none."""
        if self.root.saves_in_place:
            return []
        found = []
        for name in self._names():
            step = step_of(name)
            if step is None:
                continue
            entry = self.root / name
            # Asked twice around is_dir(): a step pruned or committed by a concurrent save
            # between the questions is never mistaken for one that lost its manifest.
            lost = entry.has_file(MANIFEST) is False and entry.is_dir()
            if lost and entry.has_file(MANIFEST) is False:
                found.append(step)
        return sorted(found)

    def listdir(self) -> list[str]:
        return self._backend.names()

    def is_folder(self, name: str) -> bool:
        return (self.root / name).is_dir()

    def check_not_foreign(self) -> None:
        """Refuse a folder that holds another tool's checkpoint and none of ours."""
        names = self._names()
        if any(step_of(n) is not None for n in names) and self.steps():
            return
        foreign = sorted(n for n in names if n.endswith(FOREIGN_MARKERS))
        if foreign:
            raise CheckpointError(
                f"{self.root} holds no unbroken checkpoint but has other checkpoint files "
                f"({', '.join(foreign[:5])}); point Checkpointer at an empty or unbroken "
                "folder, or bring those files in with `unbroken import`"
            )

    def retired(self) -> list[tuple[int, Location]]:
        """Checkpoints retired from abandoned branches: (step, folder), by step."""
        found = []
        for name in self._names():
            step = aside_step(name, RETIRED)
            if step is not None and (self.root / name).is_dir():
                found.append((step, self.root / name))
        return sorted(found, key=lambda x: (x[0], str(x[1])))

    # -- locks ---------------------------------------------------------------------------

    def run_lock(self) -> RunLock:
        return self._backend.run_lock()

    def save_lock(self) -> contextlib.AbstractContextManager[None]:
        """Hold the folder's save lock (one saver at a time); fail at once if taken.

        Two jobs saving into one folder (a misconfigured relaunch) would otherwise clean
        up or overwrite each other's work; the loser gets a clear error instead. Readers
        never take it (see :meth:`saving_now`). Without locks (a store) the create-only
        manifest write decides instead (:meth:`commit`)."""
        return self._backend.save_lock()

    def saving_now(self) -> bool:
        return self._backend.saving_now()

    # -- a save --------------------------------------------------------------------------

    def new_partial(self, step: int) -> Location:
        return self._backend.new_partial(step)

    def token(self, partial: Location) -> str:
        return self._backend.token(partial)

    def from_token(self, text: str) -> Location:
        return self._backend.from_token(text)

    def shard_name(self, partial: Location, rank: int) -> str:
        return self._backend.shard_name(partial, rank)

    def discard(self, partial: Location) -> None:
        self._backend.discard(partial)

    def commit(
        self,
        partial: Location,
        step: int,
        *,
        retire: Sequence[int] = (),
        manifest: bytes = b"",
        other_writer: Callable[[bytes], str | None] | None = None,
    ) -> Location:
        """Make ``partial`` the committed checkpoint of ``step``, ``manifest`` (its bytes)
        written last; returns the committed folder.

        ``retire``: committed steps of an abandoned branch, unlisted first (see
        :meth:`retire`) and put back if the commit then fails. A copy of ``step``
        committed already is replaced unless ``other_writer`` names another writer.
        Raises ``CheckpointError`` (naming the path; on a disk the free space too)
        having committed nothing.
        """
        self._backend.seal(partial, manifest)
        retired = self.retire(retire)
        try:
            return self._install(partial, step, manifest, other_writer)
        except BaseException:
            self._unretire(retired)
            raise

    def _install(
        self,
        partial: Location,
        step: int,
        manifest: bytes,
        other_writer: Callable[[bytes], str | None] | None,
    ) -> Location:
        """Commit ``partial`` at its step folder, the copy there (if any) replaced: swapped
        out atomically, or moved aside until the new one is committed and put back if
        that fails."""
        final = self.step_path(step)
        aside = None
        try:
            for _attempt in range(_PUT_BACKS):
                old = self._committed_copy(final)
                if old is not None:
                    self._refuse_other(final, step, old, other_writer)
                    logger.warning("replacing the existing checkpoint of step %d", step)
                    if self._backend.swap(partial, final):  # partial holds the old copy
                        self._backend.delete_tree(partial)
                        return final
                    moved = self.root / aside_name(REPLACED, final.name)
                    self._backend.move(final, moved)
                    aside = moved
                try:
                    self._backend.publish(partial, final, step, manifest)
                    break
                except CheckpointError:
                    # A reader that found the step unlisted put the old copy back: go
                    # again. Anything else there is another save's commit: refused,
                    # naming the other job where its manifest tells.
                    now = self._committed_copy(final)
                    if old is None or now != old:
                        if now:
                            self._refuse_other(final, step, now, other_writer)
                        raise
                    aside = None
            else:
                raise CheckpointError(
                    f"step {step} at {final} was put back {_PUT_BACKS} times by restores "
                    "while this save replaced it; save again"
                )
        except BaseException:
            if aside is not None:
                with contextlib.suppress(Exception):  # never over another save's commit
                    self._backend.move(aside, final)
            raise
        if aside is not None:
            self._deleter.now(aside)
        return final

    def _committed_copy(self, final: Location) -> bytes | None:
        """The manifest bytes of the copy at ``final`` (empty if it cannot be read: a
        damaged step, replaced as any), or None if none is there."""
        if not self._backend.holds(final):
            return None
        try:
            data = self._backend.read(final / MANIFEST)
        except OSError:
            return b""
        if data is None and not self._backend.holds(final):
            return None  # removed meanwhile (another job's retention)
        return b"" if data is None else data

    def _refuse_other(
        self,
        final: Location,
        step: int,
        old: bytes,
        other_writer: Callable[[bytes], str | None] | None,
    ) -> None:
        who = None if other_writer is None else other_writer(old)
        if who is not None:
            raise CheckpointError(
                f"another save committed step {step} at {final} ({who}) while this one was "
                "being written: two jobs must not share a checkpoint folder. This save's "
                "files were removed and the other save's checkpoint is kept; stop the "
                "other job or use another path"
            )

    # -- retiring and removing -----------------------------------------------------------

    def retire(self, steps: Sequence[int]) -> list[tuple[Location, Location]]:
        """Unlist committed ``steps`` by moving them to ``.retired-step_*-<id>``, newest
        first: a crash midway leaves a prefix of the old branch listed, which restores
        like a crash before the save. They are kept (never listed, loaded or cleaned up)
        so nothing is lost silently; returns (old, new) paths. Steps no longer committed
        are passed over; on a failure the ones moved are put back."""
        moved: list[tuple[Location, Location]] = []
        try:
            for s in sorted(steps, reverse=True):
                path = self.step_path(s)
                if self._backend.mark(path) is None:
                    continue
                aside = self.root / aside_name(RETIRED, path.name)
                self._backend.move(path, aside)
                moved.append((path, aside))
        except BaseException:
            self._unretire(moved)
            raise
        log_retired(moved)
        return moved

    def _unretire(self, moved: list[tuple[Location, Location]]) -> None:
        for path, aside in reversed(moved):
            with contextlib.suppress(Exception):
                self._backend.move(aside, path)

    def remove(self, step: int) -> bool:
        """Delete a committed checkpoint: unlist it at once, then delete its files in the
        background (unlinking GBs takes a while; training need not wait);
        :meth:`finish_removals` waits for them.

        Retention calls it after a save committed, which must not raise then: a failure
        (a full disk can refuse even a rename) is logged, the step kept, False returned.
        """
        try:
            doomed = self._backend.unlist(self.step_path(step))
        except CheckpointError as exc:
            logger.warning("%s; step %d is kept, retention tries again at the next save", exc, step)
            return False
        self._deleter.submit(doomed)
        return True

    def finish_removals(self) -> None:
        """Wait for the deletions :meth:`remove` started."""
        self._deleter.finish()

    # -- leftovers -----------------------------------------------------------------------

    def clean_leftovers(self) -> list[str]:
        """Remove what crashed, losing or half-deleted saves left, and put back the old
        copy of a re-saved step whose new copy never committed (or delete it once it
        did). Call it holding :meth:`save_lock`, so no save in progress loses its files.
        Returns what was removed."""
        return self._clean(self._backend.leftovers())

    def clean_leftovers_if_idle(self) -> list[str]:
        """A reader's :meth:`clean_leftovers`: only while no save is under way, never
        taking the save lock.

        The leftovers are listed *before* asking whether a save holds the lock: one
        listed then, while no save held it, belongs to no save still running (a save
        makes its files holding the lock, and commits or removes them before it lets
        go), so a save that starts meanwhile loses nothing. Without locks nothing is
        removed (nothing tells a reader when it is safe): the old copy of a re-saved step
        whose new copy never committed is put back, create-only, so that a restore finds
        it; a re-save still running goes on (:meth:`commit`).
        """
        if not self.has_locks:
            for name in self._names():
                if name.startswith(REPLACED):
                    self._recover(self.root / name, remove=False)
            return []
        found = self._backend.leftovers()
        if not found or self._backend.saving_now():
            return []
        return self._clean(found)

    def _clean(self, found: list[str]) -> list[str]:
        for name in found:
            if name.startswith(REPLACED):
                self._recover(self.root / name, remove=True)
        removed = self._backend.remove_leftovers([n for n in found if not n.startswith(REPLACED)])
        if removed:
            logger.info("removed %d leftover(s) of crashed saves in %s", len(removed), self.root)
        return removed

    def _recover(self, aside: Location, *, remove: bool) -> None:
        """``aside`` is the old copy of a re-saved step (``.replaced-step_*-<id>``): put it
        back if the step is not committed (the save died between setting it aside and
        committing the new copy); else delete it (``remove``: a saver or an idle reader)
        once the step is committed again, and leave it if the step there is damaged."""
        original = aside_target(aside.name, REPLACED)
        if original is None:
            return
        final = self.root / original
        if not self._backend.holds(aside):
            return  # the copy aside never completed (a store): the step was never unlisted
        if not self._backend.holds(final):
            try:
                self._backend.move(aside, final)  # create-only, or fails if another was first
            except OSError:
                return
            logger.warning("put back %s: a re-save of it did not complete", final)
        elif remove and final.has_file(MANIFEST):
            self._backend.delete_tree(aside)

    # -- helpers -------------------------------------------------------------------------

    def _names(self) -> list[str]:
        try:
            return self._backend.names()
        except (FileNotFoundError, NotADirectoryError):
            return []
