"""The narrow backend under the run-folder policy: a medium, and how a save commits on it.

``run_folder.RunFolder`` writes the rules of a run folder once (names, steps, retiring,
replacing, leftovers, recovery, one background deleter); everything it asks of the
place where the bytes are goes through the two roles below, which each medium
implements in one class:

- ``local_medium.LocalMedium``: a local disk. A save is written into a partial folder
  and renamed into place; renames are fsynced in their folder; a save lock and a run
  lock exist; a re-save swaps atomically where the file system can.
- ``store_medium.StoreMedium``: an fsspec object store. Nothing can be renamed or
  locked: a save uploads straight into the step folder (shard names tagged with the
  save's id) and its create-only manifest write commits it; what crashed saves left is
  told by its age.

A third medium (a RAM folder with copies on peers) joins by implementing
:class:`Backend`; the policy, and every caller of ``CheckpointDir``, stay as they are.

Where the media differ, the difference is an operation of the medium (``publish``,
``swap``, ``leftovers``) or a capability named for the behaviour (``has_locks``;
``Location.saves_in_place``), never a question of which medium it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Protocol

from .interface import Location, RunLock


class Medium(Protocol):
    """Where one run folder's files are, and the few operations the policy performs on
    them: list, read, move, delete, lock. Every path is a ``Location`` under
    :attr:`root`. Thread-safe for one saver and any number of readers."""

    root: Location

    @property
    def has_locks(self) -> bool:
        """Whether :meth:`save_lock` excludes other savers and :meth:`saving_now` can
        tell a save under way (a disk). Without locks (an object store) readers never
        remove anything, and a run lock is never held."""
        ...

    # -- list and read --------------------------------------------------------------

    def names(self) -> list[str]:
        """The names in the root folder, sorted. Raises ``FileNotFoundError`` if there
        is no such folder (on a store: no object under the prefix)."""
        ...

    def marks(self) -> dict[str, str]:
        """Every folder in the root holding a manifest (a committed step folder, or a
        copy set aside), by name, each with a mark that changes when it is committed
        again: one listing."""
        ...

    def mark(self, folder: Location) -> str | None:
        """The mark :meth:`marks` gives the step folder ``folder`` (None: not committed)."""
        ...

    def holds(self, folder: Location) -> bool:
        """Whether a copy of a step is at ``folder``, to be replaced or put back: on a
        disk any folder of that name (a damaged one too), on a store one whose manifest
        is committed."""
        ...

    def read(self, file: Location) -> bytes | None:
        """A small file's bytes (a manifest), never through a link; None if it is not
        there. Raises ``OSError`` (a disk) or ``CheckpointError`` if it cannot be read."""
        ...

    # -- move and delete ------------------------------------------------------------

    def move(self, src: Location, dst: Location) -> None:
        """Move the step folder ``src`` to the new name ``dst``, durably, whole: a rename
        on a disk; on a store its listed files are copied, the manifest last and
        create-only, then removed from ``src``, the manifest first.

        Raises:
            FileExistsError: ``dst`` is committed already (a store; a disk refuses a
                non-empty ``dst`` with another ``OSError``); ``src`` is left as it was.
            FileNotFoundError: ``src`` is not (or no longer) there.
            OSError, CheckpointError: it failed; ``src`` is where it was.
        """
        ...

    def delete_tree(self, folder: Location) -> None:
        """Delete ``folder`` and everything in it (its manifest first, where that
        unlists it). Raises ``CheckpointError`` (a store) if a request fails."""
        ...

    # -- locks ----------------------------------------------------------------------

    def save_lock(self) -> contextlib.AbstractContextManager[None]:
        """Hold the save lock (one saver at a time); fail at once if another holds it.
        Creates the run folder where the medium has folders. A no-op without locks."""
        ...

    def saving_now(self) -> bool:
        """Whether a save holds the save lock, asked without taking it (True where it
        cannot be told; False without locks)."""
        ...

    def run_lock(self) -> RunLock:
        """A new, not yet held, hold on the folder (never held without locks)."""
        ...


class CommitStrategy(Protocol):
    """How a save becomes a committed checkpoint on one medium, and what a save cut off
    at any instant leaves behind."""

    def new_partial(self, step: int) -> Location:
        """A new place for a save of ``step`` in progress, never listed: a hidden folder
        (a disk) or the step folder itself with a new save id (a store)."""
        ...

    def token(self, partial: Location) -> str:
        """``partial`` as text for the other ranks (:meth:`from_token`)."""
        ...

    def from_token(self, text: str) -> Location: ...

    def shard_name(self, partial: Location, rank: int) -> str:
        """The name of ``rank``'s shard file in ``partial``."""
        ...

    def seal(self, partial: Location, manifest: bytes) -> None:
        """Make ``partial`` whole but for its commit: on a disk ``manifest`` (if given) is
        written into it and everything fsynced; on a store nothing (the manifest write
        is the commit)."""
        ...

    def publish(self, partial: Location, final: Location, step: int, manifest: bytes) -> None:
        """Commit ``partial`` as the step folder ``final`` (nothing committed there),
        durably: a rename on a disk; on a store the create-only write of ``manifest``.
        Raises ``CheckpointError`` having committed nothing (on a store: "another save
        committed step N" if a manifest is there that is not this one)."""
        ...

    def swap(self, partial: Location, final: Location) -> bool:
        """Exchange ``partial`` and the committed ``final`` in one atomic, durable step
        (``partial`` then holds the old copy); False, having changed nothing, where the
        medium cannot (a store; a file system without ``RENAME_EXCHANGE``)."""
        ...

    def discard(self, partial: Location) -> None:
        """Remove the files of the uncommitted save ``partial`` (only its own)."""
        ...

    def unlist(self, folder: Location) -> Location:
        """Make the committed step folder ``folder`` not committed at once; returns what
        is left to delete. Raises ``CheckpointError`` (the step is then still there)."""
        ...

    def leftovers(self) -> list[str]:
        """Names under the root of what saves left: ``.replaced-*`` folders (the policy
        puts them back or deletes them) and what crashed or losing saves left that no
        save in progress can own any more: on a disk ``.partial-*`` and ``.trash-*``
        folders (true only while the caller holds the save lock, or saw it free after
        listing); on a store the objects no manifest lists, once older than
        ``UNBROKEN_STALE_UPLOAD_S``."""
        ...

    def remove_leftovers(self, names: Sequence[str]) -> list[str]:
        """Remove the ``names`` :meth:`leftovers` gave (not ``.replaced-*``), and on a
        store abort multipart uploads as old; returns what was removed."""
        ...


class Backend(Medium, CommitStrategy, Protocol):
    """A medium with its commit strategy: what ``RunFolder`` is built over."""
