"""The roles storage plays for the rest of the library: the public seam of ``storage/``.

- :class:`Location`: one folder or file of a checkpoint (``LocalPath`` on a disk,
  ``StorePath`` on a store). Format code reads and writes tensor bytes and manifests
  through it; where the media differ, a member says what the caller needs (how many
  files a shard is written as, whether written buffers are kept, how reads are issued,
  where a local output goes), never which medium it is.
- :class:`Journal`: an append-only record of lines in a run folder (the tracked-metrics
  record), from :meth:`Location.journal`.
- :class:`CheckpointDir`: the root folder of one run: committed steps, partial saves,
  the commit, retention, leftovers. One implementation, ``run_folder.RunFolder``: the
  run-folder policy written once over a medium (``backend.py``).
- :class:`RunLock`: a run's hold on its folder while it records there.

``unbroken.storage.locate`` builds them for a path or URL.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

Identity = tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class FileStat:
    """A plain file in a folder: its size and the bytes it takes on the medium (less
    than its size for a sparse file on a disk; the size on a store)."""

    size: int
    held: int


class TooLarge(Exception):
    """:meth:`Location.read_capped` found a file larger than the cap (``size``; None if it
    grew while it was read)."""

    def __init__(self, path: str, size: int | None) -> None:
        super().__init__(path, size)
        self.path, self.size = path, size


class ChunkReader(Protocol):
    """Reads byte ranges of one file (:meth:`Location.open_chunks`)."""

    def read_into(self, offset: int, buf: memoryview) -> int:
        """Fill ``buf`` from the file's bytes at ``offset``; the bytes read (fewer: the
        file ends first). Raises ``OSError`` (``FileNotFoundError``: it is gone)."""
        ...

    def close(self) -> None: ...


class FileSink(Protocol):
    """Takes a new file's bytes in order (:meth:`Location.create`)."""

    def write(self, data: memoryview | bytes) -> Any: ...


class Journal(Protocol):
    """An append-only record of text lines kept in a run folder (the tracked-metrics
    record): a file appended to on a disk; on an object store, which cannot append,
    objects whose names keep the order. ``str()`` says where it is, for messages.

    Thread-safe: one writer appends and syncs, in order, while others read.
    """

    @property
    def write_interval(self) -> float | None:
        """None where an append is cheap (a disk): append every line as it comes. Where
        every append is a request (a store), the seconds a writer gathers lines in memory
        between appends, made in the background and never in the caller's loop
        (``UNBROKEN_STORE_METRICS_S``, default 30)."""
        ...

    def append(self, text: str) -> None:
        """Add ``text`` (whole lines) at the end of the record.

        Raises:
            OSError: it failed on a disk (a ``WriteError``, also a ``CheckpointError``,
                naming the file and the free space). Part of ``text`` may have been
                written: the next append starts on a new line, so readers skip the
                fragment. Append it again (with what follows).
            CheckpointError: it failed on a store (naming the object), or the record's
                path is a symbolic link (never written through).
        """
        ...

    def sync(self) -> None:
        """Make everything appended durable (fsync on a disk; an append to a store is
        durable when it returns). Raises like :meth:`append`."""
        ...

    def lines(self) -> list[str] | None:
        """The record's lines in the order appended; None if nothing was ever recorded."""
        ...

    def close(self) -> None:
        """Let go of what is open (a file); a later append opens it again."""
        ...


class Location(Protocol):
    """A folder or a file of a checkpoint: ``/`` joins, ``str()`` is its path or URL.

    Thread-safe: each call stands alone (a :class:`ChunkReader` is one thread's).
    """

    saves_in_place: bool
    """Whether a save writes its files straight into the step folder (an object store,
    where nothing can be renamed into place): a step folder may then hold files of saves
    that never committed (losing or crashed ones), which are not the checkpoint's and
    no damage; on a disk a step folder is one save's, renamed into place whole."""

    keeps_written_buffers: bool
    """Whether :meth:`create`'s sink keeps the buffers it is given until its block ends
    (an upload), so that a reused buffer must never be written to it."""

    @property
    def name(self) -> str: ...

    @property
    def parent(self) -> Location: ...

    def __truediv__(self, name: str) -> Location: ...

    def exists(self) -> bool: ...

    def is_link(self) -> bool:
        """Whether it is a symbolic link (never, on a store); checkpoints never hold one."""
        ...

    def identity(self) -> Identity | None:
        """What changes when it is removed, renamed or rewritten (None: it is not there).
        Take it before reading a checkpoint; :func:`vanished` compares."""
        ...

    def is_dir(self) -> bool:
        """Whether it is a folder (on a store: a prefix with objects under it)."""
        ...

    def has_file(self, name: str) -> bool | None:
        """Whether this folder holds the plain file ``name`` (None: it cannot be told)."""
        ...

    def plain_files(self) -> dict[str, FileStat]:
        """The plain files directly inside this folder (links, folders left out).
        Raises ``OSError`` (``FileNotFoundError``: no such folder) if it cannot be listed."""
        ...

    def file_problem(self, size: int) -> str | None:
        """Why this file, recorded with ``size`` bytes, must not be read, or None: missing,
        another size, a link, not a plain file, sparse (reading it would spend memory on
        bytes the disk does not hold)."""
        ...

    def problems(self, listed: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str]]:
        """(name, why) for every file of this step folder that ``listed`` (name -> record
        with ``size``) names and must not be read, and every file that should not be there
        (on a disk: any file not listed; on a store other saves' uploads are no damage)."""
        ...

    def read_capped(self, limit: int) -> bytes:
        """This whole file, if it is a plain file of at most ``limit`` bytes.

        Raises:
            FileNotFoundError: it is not there.
            TooLarge: it is larger (judged before its bytes are read).
            CorruptCheckpointError: a link, or not a plain file.
            OSError: it cannot be read.
        """
        ...

    def open_chunks(self) -> ChunkReader:
        """A reader of this file's byte ranges (never through a link)."""
        ...

    def create(self) -> contextlib.AbstractContextManager[FileSink]:
        """Write this new file: its bytes go to the sink in order; it is durable (fsynced,
        or uploaded whole) once the block ends, and never appears in part on a store.
        Raises ``CheckpointError`` naming the path (on a disk, the free space too)."""
        ...

    def files_per_shard(self, wanted: int) -> int:
        """How many files one rank's shard is written as in this folder, ``wanted`` if
        the medium gains from files written side by side (a disk); 1 where one object
        is uploaded in parallel parts anyway (a store)."""
        ...

    @property
    def chunk_requests(self) -> int | None:
        """How many reads of single chunks to keep in flight where every read is a
        request with a latency (an object store); None where a file is best read in
        runs of consecutive chunks (a disk)."""
        ...

    def free_space(self) -> str:
        """Free space where this is, readable (``"1.5 MiB"``); ``"unknown"`` where it
        cannot be told (a store)."""
        ...

    def is_empty(self) -> bool:
        """Whether nothing is there: no such folder, or one without entries (on a store:
        no object under the prefix). A file is not empty."""
        ...

    def make_dirs(self) -> None:
        """Make this folder, and those above it, where the medium has folders (a disk); a
        store needs none (a prefix exists once an object is under it)."""
        ...

    def local_file(self, name: str) -> Path:
        """Where a local file made from this folder goes by default (a plot, a report):
        ``name`` inside it on a disk; in the current folder for a store's URL."""
        ...

    def journal(self, name: str) -> Journal:
        """The append-only record ``name`` of this folder: the file ``name.jsonl`` on a
        disk, the objects under ``name/`` on a store. Nothing is read or written yet."""
        ...


class RunLock(Protocol):
    """A run's hold on its folder while its Checkpointer records there (local folders;
    an object store has no locks, and its lock is never held)."""

    def hold(self) -> bool:
        """Whether this holds the lock, taking it if it is free; never waits."""
        ...

    def holder(self) -> str:
        """Who holds it, for messages."""
        ...

    def release(self) -> None: ...


class CheckpointDir(Protocol):
    """The root folder of one training run's checkpoints (see ``storage/names.py``).

    Writers (a save) hold :meth:`save_lock`; readers (a restore, the offline tools) never
    take it and never write, except that they clean leftovers while no save is under way
    (:meth:`clean_leftovers_if_idle`).
    """

    root: Location

    @property
    def has_locks(self) -> bool:
        """Whether the folder has a save lock and a run lock (a disk). Without them (an
        object store) the create-only manifest write decides between two saves, and a
        run lock is never held."""
        ...

    def step_path(self, step: int) -> Location:
        """Where step ``step``'s committed checkpoint is (or would be)."""
        ...

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        ...

    def steps_without_manifest(self) -> list[int]:
        """Step folders that lost their manifest (damaged, never listed), ascending."""
        ...

    def step_marks(self) -> dict[int, str]:
        """Committed steps, each with a mark that changes when the step is committed
        again (a re-save, or removed and saved anew), from one listing."""
        ...

    def step_mark(self, step: int) -> str | None:
        """The mark :meth:`step_marks` gives ``step`` (None: not committed)."""
        ...

    def step_copies(self) -> dict[int, tuple[str, str]]:
        """Committed steps, each with the name of the folder in the root its checkpoint
        is read from (its step folder, or the old copy a re-save that died set aside)
        and its mark, from one listing."""
        ...

    def copy_path(self, step: int) -> Location:
        """The folder committed ``step`` is read from (see :meth:`step_copies`)."""
        ...

    def run_lock(self) -> RunLock:
        """A new, not yet held, hold on this folder (see :class:`RunLock`)."""
        ...

    def listdir(self) -> list[str]:
        """The names in the root folder, sorted (``FileNotFoundError`` if there is none:
        on a store, no object under the prefix)."""
        ...

    def is_folder(self, name: str) -> bool: ...

    def check_not_foreign(self) -> None:
        """Refuse a folder that holds another tool's checkpoint and none of ours."""
        ...

    def save_lock(self) -> contextlib.AbstractContextManager[None]:
        """Hold the folder's save lock (one saver at a time); fail at once if taken."""
        ...

    def saving_now(self) -> bool:
        """Whether a save holds the lock, asked without taking it."""
        ...

    def new_partial(self, step: int) -> Location:
        """A new folder for a save of ``step`` in progress (never listed)."""
        ...

    def token(self, partial: Location) -> str:
        """``partial`` as text, for the other ranks (:meth:`from_token`)."""
        ...

    def from_token(self, text: str) -> Location: ...

    def shard_name(self, partial: Location, rank: int) -> str:
        """The name of ``rank``'s shard file in the partial save ``partial``."""
        ...

    def commit(
        self,
        partial: Location,
        step: int,
        *,
        retire: Sequence[int] = (),
        manifest: bytes = b"",
        other_writer: Callable[[bytes], str | None] | None = None,
    ) -> Location:
        """Write ``manifest`` last and make ``partial`` the committed checkpoint of
        ``step``, retiring the ``retire`` steps first (put back if the commit fails).

        ``other_writer``: given the manifest bytes of a copy of ``step`` committed there
        already (empty if unreadable), None if this save may replace it, else who
        committed it (for the error); None: any copy is replaced. Storage never reads
        what a manifest says beyond the files it lists: the caller owns that rule.
        Raises ``CheckpointError`` having committed nothing."""
        ...

    def retire(self, steps: Sequence[int]) -> list[tuple[Location, Location]]:
        """Unlist committed ``steps`` (kept aside as ``.retired-*``): (old, new) paths."""
        ...

    def retired(self) -> list[tuple[int, Location]]:
        """Checkpoints retired from abandoned branches: (step, folder), by step."""
        ...

    def remove(self, step: int) -> bool:
        """Unlist a committed checkpoint at once, delete its files in the background;
        False (logged, kept) if that failed."""
        ...

    def finish_removals(self) -> None:
        """Wait for the deletions :meth:`remove` started."""
        ...

    def discard(self, partial: Location) -> None:
        """Remove a partial save's files."""
        ...

    def clean_leftovers(self) -> list[str]:
        """Remove what crashed saves left; call it holding :meth:`save_lock`."""
        ...

    def clean_leftovers_if_idle(self) -> list[str]:
        """:meth:`clean_leftovers` unless a save is under way; never takes the lock."""
        ...


def vanished(folder: Location, seen: Identity | None) -> bool:
    """Whether ``folder`` is no longer the one whose :meth:`Location.identity` was
    ``seen``: removed, retired or re-saved by a concurrent save while it was read.

    Reading errors of a folder that vanished are not damage: list the steps again and
    read what is there now. A folder that is still the same reports its damage as usual.
    """
    return seen is None or folder.identity() != seen
