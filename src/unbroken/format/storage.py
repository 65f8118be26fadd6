"""Checkpoint directory layout: committed steps, partial saves, atomic commit, removal.

::

    DIR/step_00000200/          a committed checkpoint (it has manifest.json)
    DIR/.partial-<step>-<id>/   a save in progress: never listed, never loaded
    DIR/.trash-<step>-<id>/     a checkpoint being deleted: never listed
    DIR/.retired-<step>-<id>/   a checkpoint of an abandoned branch: never listed, kept

A save writes everything into a partial directory, writes ``manifest.json`` last, then
renames the directory into place: the rename is the commit. A crash at any instant
leaves either the old set of committed steps or the new one. The first save after a
resume from an older step first renames the abandoned newer steps aside (retires them),
newest first, then commits: a crash in between leaves the old branch (or the step
resumed from) the newest, as if the save had not started.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..errors import CheckpointError

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LOCK = ".lock"
RETIRED = ".retired-"
_STEP_RE = re.compile(r"^step_(\d{8,})$")
_FOREIGN_MARKERS = (".metadata", ".distcp", ".pt", ".pth", ".ckpt", ".safetensors", ".bin")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def folder_step(path: str | os.PathLike) -> int | None:
    """The step a folder's name says (``step_00000200`` -> 200), or None."""
    m = _STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointDir:
    """The root folder of one training run's checkpoints (a local path)."""

    def __init__(self, root: str | os.PathLike) -> None:
        text = os.fspath(root)
        if "://" in text:
            if not text.startswith("file://"):
                raise ValueError(
                    f"path {text!r}: only local paths (or file:// URLs) are supported so far"
                )
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
            if m and (entry / MANIFEST).is_file():
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
            if m and entry.is_dir() and not (entry / MANIFEST).is_file():
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

    @contextlib.contextmanager
    def save_lock(self) -> Iterator[None]:
        """Hold the folder's save lock (one saver at a time); fail at once if taken.

        Two jobs saving into one folder (a misconfigured relaunch) would otherwise clean
        up or overwrite each other's work; the loser gets a clear error instead.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
                raise CheckpointError(
                    f"another save into {self.root} is in progress ({holder}); two jobs "
                    "must not share a checkpoint folder: stop the other job or use another path"
                ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
            yield
        finally:
            os.close(fd)

    def new_partial(self, step: int) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f".partial-{step_dir_name(step)}-{uuid.uuid4().hex[:12]}"
        path.mkdir()
        return path

    def commit(self, partial: Path, step: int, *, retire: Sequence[int] = ()) -> Path:
        """Make ``partial`` the committed checkpoint of ``step`` (atomic rename).

        ``retire``: committed steps of an abandoned branch, renamed aside first (see
        :meth:`retire`); if the commit then fails, they are put back.
        """
        retired = self.retire(retire)
        try:
            return self._commit(partial, step)
        except BaseException:
            self._unretire(retired)
            raise

    def _commit(self, partial: Path, step: int) -> Path:
        final = self.step_path(step)
        trash = None
        if final.exists():
            # Re-saving a step (after resuming from an older one): the old copy stays
            # committed until the new one is complete, then is swapped out.
            trash = self.root / f".trash-{final.name}-{uuid.uuid4().hex[:12]}"
            os.rename(final, trash)
            logger.warning("replacing the existing checkpoint of step %d", step)
        os.rename(partial, final)
        _fsync_dir(self.root)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        return final

    def retire(self, steps: Sequence[int]) -> list[tuple[Path, Path]]:
        """Unlist committed ``steps`` by renaming them to ``.retired-step_*-<id>``.

        They are kept (never listed, loaded or cleaned up) so nothing is lost silently;
        returns (old, new) paths. Steps no longer committed are passed over.
        """
        moved = []
        # Newest first: a crash midway leaves a prefix of the old branch listed, which
        # restores like a crash before this save.
        for s in sorted(steps, reverse=True):
            path = self.step_path(s)
            if not (path / MANIFEST).is_file():
                continue
            aside = self.root / f"{RETIRED}{path.name}-{uuid.uuid4().hex[:12]}"
            os.rename(path, aside)
            moved.append((path, aside))
        if moved:
            _fsync_dir(self.root)  # unlisted before the new branch's commit is visible
            logger.warning(
                "retired %s of an abandoned branch: kept as %s",
                ", ".join(path.name for path, _ in moved),
                ", ".join(aside.name for _, aside in moved),
            )
        return moved

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

    def remove(self, step: int) -> None:
        """Delete a committed checkpoint: un-list it atomically first, then delete its
        files in a background thread (unlinking GBs takes a while; training need not
        wait). :meth:`finish_removals` waits for them."""
        path = self.step_path(step)
        trash = self.root / f".trash-{path.name}-{uuid.uuid4().hex[:12]}"
        os.rename(path, trash)
        _fsync_dir(self.root)
        worker = threading.Thread(
            target=shutil.rmtree, args=(trash, True), name="unbroken-delete", daemon=False
        )
        worker.start()
        self._removals = [t for t in self._removals if t.is_alive()] + [worker]

    def finish_removals(self) -> None:
        for worker in self._removals:
            worker.join()
        self._removals = []

    def discard(self, partial: Path) -> None:
        shutil.rmtree(partial, ignore_errors=True)

    def clean_leftovers(self) -> list[str]:
        """Remove partial saves and half-deleted checkpoints left by a crash.

        Call it holding :meth:`save_lock`, so no save in progress loses its folder.
        """
        if not self.root.is_dir():
            return []
        removed = []
        for entry in self.root.iterdir():
            if entry.name.startswith((".partial-", ".trash-")) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
        if removed:
            logger.info("removed %d leftover partial save(s) in %s", len(removed), self.root)
        return removed

    def clean_leftovers_if_idle(self) -> list[str]:
        """:meth:`clean_leftovers` unless another process is saving right now."""
        if not self.root.is_dir():
            return []
        try:
            with self.save_lock():
                return self.clean_leftovers()
        except CheckpointError:
            return []
