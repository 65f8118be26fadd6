"""A checkpoint's files on a local disk: :class:`LocalPath`, the ``Location`` role for a path.

A committed checkpoint's folder holds ``manifest.json`` and the shard files it lists,
nothing else. Each is a plain file, never a symbolic link (a hostile checkpoint must not
make a reader read outside its folder), of exactly its recorded size, and allocated on
disk: a sparse file (mostly holes) claims bytes it does not hold, and reading it would
spend memory on data that is not there, so memory stays bounded by what the checkpoint
really takes on disk. ``restore()``, ``unbroken verify`` and the offline readers apply
these same rules.

A journal (the tracked-metrics record, :class:`FileJournal`) is a file appended to.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import stat
import threading
from collections.abc import Iterator, Mapping
from typing import IO, Any

from ..errors import CorruptCheckpointError
from . import posix
from .interface import FileStat, Identity, TooLarge
from .names import MANIFEST
from .posix import SAVE_FIX, no_link_opener, writing

ALLOW_SPARSE = "UNBROKEN_ALLOW_SPARSE"  # set to 1 where allocation is not reported
_HOLES_ALLOWED = 1 << 20  # unallocated bytes a file may have (block rounding, tiny files)


def allocated(st: os.stat_result) -> int:
    """Bytes a file takes on disk (its size where the platform does not say)."""
    blocks = getattr(st, "st_blocks", None)
    return st.st_size if blocks is None else blocks * 512


def _sparse(path: os.PathLike, st: os.stat_result) -> str | None:
    held = allocated(st)
    if st.st_size - held <= _HOLES_ALLOWED or held * 2 >= st.st_size:
        return None
    if os.environ.get(ALLOW_SPARSE) == "1":
        return None
    return (
        f"{path} is sparse: {st.st_size} bytes long but only {held} allocated on disk. A "
        "save writes every byte, so the file was made to look larger than it is; reading "
        "it would spend memory on data that is not there. (Where the file system does not "
        f"report allocated blocks, or compresses files, set {ALLOW_SPARSE}=1)"
    )


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)


class _FileChunks:
    """A :class:`~.interface.ChunkReader` over one open file."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f

    def read_into(self, offset: int, buf: memoryview) -> int:
        self._f.seek(offset)
        return self._f.readinto(buf) or 0

    def close(self) -> None:
        self._f.close()


class LocalPath(pathlib.PosixPath):
    """A folder or file of a checkpoint on a local disk: a ``pathlib`` path that also
    plays the ``Location`` role (``unbroken.storage.interface``)."""

    saves_in_place = False
    keeps_written_buffers = False
    chunk_requests = None  # a file is read in runs of consecutive chunks

    def is_link(self) -> bool:
        return self.is_symlink()

    def has_file(self, name: str) -> bool | None:
        """Whether this folder holds the plain file ``name``; None if that cannot be told
        (no permission): callers then read it, so that the error names it."""
        try:
            return stat.S_ISREG(os.stat(self / name).st_mode)
        except PermissionError:
            return None
        except OSError:
            return False

    def identity(self) -> Identity | None:
        """The folder's device, inode and change time."""
        try:
            st = os.stat(self)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_ctime_ns)

    def plain_files(self) -> dict[str, FileStat]:
        found = {}
        with os.scandir(self) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    found[entry.name] = FileStat(st.st_size, min(st.st_size, allocated(st)))
        return found

    def file_problem(self, size: int) -> str | None:
        try:
            st = os.lstat(self)
        except (FileNotFoundError, NotADirectoryError):
            return f"{self} is missing"
        except OSError as exc:  # no permission on the folder, an I/O error
            return f"{self} cannot be read ({exc.strerror or exc})"
        if stat.S_ISLNK(st.st_mode):
            return f"{self} is a symbolic link; checkpoints never hold one"
        if not stat.S_ISREG(st.st_mode):
            return f"{self} is not a regular file"
        if st.st_size != size:
            return (
                f"{self} is {st.st_size} bytes, the manifest says {size}: it was truncated or "
                "altered"
            )
        return _sparse(self, st)

    def problems(self, listed: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str]]:
        found = []
        for name, rec in sorted(listed.items()):
            why = (self / name).file_problem(rec["size"])
            if why is not None:
                found.append((name, why))
        try:
            present = set(os.listdir(self))
        except OSError as exc:  # gone meanwhile (pruned: the caller re-lists) or unreadable
            return [*found, (self.name, f"{self} cannot be listed ({exc.strerror or exc})")]
        for name in sorted(present - set(listed) - {MANIFEST}):
            why = (
                f"{self / name} is not listed in the manifest: something other than the "
                "save wrote there"
            )
            found.append((name, why))
        return found

    def read_capped(self, limit: int) -> bytes:
        try:
            fd = os.open(self, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise CorruptCheckpointError(
                f"{self} is a symbolic link; checkpoints never are"
            ) from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise CorruptCheckpointError(f"{self} is not a regular file")
            if st.st_size > limit:
                raise TooLarge(str(self), st.st_size)
            data = f.read(limit + 1)
        if len(data) > limit:
            raise TooLarge(str(self), None)
        return data

    def open_chunks(self) -> _FileChunks:
        return _FileChunks(open(self, "rb", opener=_no_follow))

    @contextlib.contextmanager
    def create(self) -> Iterator[IO[bytes]]:
        with writing(self, "writing", SAVE_FIX), open(self, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())

    # -- what callers need where media differ (``interface.Location``) --------------------

    def files_per_shard(self, wanted: int) -> int:
        return max(1, wanted)  # files written side by side finish sooner

    def free_space(self) -> str:
        return posix.free_space(self)

    def is_empty(self) -> bool:
        if not self.exists():
            return True
        return self.is_dir() and not any(self.iterdir())

    def make_dirs(self) -> None:
        self.mkdir(parents=True, exist_ok=True)

    def local_file(self, name: str) -> LocalPath:
        return self / name

    def journal(self, name: str) -> FileJournal:
        return FileJournal(self / f"{name}.jsonl")


_JOURNAL_FIX = (
    "free space: the tracked steps not on disk yet stay queued and are written by the "
    "next append or flush"
)


class FileJournal:
    """The ``Journal`` role on a disk: a file appended to, as lines come (one buffered
    write and a flush: a crash of the process loses nothing appended; :meth:`sync`
    fsyncs). Never opened through a symbolic link (one planted at its path would have it
    append to whatever the link points at). Thread-safe."""

    write_interval = None  # an append is cheap: every line as it comes

    def __init__(self, path: LocalPath) -> None:
        self._path = path
        self._file: Any = None
        self._torn = False  # a failed write may have left part of a line in the file
        self._lock = threading.Lock()

    def __str__(self) -> str:
        return str(self._path)

    def append(self, text: str) -> None:
        with self._lock, writing(self._path, "appending to", _JOURNAL_FIX):
            try:
                if self._file is None:
                    self._file = self._open()
                # After a failed write, a newline ends any torn line (readers skip it).
                self._file.write(("\n" if self._torn else "") + text)
                self._file.flush()
            except OSError:
                self._torn = True
                self._close()
                raise
            self._torn = False

    def sync(self) -> None:
        with self._lock:
            if self._file is None:
                return  # nothing of this writer's to sync
            fd = os.dup(self._file.fileno())
        try:  # outside the lock: an append need not wait for the disk
            with writing(self._path, "writing", _JOURNAL_FIX):
                os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        with self._lock:
            self._close()

    def lines(self) -> list[str] | None:
        if not self._path.is_file():
            return None
        return self._path.read_text(encoding="utf-8", errors="replace").splitlines()

    def _open(self) -> IO[str]:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        return open(self._path, "a", encoding="utf-8", opener=no_link_opener)

    def _close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
