"""A checkpoint directory on an object store: the commit protocol without rename or locks.

::

    URL/step_00000200/manifest.json           the commit record, written last
    URL/step_00000200/rank_00000-<save>.bin   shard objects, named for the save that wrote them
    URL/.retired-step_*-<id>/                 an abandoned branch's checkpoint (copied aside)
    URL/.replaced-step_*-<id>/                the old copy of a re-saved step, until the new
                                              one commits

Every rank uploads its shard straight to its final key, under a name that carries the
save's id, so two saves of one step (a relaunch racing a zombie job) never write the same
object. Once every rank's upload has completed, rank 0 writes ``manifest.json`` with a
create-only write (``If-None-Match: *`` on S3): the write is the commit, and of two
saves of one step only one can make it; the other fails naming the step and removes its
own objects. A step is listed only if its manifest exists, so an upload cut off at any
instant is never listed. A save finding the step committed replaces it only if its own
run wrote it (the lineage says: ``commit``); another job's is refused, never moved. Every
move (retire, replace, put back) writes its manifest create-only too, so it never lands
on another save's commit, and a restore puts back a replaced copy whose re-save died.

Objects under a step that its manifest does not list (a crashed or losing save's) and
step folders without a manifest are removed by a later save once they are older than
``UNBROKEN_STALE_UPLOAD_S`` seconds (default 3600): there is no lock to tell an
abandoned upload from one in progress, so age tells. Readers never remove anything.
Deleting a checkpoint deletes its manifest first (unlisted at once), then its objects.
There is no run lock either (:class:`NoRunLock` is never held): which job owns a prefix is
told by its committed steps alone (``core/ownership.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from ..env import env_number
from ..errors import CheckpointError
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
from .store_path import StorePath

logger = logging.getLogger(__name__)
STALE_ENV = "UNBROKEN_STALE_UPLOAD_S"
_SHARD_RE = re.compile(r"^rank_\d{5}-([0-9a-f]{12})\.bin$")


def stale_after() -> float:
    return env_number(STALE_ENV, 3600, 0)


class StoreCheckpointDir:
    """The root of one run's checkpoints on an object store (any fsspec URL): the
    ``CheckpointDir`` role (``interface.py``); see the module docstring for how each
    operation is done without rename or locks. Thread-safe as far as the store client is.
    """

    remote = True

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = StorePath.parse(str(root))
        self._removals: list[threading.Thread] = []
        if self.root.store.info(self.root.key) is not None:
            raise CheckpointError(
                f"{self.root} is an object, not a checkpoint folder; pass the prefix that "
                "holds step_* checkpoints (or a new one to start)"
            )

    @property
    def store(self):
        return self.root.store

    def step_path(self, step: int) -> StorePath:
        return self.root / step_dir_name(step)

    def _objects(self) -> dict[str, dict[str, Any]]:
        return self.store.listing(self.root.key)

    def steps(self) -> list[int]:
        return sorted(self.step_marks())

    def step_marks(self) -> dict[int, str]:
        """Committed steps, each with its manifest's identity (ETag), which a re-save
        changes: one listing."""
        return _marks(self._objects())

    def step_mark(self, step: int) -> str | None:
        # From a listing, as step_marks() takes them: a lookup (HEAD) gives the same
        # identity in another spelling on some stores (quoted ETags, datetimes).
        info = self.store.listing(self.step_path(step).key).get(MANIFEST)
        return None if info is None else str(info.get("etag"))

    def run_lock(self) -> NoRunLock:
        return NoRunLock()

    def steps_without_manifest(self) -> list[int]:
        # On a store a step folder without a manifest is an upload in progress or an
        # abandoned one, never a damaged checkpoint (nothing is renamed into place).
        return []

    def listdir(self) -> list[str]:
        return sorted({rel.partition("/")[0] for rel in self._objects()})

    def is_folder(self, name: str) -> bool:
        return any(rel.startswith(f"{name}/") for rel in self._objects())

    def check_not_foreign(self) -> None:
        names = self.listdir()
        if any(step_of(n) is not None for n in names) and self.steps():
            return
        foreign = [n for n in names if n.endswith(FOREIGN_MARKERS)]
        if foreign:
            raise CheckpointError(
                f"{self.root} holds no unbroken checkpoint but has other checkpoint files "
                f"({', '.join(foreign[:5])}); point Checkpointer at an empty or unbroken "
                "prefix, or bring those files in with `unbroken import`"
            )

    @contextlib.contextmanager
    def save_lock(self) -> Iterator[None]:
        # Object stores have no locks: the conditional manifest write decides (commit).
        yield

    def saving_now(self) -> bool:
        return False

    def new_partial(self, step: int) -> StorePath:
        return StorePath(self.store, self.step_path(step).key, tag=uuid.uuid4().hex[:12])

    def token(self, partial: Any) -> str:
        return f"{partial}#{partial.tag}"

    def from_token(self, text: str) -> StorePath:
        url, _, tag = text.rpartition("#") if "#" in text else (text, "", "")
        return StorePath(self.store, StorePath.parse(url).key, tag=tag or None)

    def shard_name(self, partial: Any, rank: int) -> str:
        return f"rank_{rank:05d}-{partial.tag}.bin"

    # -- commit ------------------------------------------------------------------------

    def commit(
        self, partial: Any, step: int, *, retire: Sequence[int] = (), manifest: bytes = b""
    ) -> StorePath:
        """Commit by writing ``manifest`` (its bytes) last, create-only. Retired steps
        are unlisted first and put back if the commit fails. A committed ``step`` there
        already is replaced only if this run wrote it (:meth:`_check_replaceable`)."""
        retired = self.retire(retire)
        final = self.step_path(step)
        aside = None
        try:
            for _attempt in range(3):
                old = final.manifest_bytes()
                if old is not None:
                    self._check_replaceable(final, step, old, manifest)
                    logger.warning("replacing the existing checkpoint of step %d", step)
                    moved = self.root / aside_name(REPLACED, final.name)
                    final.move_checkpoint(moved)
                    aside = moved
                try:
                    self._put_manifest(final, step, manifest)
                    break
                except CheckpointError:
                    # A restore that found the step unlisted put the old copy back: go
                    # again. Anything else there is another save's commit: refused.
                    if old is None or final.manifest_bytes() != old:
                        raise
                    aside = None
            else:
                raise CheckpointError(
                    f"step {step} at {final} was put back 3 times by restores while this "
                    "save replaced it; save again"
                )
        except BaseException:
            if aside is not None:
                with contextlib.suppress(Exception):
                    aside.move_checkpoint(final)  # create-only: never over another save's
            self._unretire(retired)
            raise
        if aside is not None:
            aside.delete_all()
        return final

    def _check_replaceable(self, final: StorePath, step: int, old: bytes, new: bytes) -> None:
        """Refuse to replace the committed ``step`` (manifest bytes ``old``) unless the
        run saving ``new`` wrote it: its last lineage event (a segment: one
        Checkpointer's start or resume) is one of ``new``'s. An unreadable manifest is
        no run's (a damaged step, replaced as before)."""
        theirs, ours = _lineage(old), _lineage(new)
        if theirs is None or ours is None:
            return
        last = theirs[-1]
        if last.get("segment") is not None:
            if last["segment"] in {e.get("segment") for e in ours}:
                return
        elif ours[: len(theirs)] == theirs:
            return
        run = (theirs[0] or {}).get("run", "unknown")
        raise CheckpointError(
            f"another save committed step {step} at {final} (run {run}, segment "
            f"{last.get('segment', 'unknown')}) while this one was uploading: two jobs "
            "must not share a checkpoint prefix. This save's objects were removed and the "
            "other save's checkpoint is kept; stop the other job or use another path"
        )

    def _put_manifest(self, final: StorePath, step: int, data: bytes) -> None:
        key = (final / MANIFEST).key
        try:
            self.store.put(key, data, create=True)
        except FileExistsError:
            with contextlib.suppress(Exception):
                if self.store.read(key) == data:
                    return  # our own write, whose answer was lost and which was retried
            raise CheckpointError(
                f"another save committed step {step} at {final} while this one was "
                "uploading: two jobs must not share a checkpoint prefix. This save's "
                "objects were removed and the other save's checkpoint is kept; stop the "
                "other job or use another path"
            ) from None

    def retire(self, steps: Sequence[int]) -> list[tuple[Any, Any]]:
        moved: list[tuple[Any, Any]] = []
        try:
            for s in sorted(steps, reverse=True):  # newest first, as on disk
                path = self.step_path(s)
                if self.store.info((path / MANIFEST).key) is None:
                    continue
                aside = self.root / aside_name(RETIRED, path.name)
                path.move_checkpoint(aside)
                moved.append((path, aside))
        except BaseException:
            self._unretire(moved)
            raise
        log_retired(moved)
        return moved

    def _unretire(self, moved: list[tuple[Any, Any]]) -> None:
        for path, aside in reversed(moved):
            with contextlib.suppress(Exception):
                aside.move_checkpoint(path)

    def retired(self) -> list[tuple[int, Any]]:
        found = []
        for name in self.listdir():
            step = aside_step(name, RETIRED)
            if step is not None:
                found.append((step, self.root / name))
        return sorted(found, key=lambda x: (x[0], str(x[1])))

    # -- removal and clean-up ------------------------------------------------------------

    def remove(self, step: int) -> bool:
        path = self.step_path(step)
        try:
            self.store.delete([(path / MANIFEST).key])  # unlisted: the rest is garbage
        except CheckpointError as exc:
            logger.warning("%s; it is kept, retention tries again next save", exc)
            return False
        worker = threading.Thread(
            target=self._delete_quietly, args=(path,), name="unbroken-delete", daemon=False
        )
        worker.start()
        self._removals = [t for t in self._removals if t.is_alive()] + [worker]
        return True

    def _delete_quietly(self, folder: StorePath) -> None:
        try:
            folder.delete_all()
        except CheckpointError as exc:  # the next save's clean-up removes what is left
            logger.warning("%s", exc)

    def finish_removals(self) -> None:
        for worker in self._removals:
            worker.join()
        self._removals = []

    def discard(self, partial: Any) -> None:
        suffix = f"-{partial.tag}.bin"
        listed = self.store.listing(partial.key)
        with contextlib.suppress(CheckpointError):
            self.store.delete([(partial / r).key for r in listed if r.endswith(suffix)])

    def clean_leftovers(self) -> list[str]:
        """Remove what crashed, losing or half-deleted saves left, once older than
        ``UNBROKEN_STALE_UPLOAD_S``; put back the old copy of a re-saved step whose new
        copy never committed. Returns the removed objects' names."""
        objects = self._objects()
        by_folder: dict[str, dict[str, dict[str, Any]]] = {}
        for rel, info in objects.items():
            top, _, rest = rel.partition("/")
            by_folder.setdefault(top, {})[rest] = info
        limit = stale_after()
        removed: list[str] = []
        for top, members in sorted(by_folder.items()):
            if top.startswith(REPLACED):
                self._recover(self.root / top)
                continue
            if step_of(top) is None:
                continue
            folder = self.root / top
            saves = {shard_save_id(r) for r in members if r != MANIFEST}
            if MANIFEST in members and len(saves) <= 1 and None not in saves:
                continue  # one save's objects and its manifest: nothing left over
            keep = set(folder.listed_files()) | {MANIFEST} if MANIFEST in members else set()
            stale = [r for r, i in members.items() if r not in keep and i["age"] >= limit]
            self.store.delete([(folder / r).key for r in stale])
            removed += [f"{top}/{r}" for r in stale]
        removed += self.store.abort_stale_uploads(self.root.key, limit)
        if removed:
            logger.info("removed %d leftover object(s) in %s", len(removed), self.root)
        return removed

    def clean_leftovers_if_idle(self) -> list[str]:
        """A reader's part of :meth:`clean_leftovers`: only put back the old copy of a
        re-saved step whose new copy never committed (a save killed between the two), so
        that a restore finds it. Nothing is removed (no lock tells a reader when it is
        safe); the put-back's manifest is written create-only, so it never replaces a
        commit, and a re-save that is still running goes on (``commit``)."""
        for name in self.listdir():
            if name.startswith(REPLACED):
                self._recover(self.root / name, remove=False)
        return []

    def _recover(self, aside: StorePath, *, remove: bool = True) -> None:
        """Put the old copy of a re-saved step (``.replaced-step_*-<id>``) back if the
        step is not committed; else delete it (``remove``: a saver, not a reader)."""
        original = aside_target(aside.name, REPLACED)
        if original is None:
            return
        final = self.root / original
        if self.store.info((aside / MANIFEST).key) is None:
            return  # the copy aside never completed: the step itself was never unlisted
        if self.store.info((final / MANIFEST).key) is None:
            try:
                aside.move_checkpoint(final)
            except (FileExistsError, FileNotFoundError):
                return  # a save committed it, or another process put it back, meanwhile
            logger.warning("put back %s: a re-save of it did not complete", final)
        elif remove:
            aside.delete_all()


class NoRunLock:
    """An object store has no locks: a run's hold on a prefix is never held."""

    def hold(self) -> bool:
        return False

    def holder(self) -> str:
        return "unknown (an object store has no locks)"

    def release(self) -> None:
        pass


def _lineage(data: bytes) -> list[dict[str, Any]] | None:
    """The lineage in a manifest's bytes (None: unreadable, or none)."""
    try:
        lineage = json.loads(data).get("lineage")
    except (ValueError, AttributeError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(lineage, list) or not lineage:
        return None
    if not all(isinstance(e, dict) for e in lineage):
        return None
    return lineage


def _marks(objects: dict[str, dict[str, Any]]) -> dict[int, str]:
    found = {}
    for rel, info in objects.items():
        top, _, rest = rel.partition("/")
        step = step_of(top)
        if step is not None and rest == MANIFEST:
            found[step] = str(info.get("etag"))
    return found


def shard_save_id(name: str) -> str | None:
    """The save id in a remote shard object's name (``rank_00000-<id>.bin``), or None."""
    m = _SHARD_RE.match(name)
    return m.group(1) if m else None
