"""Operating-system primitives under a local run folder: atomic exchange, the save lock
and its non-blocking test, the run lock (:class:`RunLock`: which open Checkpointer records
the run), directory fsync, and write errors that say where and how much space is left.

Local file systems only. Linux gives everything: ``renameat2(RENAME_EXCHANGE)`` swaps a
re-saved step in one step, and open-file-description locks (``F_OFD_SETLK``) can be
*tested* (``F_OFD_GETLK``) without being taken, so a reader learns that a save is under
way without ever holding the lock a saver needs. Elsewhere (or on a file system without
the exchange) callers fall back, as each function says.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import socket
import struct
import sys
import threading
from pathlib import Path

from ..errors import CheckpointError

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
# struct flock on Linux (x86-64, arm64): l_type, l_whence, l_start, l_len, l_pid, padding.
_FLOCK = struct.Struct("hhqqi4x")
_OFD = hasattr(fcntl, "F_OFD_SETLK") and hasattr(fcntl, "F_OFD_GETLK")
SAVE_FIX = (
    "nothing was committed and earlier checkpoints are untouched; free space (or lower "
    "keep_last) and save again"
)


def _load_renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _load_renameat2()


def exchange(a: Path, b: Path) -> bool:
    """Swap the two existing paths ``a`` and ``b`` in one atomic step.

    Returns False, having changed nothing, where the platform or the file system cannot
    (the caller falls back to two renames). Raises ``OSError`` for any other failure.
    """
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def try_lock(fd: int) -> bool:
    """Take an exclusive lock on the open file ``fd`` without waiting; False if taken.

    Released when the file is closed (by every process sharing that open file)."""
    try:
        if _OFD:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
        else:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def is_locked(fd: int) -> bool:
    """Whether another open file holds the lock :func:`try_lock` takes on ``fd``'s file.

    On Linux this only asks (``F_OFD_GETLK``): it never holds the lock, so it never makes
    a saver's :func:`try_lock` fail. Elsewhere it takes and drops a shared lock at once.
    """
    if _OFD:
        query = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        return _FLOCK.unpack(fcntl.fcntl(fd, fcntl.F_OFD_GETLK, query))[0] != fcntl.F_UNLCK
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def open_no_link(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
    """``os.open`` of a file in a run folder, never through a symbolic link.

    A link planted at a lock or at ``metrics.jsonl`` would have a save truncate, or
    append to, whatever it points at. Raises ``CheckpointError`` naming the link and
    what to do; other failures raise their ``OSError``.
    """
    try:
        return os.open(path, flags | os.O_NOFOLLOW, mode)
    except OSError as exc:
        if os.path.islink(path):
            raise linked_file(path) from exc
        raise


def no_link_opener(path: str, flags: int) -> int:
    """An ``opener`` for :func:`open` that refuses a symbolic link (:func:`open_no_link`)."""
    return open_no_link(path, flags)


def linked_file(path: str | os.PathLike) -> CheckpointError:
    """The error for a symbolic link found where a run folder keeps one of its files."""
    try:
        target = f" (to {os.readlink(path)!r})"
    except OSError:
        target = ""
    return CheckpointError(
        f"{os.fspath(path)!r} is a symbolic link{target}: unbroken never opens a file of a "
        "checkpoint folder through a link (it would write where the link points); remove "
        "the link and run again"
    )


def fsync_dir(path: Path) -> None:
    """Make renames and new entries in the folder ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def size_text(n: float) -> str:
    """A byte count, readable (``"1.5 GiB"``)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def nearest_existing(path: Path) -> Path:
    """``path``, or its nearest parent that exists."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_space(path: str | os.PathLike) -> str:
    """Free space on the file system holding ``path`` (or its nearest existing parent),
    readable (``"1.5 MiB"``); ``"unknown"`` if it cannot be told."""
    if not isinstance(path, (str, os.PathLike)):  # an object store's: not a disk
        return "unknown"
    try:
        return size_text(shutil.disk_usage(nearest_existing(Path(path))).free)
    except OSError:
        return "unknown"


class WriteError(CheckpointError, OSError):
    """A write into the checkpoint folder failed (a full disk, a quota, an I/O error).

    A ``CheckpointError`` whose message names the path and the free space there; also an
    ``OSError`` carrying the original ``errno`` and ``filename``.
    """

    def __str__(self) -> str:  # OSError would print "[Errno N] strerror: filename"
        return str(self.args[0]) if self.args else ""


def write_error(path: str | os.PathLike, exc: OSError, doing: str, fix: str) -> WriteError:
    """The error of a failed write to ``path``: what was being done, why (a full disk or
    quota said so), the free space left there, and ``fix`` (what to do)."""
    why = {
        errno.ENOSPC: "the disk is full",
        errno.EDQUOT: "the disk quota is exceeded (treat it as a full disk)",
    }.get(exc.errno or 0, f"{type(exc).__name__}: {exc.strerror or exc}")
    error = WriteError(f"{doing} {path} failed: {why} ({free_space(path)} free there); {fix}")
    error.errno, error.strerror, error.filename = exc.errno, exc.strerror, os.fspath(path)
    return error


@contextlib.contextmanager
def writing(path: str | os.PathLike, doing: str, fix: str):
    """Turn an ``OSError`` raised inside into :func:`write_error` (a ``CheckpointError``
    passes through unchanged)."""
    try:
        yield
    except CheckpointError:
        raise
    except OSError as exc:
        raise write_error(exc.filename or path, exc, doing, fix) from exc


@contextlib.contextmanager
def save_lock(root: Path, lock: Path, fix: str):
    """Hold the save lock file ``lock`` in ``root`` (see ``CheckpointDir.save_lock``)."""
    with writing(lock, "creating", fix):
        root.mkdir(parents=True, exist_ok=True)
        fd = open_no_link(lock, os.O_RDWR | os.O_CREAT)
    try:
        if not try_lock(fd):
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
            raise CheckpointError(
                f"another save into {root} is in progress ({holder}); two jobs "
                "must not share a checkpoint folder: stop the other job or use another path"
            )
        with contextlib.suppress(OSError):  # who holds it: a courtesy for that message
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        yield
    finally:
        os.close(fd)


class RunLock:
    """A run's hold on its local folder while it records there (``.run-lock``).

    :meth:`hold` takes the lock without waiting and keeps it until :meth:`release` (or
    the process ends: the system drops it, so a crashed run never blocks its relaunch).
    Open-file-description locks conflict between two holders in one process too (an
    actor's and a critic's Checkpointer). A folder that cannot be locked (no
    permission, a file system without locks) is never held; a symbolic link planted at
    its path raises ``CheckpointError`` (never opened through). Thread-safe.
    """

    def __init__(self, root: Path, path: Path) -> None:
        self._root, self._path = root, path
        self._fd: int | None = None
        self._held = False
        self._lock = threading.Lock()

    def hold(self) -> bool:
        """Whether this holds the lock, taking it if it is free (never waits)."""
        with self._lock:
            if self._held:
                return True
            try:
                if self._fd is None:
                    self._root.mkdir(parents=True, exist_ok=True)
                    self._fd = open_no_link(self._path, os.O_RDWR | os.O_CREAT)
                if not try_lock(self._fd):
                    return False
            except OSError:
                return False
            self._held = True
            with contextlib.suppress(OSError):  # who holds it: a courtesy for messages
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
            return True

    def holder(self) -> str:
        """Who holds the lock, as its holder wrote it (``"unknown"`` if it cannot be read)."""
        try:
            with open(self._path, "rb", opener=no_link_opener) as f:
                return f.read(256).decode(errors="replace").strip() or "unknown"
        except (OSError, CheckpointError):
            return "unknown"

    def release(self) -> None:
        """Let go of the lock (closing the file). Safe to call more than once."""
        with self._lock:
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
            self._fd, self._held = None, False

    def __del__(self) -> None:  # a Checkpointer dropped without close() lets go too
        # No module globals here: at interpreter shutdown they may already be None, and
        # the system closes the file (dropping the lock) when the process ends anyway.
        try:  # noqa: SIM105 (contextlib itself may be gone by then)
            self.release()
        except Exception:
            pass


def saving_now(lock: Path) -> bool:
    """Whether a save holds ``lock``, asked without taking it; True when it cannot be told."""
    try:
        fd = open_no_link(lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except (OSError, CheckpointError):  # a link is never opened: a save cannot be ruled out
        return True
    try:
        return is_locked(fd)
    except OSError:
        return True
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes, fix: str) -> None:
    """Write ``data`` as the new file ``path`` and fsync it."""
    with writing(path, "writing", fix), open(path, "wb", opener=no_link_opener) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
