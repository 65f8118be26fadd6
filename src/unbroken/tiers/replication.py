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
CLOSE_WAIT_S = 120.0


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

    def wait(self, timeout: float | None = None) -> bool:
        """Until every queued job is done (replicated, or failed and logged); False if
        ``timeout`` seconds passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Let the queued jobs finish (at most ``timeout`` seconds: a peer that died
        must not hold the job's exit), then stop the thread."""
        if self._thread is None:
            return
        if not self.wait(timeout):
            logger.warning(
                "replicas of local steps still in flight after %.0fs at close: abandoned "
                "(those steps stay on this node only)",
                timeout,
            )
            return  # the thread is a daemon: it goes with the process
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
            for path in [p for *_, p in places] + [p for _, p, _ in job.sends]:
                path.unlink(missing_ok=True)
            raise
        for _, name, _, path in places:
            self._folder.settle(path, job.step, name)
        for path in {p for _, p, _ in job.sends}:
            path.unlink(missing_ok=True)
