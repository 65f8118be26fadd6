"""A run folder on a local disk: the ``Backend`` role (``backend.py``), committing by rename.

::

    DIR/.partial-<step>-<id>/   a save in progress: never listed, never loaded
    DIR/.trash-<step>-<id>/     a checkpoint being deleted: never listed
    DIR/.lock                   the save lock (one saver at a time)
    DIR/.run-lock               held by the open Checkpointer that records the run

A save writes everything into a partial folder, writes ``manifest.json`` last, fsyncs
them, then renames the folder into place: the rename, fsynced in the run folder, is the
commit. A re-save swaps the new copy in with ``renameat2(RENAME_EXCHANGE)`` where the
file system can. Every rename is fsynced in its folder before it is relied on, and
undone if that fails, so a failed save commits nothing. A step folder without a manifest
is damage here (nothing is ever renamed into place without one). The operating-system
primitives (the exchange, locks, fsync, write errors naming the free space) are in
``posix.py``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Callable, Sequence

from ..errors import CheckpointError
from . import posix
from .local_files import LocalPath
from .names import (
    LEFTOVERS,
    LOCK,
    MANIFEST,
    PARTIAL,
    REPLACED,
    RUN_LOCK,
    TRASH,
    aside_name,
    step_dir_name,
)
from .posix import SAVE_FIX as _FIX
from .posix import fsync_dir, writing

_KEPT = "free space, or lower keep_last"  # a removal that failed: the step stays listed
_RELISTS = 10  # listings of one marks() while saves keep renaming the folders listed
_HOLDERS = ("step_", REPLACED)  # the folders whose manifest marks() looks at


class LocalMedium:
    """The root folder of one training run's checkpoints on a local disk.

    Thread-safe for one saver (it holds the save lock) and any number of readers.

    Raises:
        CheckpointError: ``root`` is a file, not a folder.
    """

    has_locks = True

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = LocalPath(os.fspath(root).removeprefix("file://"))
        self._entry_synced = False  # the run folder's entry in its parent (save_lock)
        if self.root.exists() and not self.root.is_dir():
            raise CheckpointError(
                f"{self.root} is a file, not a checkpoint directory; pass the folder that "
                "holds step_* checkpoints (or a new folder to start one)"
            )

    # -- list and read --------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(os.listdir(self.root))

    def marks(self) -> dict[str, str]:
        """Folders holding a manifest, each with its manifest's identity (inode, size,
        modification time): every commit writes a new manifest, and renames (retiring a
        step, setting it aside, putting it back) keep it.

        A folder listed and gone before its manifest is looked at was pruned, retired or
        replaced meanwhile, and the save that did it committed its new step first, after
        the listing: the folder is listed again, so that a reader racing a pruning writer
        sees the new step or the old one, never none."""
        for _attempt in range(_RELISTS):
            try:
                names = os.listdir(self.root)
            except (FileNotFoundError, NotADirectoryError):
                return {}
            found, stale = {}, False
            for name in names:
                if not name.startswith(_HOLDERS):
                    continue
                mark = _manifest_mark(self.root / name)
                if mark is not None:
                    found[name] = mark
                elif not os.path.lexists(self.root / name):
                    stale = True
            if not stale:
                break
        return found

    def mark(self, folder: LocalPath) -> str | None:
        return _manifest_mark(folder)

    def holds(self, folder: LocalPath) -> bool:
        return os.path.lexists(folder)

    def read(self, file: LocalPath) -> bytes | None:
        try:
            fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            return None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", str(file))
            return f.read()

    # -- move and delete ------------------------------------------------------------

    def move(self, src: LocalPath, dst: LocalPath) -> None:
        with writing(src, "moving", _FIX):
            os.rename(src, dst)
            self._durable(lambda: os.rename(dst, src))

    def delete_tree(self, folder: LocalPath) -> None:
        shutil.rmtree(folder, ignore_errors=True)

    def _durable(self, undo: Callable[[], object]) -> None:
        """Fsync the run folder after a rename. If that fails the rename is not known to
        be durable: undo it, so that a failed save commits nothing."""
        try:
            fsync_dir(self.root)
        except BaseException:
            with contextlib.suppress(OSError):
                undo()
            raise

    # -- locks ----------------------------------------------------------------------

    def save_lock(self) -> contextlib.AbstractContextManager[None]:
        """The save lock (``posix.save_lock``). A new run folder is made here, its entry
        (and those of new folders above it) fsynced in its parent: it holds every
        commit."""
        if not self._entry_synced:
            with writing(self.root, "creating", _FIX):
                _make_dirs_synced(self.root)
                fsync_dir(self.root.parent)
            self._entry_synced = True
        return posix.save_lock(self.root, self.root / LOCK, _FIX)

    def saving_now(self) -> bool:
        return posix.saving_now(self.root / LOCK)

    def run_lock(self) -> posix.RunLock:
        return posix.RunLock(self.root, self.root / RUN_LOCK)

    # -- the commit: a partial folder renamed into place ----------------------------

    def new_partial(self, step: int) -> LocalPath:
        path = self.root / aside_name(PARTIAL, step_dir_name(step))
        with writing(path, "creating", _FIX):
            self.root.mkdir(parents=True, exist_ok=True)
            path.mkdir()
            fsync_dir(self.root)  # the partial folder's entry: its rename needs it there
        return path

    def token(self, partial: LocalPath) -> str:
        return str(partial)

    def from_token(self, text: str) -> LocalPath:
        return LocalPath(text)

    def shard_name(self, partial: LocalPath, rank: int) -> str:
        return f"rank_{rank:05d}.bin"

    def seal(self, partial: LocalPath, manifest: bytes) -> None:
        if manifest:
            posix.write_synced(partial / MANIFEST, manifest, _FIX)
        with writing(partial, "committing", _FIX):
            fsync_dir(partial)  # its files' entries, before the rename commits them

    def publish(self, partial: LocalPath, final: LocalPath, step: int, manifest: bytes) -> None:
        with writing(partial, "committing", _FIX):
            os.rename(partial, final)
            self._durable(lambda: os.rename(final, partial))

    def swap(self, partial: LocalPath, final: LocalPath) -> bool:
        with writing(partial, "committing", _FIX):
            if not posix.exchange(partial, final):
                return False
            self._durable(lambda: posix.exchange(partial, final))
        return True

    def discard(self, partial: LocalPath) -> None:
        shutil.rmtree(partial, ignore_errors=True)

    def unlist(self, folder: LocalPath) -> LocalPath:
        trash = self.root / aside_name(TRASH, folder.name)
        with writing(folder, "removing", _KEPT):
            os.rename(folder, trash)
        with contextlib.suppress(OSError):  # if it comes back after a power loss: harmless
            fsync_dir(self.root)
        return trash

    def leftovers(self) -> list[str]:
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        return [n for n in sorted(names) if n.startswith((*LEFTOVERS, REPLACED))]

    def remove_leftovers(self, names: Sequence[str]) -> list[str]:
        removed = []
        for name in names:
            entry = self.root / name
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(name)
        return removed


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
    """The identity of ``folder``'s manifest: None if it has none (not a plain file, as
    ``LocalPath.has_file`` judges), ``"?"`` if it cannot be told (no permission), which is
    then judged by reading it."""
    try:
        st = os.stat(folder / MANIFEST)
    except PermissionError:
        return "?"
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
