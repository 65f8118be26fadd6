"""A run folder on a local disk: the ``CheckpointDir`` role (``interface.py``) by rename.

A save writes everything into a partial directory, writes ``manifest.json`` last, then
renames the directory into place: the rename is the commit. A crash at any instant
leaves either the old set of committed steps or the new one. The first save after a
resume from an older step first renames the abandoned newer steps aside (retires them),
newest first, then commits: a crash in between leaves the old branch (or the step
resumed from) the newest, as if the save had not started. Re-saving a step swaps the
new copy in atomically where the file system can (``RENAME_EXCHANGE``); elsewhere the
old copy waits aside as ``.replaced-*`` and a crash before the new one is in place is
undone by the next save or restore. (The names: ``names.py``.)

Readers (restores in other processes, the command-line tools) never take the save lock:
they clean leftovers only while no save holds it (:meth:`LocalCheckpointDir.saving_now`
asks without taking it), and a step that a save prunes, retires or replaces while it is
read is re-listed, not reported as damage (``interface.vanished``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
from collections.abc import Iterable, Sequence

from ..errors import CheckpointError
from . import posix
from .local_files import LocalPath
from .names import (
    FOREIGN_MARKERS,
    LEFTOVERS,
    LOCK,
    MANIFEST,
    PARTIAL,
    REPLACED,
    RETIRED,
    RUN_LOCK,
    TRASH,
    aside_name,
    aside_step,
    aside_target,
    log_retired,
    step_dir_name,
    step_of,
)
from .posix import SAVE_FIX as _FIX
from .posix import fsync_dir, writing

logger = logging.getLogger(__name__)


class LocalCheckpointDir:
    """The root folder of one training run's checkpoints on a local disk.

    Thread-safe for one saver (it holds the save lock) and any number of readers.
    """

    remote = False

    def __init__(self, root: str | os.PathLike) -> None:
        text = os.fspath(root)
        if "://" in text:
            text = text.removeprefix("file://")
        self.root = LocalPath(text)
        self._removals: list[threading.Thread] = []
        self._entry_synced = False  # the run folder's entry in its parent (save_lock)
        if self.root.exists() and not self.root.is_dir():
            raise CheckpointError(
                f"{self.root} is a file, not a checkpoint directory; pass the folder that "
                "holds step_* checkpoints (or a new folder to start one)"
            )

    def step_path(self, step: int) -> LocalPath:
        return self.root / step_dir_name(step)

    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            step = step_of(entry.name)
            if step is not None and entry.has_file(MANIFEST) is not False:
                found.append(step)
        return sorted(found)

    def steps_without_manifest(self) -> list[int]:
        """Steps whose ``step_*`` folder has no manifest.json, ascending.

        A save never leaves one (the commit renames a folder that already holds its
        manifest), so the manifest was lost or deleted: the checkpoint is damaged. It is
        never listed among :meth:`steps` nor restored; callers report it.
        """
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            step = step_of(entry.name)
            # Asked twice around is_dir(): a step pruned or committed by a concurrent save
            # between the questions is never mistaken for one that lost its manifest.
            lost = step is not None and entry.has_file(MANIFEST) is False and entry.is_dir()
            if lost and entry.has_file(MANIFEST) is False:
                found.append(step)
        return sorted(found)

    def step_marks(self) -> dict[int, str]:
        """Committed steps, each with its manifest's identity (inode, size, modification
        time): every commit writes a new manifest, and renames (retiring a step, putting
        it back) keep it."""
        if not self.root.is_dir():
            return {}
        found = {}
        for entry in self.root.iterdir():
            step = step_of(entry.name)
            mark = _manifest_mark(entry) if step is not None else None
            if mark is not None:
                found[step] = mark
        return found

    def step_mark(self, step: int) -> str | None:
        return _manifest_mark(self.step_path(step))

    def run_lock(self) -> posix.RunLock:
        return posix.RunLock(self.root, self.root / RUN_LOCK)

    def check_not_foreign(self) -> None:
        if not self.root.is_dir() or self.steps():
            return
        foreign = sorted(p.name for p in self.root.iterdir() if p.name.endswith(FOREIGN_MARKERS))
        if foreign:
            raise CheckpointError(
                f"{self.root} holds no unbroken checkpoint but has other checkpoint files "
                f"({', '.join(foreign[:5])}); point Checkpointer at an empty or unbroken "
                "folder, or bring those files in with `unbroken import`"
            )

    def save_lock(self) -> contextlib.AbstractContextManager[None]:
        """Hold the folder's save lock (one saver at a time); fail at once if taken.

        Two jobs saving into one folder (a misconfigured relaunch) would otherwise clean
        up or overwrite each other's work; the loser gets a clear error instead. Readers
        never take it (see :meth:`saving_now`). A new run folder is made here, its entry
        (and those of new folders above it) fsynced in its parent: it holds every commit.
        """
        if not self._entry_synced:
            with writing(self.root, "creating", _FIX):
                _make_dirs_synced(self.root)
                fsync_dir(self.root.parent)
            self._entry_synced = True
        return posix.save_lock(self.root, self.root / LOCK, _FIX)

    def saving_now(self) -> bool:
        """Whether a save holds the save lock right now, asked without taking it (so a
        reader never makes a save fail). True when it cannot be told."""
        return posix.saving_now(self.root / LOCK)

    def token(self, partial: LocalPath) -> str:
        return str(partial)

    def from_token(self, text: str) -> LocalPath:
        return LocalPath(text)

    def shard_name(self, partial: LocalPath, rank: int) -> str:
        return f"rank_{rank:05d}.bin"

    def listdir(self) -> list[str]:
        return sorted(os.listdir(self.root))

    def is_folder(self, name: str) -> bool:
        return (self.root / name).is_dir()

    def new_partial(self, step: int) -> LocalPath:
        path = self.root / aside_name(PARTIAL, step_dir_name(step))
        with writing(path, "creating", _FIX):
            self.root.mkdir(parents=True, exist_ok=True)
            path.mkdir()
            fsync_dir(self.root)  # the partial folder's entry: its rename needs it there
        return path

    def commit(
        self, partial: LocalPath, step: int, *, retire: Sequence[int] = (), manifest: bytes = b""
    ) -> LocalPath:
        """Write ``manifest`` (its bytes; if given) into ``partial`` and make it the
        committed checkpoint of ``step`` (atomic rename).

        ``retire``: committed steps of an abandoned branch, renamed aside first (see
        :meth:`retire`); if the commit then fails, they are put back. Raises
        ``CheckpointError`` (naming the path and the free space) having committed
        nothing, or returns the committed folder.
        """
        if manifest:
            posix.write_synced(partial / MANIFEST, manifest, _FIX)
        with writing(partial, "committing", _FIX):
            fsync_dir(partial)  # its files' entries, before the rename commits them
        retired = self.retire(retire)
        try:
            with writing(partial, "committing", _FIX):
                return self._commit(partial, step)
        except BaseException:
            self._unretire(retired)
            raise

    def _commit(self, partial: LocalPath, step: int) -> LocalPath:
        final = self.step_path(step)
        if not os.path.lexists(final):
            os.rename(partial, final)
            self._durable(lambda: os.rename(final, partial))
            return final
        # Re-saving a step: the old copy stays committed until the new one is.
        logger.warning("replacing the existing checkpoint of step %d", step)
        if posix.exchange(partial, final):  # one atomic step; partial holds the old
            self._durable(lambda: posix.exchange(partial, final))
            shutil.rmtree(partial, ignore_errors=True)
            return final
        # No exchange on this file system: the old copy waits aside until the new one is
        # in place; a crash in between is undone by the next save or restore (_recover).
        aside = self.root / aside_name(REPLACED, final.name)
        os.rename(final, aside)
        try:
            os.rename(partial, final)
        except BaseException:
            os.rename(aside, final)
            raise

        def undo() -> None:
            os.rename(final, partial)
            os.rename(aside, final)

        self._durable(undo)
        shutil.rmtree(aside, ignore_errors=True)
        return final

    def _durable(self, undo) -> None:
        """Fsync the folder after a commit's renames. If that fails the commit is not
        known to be durable: undo the renames, so that a failed save commits nothing."""
        try:
            fsync_dir(self.root)
        except BaseException:
            with contextlib.suppress(OSError):
                undo()
            raise

    def retire(self, steps: Sequence[int]) -> list[tuple[LocalPath, LocalPath]]:
        """Unlist committed ``steps`` by renaming them to ``.retired-step_*-<id>``.

        They are kept (never listed, loaded or cleaned up) so nothing is lost silently;
        returns (old, new) paths. Steps no longer committed are passed over.
        """
        moved: list[tuple[LocalPath, LocalPath]] = []
        try:
            with writing(self.root, "retiring abandoned steps in", _FIX):
                # Newest first: a crash midway leaves a prefix of the old branch listed,
                # which restores like a crash before this save.
                for s in sorted(steps, reverse=True):
                    path = self.step_path(s)
                    if not (path / MANIFEST).is_file():
                        continue
                    aside = self.root / aside_name(RETIRED, path.name)
                    os.rename(path, aside)
                    moved.append((path, aside))
                if moved:
                    fsync_dir(self.root)  # unlisted before the new branch's commit is visible
        except BaseException:
            self._unretire(moved)
            raise
        log_retired(moved)
        return moved

    def _unretire(self, moved: list[tuple[LocalPath, LocalPath]]) -> None:
        for path, aside in reversed(moved):
            with contextlib.suppress(OSError):
                os.rename(aside, path)

    def retired(self) -> list[tuple[int, LocalPath]]:
        found = []
        for entry in self.root.iterdir() if self.root.is_dir() else ():
            step = aside_step(entry.name, RETIRED)
            if step is not None and entry.is_dir():
                found.append((step, entry))
        return sorted(found)

    def remove(self, step: int) -> bool:
        """Delete a committed checkpoint: un-list it atomically first, then delete its
        files in a background thread (unlinking GBs takes a while; training need not
        wait). :meth:`finish_removals` waits for them.

        Retention calls it after a save committed, which must not raise then: a failure
        (a full disk can refuse even a rename) is logged, the step kept, and False returned.
        """
        path = self.step_path(step)
        trash = self.root / aside_name(TRASH, path.name)
        try:
            with writing(path, "removing", "it is kept; retention tries again next save"):
                os.rename(path, trash)
        except CheckpointError as exc:
            logger.warning("%s", exc)
            return False
        with contextlib.suppress(OSError):  # if it comes back after a power loss: harmless
            fsync_dir(self.root)
        worker = threading.Thread(
            target=shutil.rmtree, args=(trash, True), name="unbroken-delete", daemon=False
        )
        worker.start()
        self._removals = [t for t in self._removals if t.is_alive()] + [worker]
        return True

    def finish_removals(self) -> None:
        for worker in self._removals:
            worker.join()
        self._removals = []

    def discard(self, partial: LocalPath) -> None:
        shutil.rmtree(partial, ignore_errors=True)

    def clean_leftovers(self) -> list[str]:
        """Remove partial saves and half-deleted checkpoints left by a crash, and put back
        the old copy of a re-saved step if a crash came before the new one was in place.

        Call it holding :meth:`save_lock`, so no save in progress loses its folder.
        """
        return self._clean(self._leftovers())

    def clean_leftovers_if_idle(self) -> list[str]:
        """:meth:`clean_leftovers` unless a save is in progress; never takes the save lock.

        The leftovers are listed *before* asking whether a save holds the lock: a folder
        listed then, while no save held it, belongs to no save that is still running
        (a save creates its folders holding the lock, and commits or removes them before
        it lets go), so a save that starts meanwhile loses nothing.
        """
        entries = self._leftovers()
        if not entries or self.saving_now():
            return []
        return self._clean(entries)

    def _leftovers(self) -> list[LocalPath]:
        if not self.root.is_dir():
            return []
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        return [self.root / n for n in sorted(names) if n.startswith((*LEFTOVERS, REPLACED))]

    def _clean(self, entries: Iterable[LocalPath]) -> list[str]:
        removed = []
        for entry in entries:
            if entry.name.startswith(REPLACED):
                self._recover(entry)
            elif entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
        if removed:
            logger.info("removed %d leftover partial save(s) in %s", len(removed), self.root)
        return removed

    def _recover(self, aside: LocalPath) -> None:
        """``aside`` is the old copy of a re-saved step (.replaced-step_*-<id>): put it
        back if the step is missing (the save died between its two renames), delete it
        once the step is committed again; leave it if the step is there but damaged."""
        original = aside_target(aside.name, REPLACED)
        if original is None:
            return
        final = self.root / original
        if not os.path.lexists(final):
            try:
                os.rename(aside, final)  # fails harmlessly if another process was first
                fsync_dir(self.root)
            except OSError:
                return
            logger.warning("put back %s: a re-save of it did not complete", final)
        elif final.has_file(MANIFEST):
            shutil.rmtree(aside, ignore_errors=True)


def _make_dirs_synced(path: LocalPath) -> None:
    """``mkdir -p path``, each new folder's entry fsynced in its parent: without ordered
    journalling a power loss could lose a new run folder, and every commit in it."""
    missing, here = [], path
    while not os.path.isdir(here) and here.parent != here:
        missing.append(here)
        here = here.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another rank or job made it
            os.mkdir(folder)
        fsync_dir(folder.parent)


def _manifest_mark(folder: LocalPath) -> str | None:
    """The identity of ``folder``'s manifest (None: it has none); ``"?"`` if it cannot
    be told (no permission), which is then judged by reading it."""
    try:
        st = os.lstat(folder / MANIFEST)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:
        return "?"
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
