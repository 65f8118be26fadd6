"""The one deleter of a run folder: what the policy unlisted is deleted in the background.

Unlinking the files of a multi-GB checkpoint (or deleting its objects) takes a while, and
training need not wait: ``RunFolder.remove`` unlists a step at once, then hands its
files here. A deletion that fails is logged, not raised (the step is unlisted already);
the next save's clean-up removes what is left.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..errors import CheckpointError
from .interface import Location

logger = logging.getLogger(__name__)


class Deleter:
    """Deletes unlisted folders with ``delete`` (the medium's ``delete_tree``), each in a
    background thread of its own (not a daemon: a process that ends waits for it).

    Thread-safe.

    Example::

        deleter = Deleter(medium.delete_tree)
        deleter.submit(trash)   # returns at once
        deleter.finish()        # waits for every deletion submitted
    """

    def __init__(self, delete: Callable[[Location], None]) -> None:
        self._delete = delete
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, folder: Location) -> None:
        """Delete ``folder`` in the background."""
        worker = threading.Thread(
            target=self.now, args=(folder,), name="unbroken-delete", daemon=False
        )
        worker.start()
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [worker]

    def now(self, folder: Location) -> None:
        """Delete ``folder`` in this thread; a failure is logged."""
        try:
            self._delete(folder)
        except CheckpointError as exc:  # the next save's clean-up removes what is left
            logger.warning("%s", exc)

    def finish(self) -> None:
        """Wait for every deletion :meth:`submit` started."""
        with self._lock:
            threads, self._threads = self._threads, []
        for worker in threads:
            worker.join()
