"""Checkpoint directory layout: committed steps, partial saves, atomic commit, removal.

::

    DIR/step_00000200/          a committed checkpoint (it has manifest.json)
    DIR/.partial-<step>-<id>/   a save in progress: never listed, never loaded
    DIR/.trash-<step>-<id>/     a checkpoint being deleted: never listed
    DIR/.retired-<step>-<id>/   a checkpoint of an abandoned branch: never listed, kept
    DIR/.replaced-<step>-<id>/  the old copy of a re-saved step, until the new one commits

A save writes everything into a partial directory, writes ``manifest.json`` last, then
renames the directory into place: the rename is the commit. A crash at any instant
leaves either the old set of committed steps or the new one. The first save after a
resume from an older step first renames the abandoned newer steps aside (retires them),
newest first, then commits: a crash in between leaves the old branch (or the step
resumed from) the newest, as if the save had not started. Re-saving a step swaps the
new copy in atomically where the file system can (``RENAME_EXCHANGE``); elsewhere the
old copy waits aside as ``.replaced-*`` and a crash before the new one is in place is
undone by the next save or restore.

Readers (restores in other processes, the command-line tools) never take the save lock:
they clean leftovers only while no save holds it (:meth:`CheckpointDir.saving_now` asks
without taking it), and a step that a save prunes, retires or replaces while it is read
is re-listed, not reported as damage (``filesystem.identity``, ``filesystem.vanished``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import threading
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from . import filesystem
from .filesystem import SAVE_FIX as _FIX
from .filesystem import fsync_dir, writing
from .remote import is_url

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LOCK = ".lock"
RETIRED = ".retired-"
REPLACED = ".replaced-"
LEFTOVERS = (".partial-", ".trash-")
_STEP_RE = re.compile(r"^step_(\d{8,})$")
_FOREIGN_MARKERS = (".metadata", ".distcp", ".pt", ".pth", ".ckpt", ".safetensors", ".bin")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def folder_step(path: str | os.PathLike) -> int | None:
    """The step a folder's name says (``step_00000200`` -> 200), or None."""
    m = _STEP_RE.match(getattr(path, "name", None) or Path(path).name)
    return int(m.group(1)) if m else None


def has_manifest(folder: Path) -> bool | None:
    """True if ``folder`` holds manifest.json, False if not; None if that cannot be told
    (no permission): listed then, so that reading it names the unreadable file."""
    try:
        return stat.S_ISREG(os.stat(folder / MANIFEST).st_mode)
    except PermissionError:
        return None
    except OSError:
        return False


class CheckpointDir:
    """The root folder of one training run's checkpoints.

    ``CheckpointDir(path)`` is this local back-end; ``CheckpointDir("s3://...")`` (any
    fsspec URL but ``file://``) is the object-store one, ``remote_dir.RemoteCheckpointDir``:
    the same operations with a manifest-last commit and no rename or lock.
    """

    remote = False

    def __new__(cls, root: str | os.PathLike) -> CheckpointDir:
        if cls is CheckpointDir and is_url(str(root)):
            from .remote_dir import RemoteCheckpointDir  # fsspec is optional

            return super().__new__(RemoteCheckpointDir)
        return super().__new__(cls)

    def __init__(self, root: str | os.PathLike) -> None:
        text = os.fspath(root)
        if "://" in text:
            text = text.removeprefix("file://")
        self.root = Path(text)
        self._removals: list[threading.Thread] = []
        if self.root.exists() and not self.root.is_dir():
            raise CheckpointError(
                f"{self.root} is a file, not a checkpoint directory; pass the folder that "
                "holds step_* checkpoints (or a new folder to start one)"
            )

    def step_path(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            m = _STEP_RE.match(entry.name)
            if m and has_manifest(entry) is not False:
                found.append(int(m.group(1)))
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
            m = _STEP_RE.match(entry.name)
            # Asked twice around is_dir(): a step pruned or committed by a concurrent save
            # between the questions is never mistaken for one that lost its manifest.
            lost = m and has_manifest(entry) is False and entry.is_dir()
            if lost and has_manifest(entry) is False:
                found.append(int(m.group(1)))
        return sorted(found)

    def check_not_foreign(self) -> None:
        """Refuse a folder that holds another tool's checkpoint and none of ours."""
        if not self.root.is_dir() or self.steps():
            return
        foreign = sorted(p.name for p in self.root.iterdir() if p.name.endswith(_FOREIGN_MARKERS))
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
        never take it (see :meth:`saving_now`).
        """
        return filesystem.save_lock(self.root, self.root / LOCK, _FIX)

    def saving_now(self) -> bool:
        """Whether a save holds the save lock right now, asked without taking it (so a
        reader never makes a save fail). True when it cannot be told."""
        return filesystem.saving_now(self.root / LOCK)

    def token(self, partial: Path) -> str:
        """``partial`` as text, for the other ranks (:meth:`from_token`)."""
        return str(partial)

    def from_token(self, text: str) -> Path:
        return Path(text)

    def shard_name(self, partial: Path, rank: int) -> str:
        """The name of ``rank``'s shard file in the partial save ``partial``."""
        return f"rank_{rank:05d}.bin"

    def listdir(self) -> list[str]:
        """The names in the root folder (raises FileNotFoundError if there is none)."""
        return sorted(os.listdir(self.root))

    def is_folder(self, name: str) -> bool:
        return (self.root / name).is_dir()

    def new_partial(self, step: int) -> Path:
        path = self.root / f".partial-{step_dir_name(step)}-{uuid.uuid4().hex[:12]}"
        with writing(path, "creating", _FIX):
            self.root.mkdir(parents=True, exist_ok=True)
            path.mkdir()
        return path

    def commit(
        self, partial: Path, step: int, *, retire: Sequence[int] = (), manifest: bytes = b""
    ) -> Path:
        """Write ``manifest`` (its bytes; if given) into ``partial`` and make it the
        committed checkpoint of ``step`` (atomic rename).

        ``retire``: committed steps of an abandoned branch, renamed aside first (see
        :meth:`retire`); if the commit then fails, they are put back. Raises
        ``CheckpointError`` (naming the path and the free space) having committed
        nothing, or returns the committed folder.
        """
        if manifest:
            filesystem.write_synced(partial / MANIFEST, manifest, _FIX)
        retired = self.retire(retire)
        try:
            with writing(partial, "committing", _FIX):
                return self._commit(partial, step)
        except BaseException:
            self._unretire(retired)
            raise

    def _commit(self, partial: Path, step: int) -> Path:
        final = self.step_path(step)
        if not os.path.lexists(final):
            os.rename(partial, final)
            self._durable(lambda: os.rename(final, partial))
            return final
        # Re-saving a step: the old copy stays committed until the new one is.
        logger.warning("replacing the existing checkpoint of step %d", step)
        if filesystem.exchange(partial, final):  # one atomic step; partial holds the old
            self._durable(lambda: filesystem.exchange(partial, final))
            shutil.rmtree(partial, ignore_errors=True)
            return final
        # No exchange on this file system: the old copy waits aside until the new one is
        # in place; a crash in between is undone by the next save or restore (_recover).
        aside = self.root / f"{REPLACED}{final.name}-{uuid.uuid4().hex[:12]}"
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

    def retire(self, steps: Sequence[int]) -> list[tuple[Path, Path]]:
        """Unlist committed ``steps`` by renaming them to ``.retired-step_*-<id>``.

        They are kept (never listed, loaded or cleaned up) so nothing is lost silently;
        returns (old, new) paths. Steps no longer committed are passed over.
        """
        moved: list[tuple[Path, Path]] = []
        try:
            with writing(self.root, "retiring abandoned steps in", _FIX):
                # Newest first: a crash midway leaves a prefix of the old branch listed,
                # which restores like a crash before this save.
                for s in sorted(steps, reverse=True):
                    path = self.step_path(s)
                    if not (path / MANIFEST).is_file():
                        continue
                    aside = self._retired_path(path)
                    os.rename(path, aside)
                    moved.append((path, aside))
                if moved:
                    fsync_dir(self.root)  # unlisted before the new branch's commit is visible
        except BaseException:
            self._unretire(moved)
            raise
        _log_retired(moved)
        return moved

    def _retired_path(self, path: Path) -> Path:
        """Where retiring the committed step folder ``path`` moves it (a unique name)."""
        return self.root / f"{RETIRED}{path.name}-{uuid.uuid4().hex[:12]}"

    def _unretire(self, moved: list[tuple[Path, Path]]) -> None:
        for path, aside in reversed(moved):
            with contextlib.suppress(OSError):
                os.rename(aside, path)

    def retired(self) -> list[tuple[int, Path]]:
        """Checkpoints retired from abandoned branches: (step, folder), by step."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            m = _STEP_RE.match(entry.name.removeprefix(RETIRED).rsplit("-", 1)[0])
            if entry.name.startswith(RETIRED) and m and entry.is_dir():
                found.append((int(m.group(1)), entry))
        return sorted(found)

    def remove(self, step: int) -> bool:
        """Delete a committed checkpoint: un-list it atomically first, then delete its
        files in a background thread (unlinking GBs takes a while; training need not
        wait). :meth:`finish_removals` waits for them.

        Retention calls it after a save committed, which must not raise then: a failure
        (a full disk can refuse even a rename) is logged, the step kept, and False returned.
        """
        path = self.step_path(step)
        trash = self.root / f".trash-{path.name}-{uuid.uuid4().hex[:12]}"
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

    def discard(self, partial: Path) -> None:
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

    def _leftovers(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        return [self.root / n for n in sorted(names) if n.startswith((*LEFTOVERS, REPLACED))]

    def _clean(self, entries: Iterable[Path]) -> list[str]:
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

    def _recover(self, aside: Path) -> None:
        """``aside`` is the old copy of a re-saved step (.replaced-step_*-<id>): put it
        back if the step is missing (the save died between its two renames), delete it
        once the step is committed again; leave it if the step is there but damaged."""
        final = self.root / aside.name.removeprefix(REPLACED).rsplit("-", 1)[0]
        if _STEP_RE.match(final.name) is None:
            return
        if not os.path.lexists(final):
            try:
                os.rename(aside, final)  # fails harmlessly if another process was first
                fsync_dir(self.root)
            except OSError:
                return
            logger.warning("put back %s: a re-save of it did not complete", final)
        elif has_manifest(final):
            shutil.rmtree(aside, ignore_errors=True)


def _log_retired(moved: Sequence[tuple[Any, Any]]) -> None:
    if moved:
        logger.warning(
            "retired %s of an abandoned branch: kept as %s",
            ", ".join(path.name for path, _ in moved),
            ", ".join(aside.name for _, aside in moved),
        )
