"""The tracked-metrics record on an object store, where nothing can be appended to.

Locally rank 0 appends to ``metrics.jsonl``. On a store the same lines go, in order, into
objects of up to about a MiB under ``PREFIX/metrics/``, named
``<wall-clock ns>-<segment>-<seq>.jsonl`` when started: listing them in name order gives
the lines in the order they were tracked, across every resume of the run (each resume is
a later process, so a later clock), and :func:`object_lines` reads them back as one file.
Each upload rewrites the object being filled with the new lines appended, so a long run
with frequent uploads still leaves few objects to list and read.

An upload happens at every save (before ``save()`` returns or, for a background save,
at its commit), at ``close()``, at interpreter exit, and from a background thread once
``UNBROKEN_STORE_METRICS_S`` seconds (default 30) have passed since the last one, so a
process killed outright loses at most that much of its record. An upload that fails is
retried with everything tracked since, so nothing is lost or reordered while the store
is down.

An upload first asks ``permit`` (the Checkpointer's gate, ``run/ownership.py``): until
the prefix is shown to be this run's (no other run committed there since it started or
restored: one listing per upload; or a save of its own committed) the lines wait.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..env import env_number
from ..errors import CheckpointError
from ..storage.store_io import concurrency
from ..storage.store_path import StorePath

FOLDER = "metrics"
INTERVAL_ENV = "UNBROKEN_STORE_METRICS_S"
CHUNK_BYTES = 1 << 20  # an object is rewritten with new lines until it holds this much
logger = logging.getLogger(__name__)
_open_logs: weakref.WeakSet[ObjectLog] = weakref.WeakSet()
_exit_lock = threading.Lock()
_exit_registered = False


def upload_interval() -> float:
    return env_number(INTERVAL_ENV, 30.0, 0.0)


class ObjectLog:
    """Rank 0's record of one Checkpointer on a store: lines in memory until uploaded.

    ``write`` never does I/O (the training loop calls it); ``upload`` sends what is
    pending as the next object, if ``permit()`` (when given) is True, and raises
    :class:`CheckpointError` naming it if the store refuses after its retries (the
    lines stay pending).
    """

    def __init__(
        self,
        root: StorePath,
        segment: str,
        *,
        permit: Callable[[], bool | None] | None = None,
    ) -> None:
        self.folder = root / FOLDER
        self._segment = segment
        self._pending: list[str] = []
        self._name: str | None = None  # the object being filled
        self._body = ""  # its text (uploaded unless _unsent)
        self._unsent = False
        self._seq = 0
        self._last_ns = 0
        self._last_upload = time.monotonic()
        self._interval = upload_interval()
        self._lock = threading.Lock()  # _pending
        self._upload_lock = threading.Lock()  # one upload at a time, in order
        self._background: threading.Thread | None = None
        self._warned = False
        self._permit = permit
        _register_exit(self)

    def write(self, text: str, segment: str) -> None:
        with self._lock:
            self._pending.append(text)
            self._segment = segment
            due = time.monotonic() - self._last_upload >= self._interval
            if not due or (self._background is not None and self._background.is_alive()):
                return
            self._background = threading.Thread(
                target=self._upload_quietly, name="unbroken-metrics-upload", daemon=True
            )
            self._last_upload = time.monotonic()  # one background upload per interval
        self._background.start()

    def upload(self) -> None:
        """Send everything pending: the current object is rewritten with it appended
        (a new object is started once one holds ``CHUNK_BYTES``)."""
        with self._upload_lock:
            with self._lock:
                permit = self._permit
            if permit is not None and permit() is not True:
                return  # not shown to be this run's prefix yet: the lines wait
            with self._lock:
                new = "".join(self._pending)
                self._pending = []
                self._last_upload = time.monotonic()
                segment = self._segment
            if not new and not self._unsent:
                return
            if self._name is None:
                self._name = self._next_name(segment)
            body = self._body + new
            try:
                self.folder.store.put((self.folder / self._name).key, body.encode("utf-8"))
            except CheckpointError:
                self._body, self._unsent = body, True  # retried, same name, with what follows
                raise
            self._unsent = False
            if len(body) >= CHUNK_BYTES:
                self._name, self._body = None, ""
            else:
                self._body = body

    def pending(self) -> bool:
        with self._lock:
            return bool(self._pending) or self._unsent

    def retract(self, line: str) -> int:
        """The prefix is lost to another run: drop what is pending and, if anything was
        uploaded, upload ``line`` (withdrawing it) without asking ``permit``; returns
        the tracked steps dropped."""
        with self._lock:
            dropped = _steps_in(self._pending)
            self._pending = [line] if self._seq else []
            self._permit = None
        return dropped

    def drop_pending(self) -> int:
        """Drop the lines ``permit`` never let through; returns the tracked steps dropped."""
        with self._lock:
            dropped = _steps_in(self._pending)
            self._pending = []
        return dropped

    def _next_name(self, segment: str) -> str:
        now = max(time.time_ns(), self._last_ns + 1)  # strictly increasing in this process
        self._last_ns = now
        self._seq += 1
        return f"{now:020d}-{segment}-{self._seq:06d}.jsonl"

    def _upload_quietly(self) -> None:
        try:
            self.upload()
        except CheckpointError as exc:
            if not self._warned:
                self._warned = True
                logger.warning("%s (the tracked steps stay queued and are uploaded with the "
                               "next save)", exc)  # fmt: skip


def _steps_in(texts: list[str]) -> int:
    return sum(t.count('"metrics": {') for t in texts)


def _register_exit(log: ObjectLog) -> None:
    global _exit_registered
    with _exit_lock:
        _open_logs.add(log)
        if not _exit_registered:
            atexit.register(_upload_at_exit)
            _exit_registered = True


def _upload_at_exit() -> None:
    """What a Checkpointer never closed still holds is uploaded before the process ends."""
    for log in list(_open_logs):
        if log.pending():
            try:
                log.upload()
            except Exception as exc:  # nobody is left to raise it to
                logger.error("tracked steps lost at exit: %s", exc)


def object_lines(root: StorePath) -> list[str] | None:
    """The record's lines in the order they were tracked; None if it has no object."""
    folder = root / FOLDER
    names = sorted(n for n in folder.store.listing(folder.key) if n.endswith(".jsonl"))
    if not names:
        return None
    with ThreadPoolExecutor(min(len(names), concurrency()), "unbroken-metrics-read") as pool:
        texts = list(pool.map(lambda n: folder.store.read((folder / n).key), names))
    lines: list[str] = []
    for data in texts:
        lines += data.decode("utf-8", errors="replace").splitlines()
    return lines
