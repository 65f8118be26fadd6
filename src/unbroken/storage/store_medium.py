"""A run folder on an object store: the ``Backend`` role (``backend.py``) without rename or
locks.

::

    URL/step_00000200/manifest.json           the commit record, written last
    URL/step_00000200/rank_00000-<save>.bin   shard objects, named for the save that wrote them

Every rank uploads its shard straight to its final key, under a name that carries the
save's id, so two saves of one step (a relaunch racing a zombie job) never write the same
object. Once every rank's upload has completed, rank 0 writes ``manifest.json`` with a
create-only write (``If-None-Match: *`` on S3): the write is the commit, and of two
saves of one step only one can make it; the other fails naming the step and removes its
own objects. A write refused as "exists" first reads back the manifest in place: this
save's own (its answer was lost, the retry refused) is a commit; one that cannot be read
back fails the save without deleting anything a manifest lists. A step is listed only if its manifest exists, so an upload cut off at any
instant is never listed. Every move (retire, replace, put back) writes its manifest
create-only too, so it never lands on another save's commit.

Objects under a step that its manifest does not list (a crashed or losing save's) and
step folders without a manifest are removed by a later save once they are older than
``UNBROKEN_STALE_UPLOAD_S`` seconds (default 3600): there is no lock to tell an
abandoned upload from one in progress, so age tells. Readers never remove anything.
Unlisting a checkpoint deletes its manifest (at once), then its objects. There is no run
lock either (:class:`NoRunLock` is never held): which job owns a prefix is told by its
committed steps alone (``core/ownership.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

from ..env import env_number
from ..errors import CheckpointError
from .names import MANIFEST, REPLACED, step_dir_name, step_of
from .store import Store
from .store_path import StorePath

STALE_ENV = "UNBROKEN_STALE_UPLOAD_S"
_SHARD_RE = re.compile(r"^rank_\d{5}-([0-9a-f]{12})\.bin$")
_READ_BACK_WAITS = (0.0, 0.2, 1.0, 3.0)  # seconds before each read of a manifest found in place


def stale_after() -> float:
    """Seconds after which an upload no manifest lists is abandoned (default 3600)."""
    return env_number(STALE_ENV, 3600, 0)


def shard_save_id(name: str) -> str | None:
    """The save id in a store shard object's name (``rank_00000-<id>.bin``), or None."""
    m = _SHARD_RE.match(name)
    return m.group(1) if m else None


class StoreMedium:
    """The root of one run's checkpoints on an object store (any fsspec URL); see the
    module docstring for how each operation is done without rename or locks.
    Thread-safe as far as the store client is.

    Raises:
        CheckpointError: the URL names an object, not a folder; its store is not
            installed; it names a bucket without a folder.
    """

    has_locks = False

    def __init__(self, root: str | os.PathLike | StorePath) -> None:
        self.root = root if isinstance(root, StorePath) else StorePath.parse(os.fspath(root))
        if self.store.info(self.root.key) is not None:
            raise CheckpointError(
                f"{self.root} is an object, not a checkpoint folder; pass the prefix that "
                "holds step_* checkpoints (or a new one to start)"
            )

    @property
    def store(self) -> Store:
        return self.root.store

    def _objects(self) -> dict[str, dict[str, Any]]:
        return self.store.listing(self.root.key)

    # -- list and read --------------------------------------------------------------

    def names(self) -> list[str]:
        names = sorted({rel.partition("/")[0] for rel in self._objects()})
        if not names:
            raise FileNotFoundError(f"no object under {self.root}")
        return names

    def marks(self) -> dict[str, str]:
        """Folders holding a manifest, each with its manifest's identity (ETag), which a
        re-save changes: one listing."""
        found = {}
        for rel, info in self._objects().items():
            top, _, rest = rel.partition("/")
            if rest == MANIFEST:
                found[top] = str(info.get("etag"))
        return found

    def mark(self, folder: StorePath) -> str | None:
        # From a listing, as marks() takes them: a lookup (HEAD) gives the same identity
        # in another spelling on some stores (quoted ETags, datetimes).
        info = self.store.listing(folder.key).get(MANIFEST)
        return None if info is None else str(info.get("etag"))

    def holds(self, folder: StorePath) -> bool:
        return self.store.info((folder / MANIFEST).key) is not None

    def read(self, file: StorePath) -> bytes | None:
        try:
            return self.store.read(file.key)
        except FileNotFoundError:
            return None

    # -- move and delete ------------------------------------------------------------

    def move(self, src: StorePath, dst: StorePath) -> None:
        src.move_checkpoint(dst)

    def delete_tree(self, folder: StorePath) -> None:
        folder.delete_all()

    # -- locks: none ----------------------------------------------------------------

    def save_lock(self) -> contextlib.AbstractContextManager[None]:
        # Object stores have no locks: the create-only manifest write decides (publish).
        return contextlib.nullcontext()

    def saving_now(self) -> bool:
        return False

    def run_lock(self) -> NoRunLock:
        return NoRunLock()

    # -- the commit: a create-only manifest write -----------------------------------

    def new_partial(self, step: int) -> StorePath:
        final = self.root / step_dir_name(step)
        return StorePath(self.store, final.key, tag=uuid.uuid4().hex[:12])

    def token(self, partial: StorePath) -> str:
        return f"{partial}#{partial.tag}"

    def from_token(self, text: str) -> StorePath:
        url, _, tag = text.rpartition("#") if "#" in text else (text, "", "")
        return StorePath(self.store, StorePath.parse(url).key, tag=tag or None)

    def shard_name(self, partial: StorePath, rank: int) -> str:
        return f"rank_{rank:05d}-{partial.tag}.bin"

    def seal(self, partial: StorePath, manifest: bytes) -> None:
        pass  # the shards are uploaded whole; the manifest write is the commit

    def publish(self, partial: StorePath, final: StorePath, step: int, manifest: bytes) -> None:
        self._put_manifest(final, step, manifest)

    def _put_manifest(self, final: StorePath, step: int, data: bytes) -> None:
        key = (final / MANIFEST).key
        try:
            self.store.put(key, data, create=True)
        except FileExistsError:
            won = self._winner(key)
            if won == data:
                return  # our own write, whose answer was lost and which was retried
            if won is None:
                raise CheckpointError(
                    f"the commit of step {step} at {final} cannot be confirmed: the store "
                    "refused its manifest as already written, then could not return it. "
                    "Nothing a committed manifest lists was removed; run `unbroken verify "
                    f"{final}` before relying on it, or save again"
                ) from None
            raise CheckpointError(
                f"another save committed step {step} at {final} while this one was "
                "uploading: two jobs must not share a checkpoint prefix. This save's "
                "objects were removed and the other save's checkpoint is kept; stop the "
                "other job or use another path"
            ) from None

    def _winner(self, key: str) -> bytes | None:
        """The manifest that a create-only write found in place, read back (a store that
        has just taken a write may not return it at once), or None if it cannot be."""
        for wait in _READ_BACK_WAITS:
            time.sleep(wait)
            try:
                return self.store.read(key)
            except (FileNotFoundError, CheckpointError):
                continue
        return None

    def swap(self, partial: StorePath, final: StorePath) -> bool:
        return False  # no atomic exchange: the old copy is moved aside first

    def discard(self, partial: StorePath) -> None:
        # Never an object a committed manifest lists: a commit whose answer was lost is
        # committed all the same. An unreadable manifest keeps them all (the stale-upload
        # clean-up, which reads manifests, removes them later if nothing lists them).
        suffix = f"-{partial.tag}.bin"
        with contextlib.suppress(CheckpointError):
            listed = self.store.listing(partial.key)
            ours = [r for r in listed if r.endswith(suffix)]
            if ours and MANIFEST in listed:
                try:
                    kept = set(json.loads(self.store.read((partial / MANIFEST).key))["files"])
                except (OSError, ValueError, KeyError, TypeError, CheckpointError):
                    return
                ours = [r for r in ours if r not in kept]
            self.store.delete([(partial / r).key for r in ours])

    def unlist(self, folder: StorePath) -> StorePath:
        self.store.delete([(folder / MANIFEST).key])  # unlisted: the rest is garbage
        return folder

    def leftovers(self) -> list[str]:
        """``.replaced-*`` folders, and the objects of step folders that no manifest
        lists, once older than ``UNBROKEN_STALE_UPLOAD_S``: one listing, and a manifest
        read only where a folder holds another save's objects."""
        by_folder: dict[str, dict[str, dict[str, Any]]] = {}
        for rel, info in self._objects().items():
            top, _, rest = rel.partition("/")
            by_folder.setdefault(top, {})[rest] = info
        limit = stale_after()
        found: list[str] = []
        for top, members in sorted(by_folder.items()):
            if top.startswith(REPLACED):
                found.append(top)
                continue
            if step_of(top) is None:
                continue
            saves = {shard_save_id(r) for r in members if r != MANIFEST}
            if MANIFEST in members and len(saves) <= 1 and None not in saves:
                continue  # one save's objects and its manifest: nothing left over
            keep = set()
            if MANIFEST in members:
                keep = set((self.root / top).listed_files()) | {MANIFEST}
            found += [
                f"{top}/{r}" for r, i in members.items() if r not in keep and i["age"] >= limit
            ]
        return found

    def remove_leftovers(self, names: Sequence[str]) -> list[str]:
        if names:
            self.store.delete([(self.root / name).key for name in names])
        return [*names, *self.store.abort_stale_uploads(self.root.key, stale_after())]


class NoRunLock:
    """An object store has no locks: a run's hold on a prefix is never held."""

    def hold(self) -> bool:
        return False

    def holder(self) -> str:
        return "unknown (an object store has no locks)"

    def release(self) -> None:
        pass
