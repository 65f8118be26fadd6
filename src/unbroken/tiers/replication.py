"""Replicas of each local step, sent to peer nodes behind training.

Every rank queues the same jobs in the same order (one per local save); a thread of its
own runs them on a gloo group of its own, so training collectives never wait on it. A job
sends this rank's shard files to the ranks that keep its replicas and receives the files
of the ranks it keeps replicas of, each into ``.incoming-*`` and then renamed into the
committed step (a replica that is there is whole). A failure is logged and kept as a
warning; it never reaches the training loop.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from pathlib import Path

from ..core import collective
from .node_folder import NodeFolder
from .transfer import exchange

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Job:
    """One local step's replication, as this rank takes part in it."""

    step: int
    sends: list[tuple[int, Path, int]]  # (to rank, own file, size)
    receives: list[tuple[int, str, int]]  # (from rank, file name, size)


class Replicator:
    """The background thread that runs :class:`Job` s in order."""

    def __init__(self, folder: NodeFolder, group: object) -> None:
        self._folder = folder
        self._group = group
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0
        self.failures: list[str] = []
        self.done: list[int] = []  # steps replicated, in order
        self._thread: threading.Thread | None = None

    def submit(self, job: Job) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="unbroken-replicas", daemon=True)
            self._thread.start()
        with self._idle:
            self._pending += 1
        self._jobs.put(job)

    def wait(self) -> None:
        """Until every queued job is done (replicated, or failed and logged)."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def close(self) -> None:
        if self._thread is not None:
            self.wait()
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                with collective.using(self._group):
                    self._replicate(job)
                self.done.append(job.step)
            except Exception as exc:  # never into the training loop: logged, kept
                why = f"replicas of local step {job.step} were not completed: {exc}"
                logger.warning("%s", why)
                self.failures.append(why)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _replicate(self, job: Job) -> None:
        places = [
            (src, name, size, self._folder.incoming(job.step, name))
            for src, name, size in job.receives
        ]
        try:
            exchange(job.sends, [(src, path, size) for src, _, size, path in places])
        except BaseException:
            for *_, path in places:
                path.unlink(missing_ok=True)
            raise
        for _, name, _, path in places:
            self._folder.settle(path, job.step, name)
