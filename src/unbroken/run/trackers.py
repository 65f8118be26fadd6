"""Forwarding tracked metrics to experiment trackers (TensorBoard, W&B, your own).

A tracker is anything with the four methods of :class:`Tracker`; the Checkpointer calls
them through a :class:`TrackerHub`, on rank 0 only, and never imports a tracker's
package (``unbroken.integrations.trackers`` holds the TensorBoard and W&B ones)::

    start(run_id, resume_step, tracked_upto)   restore() (or the first track() without one)
    log(step, metrics)                          each step once complete, all its metrics
    verdict(step, verdict)                      once the replay check of a resume is decided
    close()                                     close()

A resume recomputes the steps after the restored checkpoint, and a crash may have come
after the earlier process forwarded some of them: ``start`` says both where the run goes
on from (``resume_step``) and up to which step the run had tracked, and so forwarded,
before (``tracked_upto``, from the metrics record). A tracker that can replace logged
steps drops what it holds after ``resume_step`` (TensorBoard's ``purge_step``); one that
only appends skips the steps up to ``tracked_upto`` (W&B), whose recomputed values the
replay check compares bit for bit with the forwarded ones. Either way each step is
logged once.

A step may be tracked in several calls (``track(step, loss=...)``, then
``track(step, eval_loss=...)``): it is complete when another step is tracked, at a save
or at ``close()``, and only then forwarded, as one record holding every metric tracked
for it (W&B keeps one row per step). A process killed while tracking a step had not
forwarded it: ``tracked_upto`` counts the steps the record shows complete.

A tracker that raises is named in a logged warning and left out for the rest of the
Checkpointer's life: a dashboard's failure never stops training or a save.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..core import collective
from ..errors import CheckpointError
from ..format.series import is_withdrawn, parsed, record_lines, retractions
from ..storage.interface import Location
from .metrics import as_float
from .replay_check import PENDING, ReplayVerdict

if TYPE_CHECKING:
    from .record import RunRecord

logger = logging.getLogger(__name__)

_METHODS = ("start", "log", "verdict", "close")


@runtime_checkable
class Tracker(Protocol):
    """Receives a run's tracked metrics (rank 0 only). Not called from other threads."""

    def start(self, run_id: str, resume_step: int, tracked_upto: int) -> None:
        """The run (``Checkpointer.run_id``) goes on after ``resume_step`` (0: a fresh
        start): steps after it are tracked (again) from now on. ``tracked_upto`` (at least
        ``resume_step``) is the last step the run had tracked before this process: those
        up to it were forwarded already. May follow :meth:`close` (a second restore)."""
        ...

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """One complete step's metrics, every one ``Checkpointer.track`` recorded for it
        (floats; a step tracked in several calls arrives once, merged)."""
        ...

    def verdict(self, step: int, verdict: ReplayVerdict) -> None:
        """The replay check of the resume, decided at ``step`` (``verdict.status``:
        identical, different, skipped or none; see ``Checkpointer.replay``)."""
        ...

    def close(self) -> None:
        """The Checkpointer closes: write out and release everything."""
        ...


def check_trackers(trackers: Iterable[Any] | None) -> list[Tracker]:
    """``trackers`` as a list, each checked to have the four methods of :class:`Tracker`.

    Raises:
        TypeError: one lacks a method (named, with the index), or ``trackers`` is a
            single tracker rather than a list of them.
    """
    if trackers is None:
        return []
    if isinstance(trackers, Tracker):
        raise TypeError("trackers must be a list of trackers, got a single tracker: [tracker]")
    found = list(trackers)
    for i, tracker in enumerate(found):
        missing = [m for m in _METHODS if not callable(getattr(tracker, m, None))]
        if missing:
            raise TypeError(
                f"trackers[{i}] ({type(tracker).__name__}) has no method "
                f"{', '.join(missing)}: a tracker implements start, log, verdict and close "
                "(unbroken.run.trackers.Tracker)"
            )
    return found


class TrackerHub:
    """The trackers of one Checkpointer: started, fed and closed on rank 0 only (the
    other ranks' hubs hold none and do nothing).

    Args:
        trackers: the Checkpointer's ``trackers`` (checked by :func:`check_trackers`).
        record: the Checkpointer's run record, whose ``replay`` is the verdict of the
            last resume (held here, never the Checkpointer: a Checkpointer dropped
            without ``close()`` is freed at once and lets its folder go).

    Not thread-safe: called from the training loop's thread (``restore``, ``track``,
    ``close``).

    Example::

        hub = TrackerHub([TensorBoardTracker("tb")], record=RunRecord(root))
        hub.start("4f2a...", 0, None)
        hub.log(1, {"loss": 0.5}, run_id="4f2a...")
        hub.close()
    """

    def __init__(self, trackers: Iterable[Any] | None, *, record: RunRecord) -> None:
        found = check_trackers(trackers)  # on every rank: a mistake raises everywhere
        self._trackers = found if collective.rank() == 0 else []
        self._record = record
        self._live: list[Tracker] = []
        self._started = False
        self._told = False  # the resume's verdict was forwarded
        self._last = 0  # the last step forwarded (or the resume's step)

    def start(self, run_id: str, resume_step: int, record: Location | None) -> None:
        """Start every tracker for a run going on after ``resume_step``; ``record``: the
        run folder whose metrics record says what the run tracked before (None: a fresh
        start, nothing). Trackers already started are closed first."""
        if not self._trackers:
            return
        self._close_all()  # a second restore(); the verdict now is the new resume's
        upto = resume_step if record is None else tracked_upto(record, resume_step)
        self._started, self._told, self._last = True, False, resume_step
        self._live = list(self._trackers)
        self._each("start", run_id, resume_step, upto)
        self._verdict()  # decided already at the restore: skipped, or nothing to compare

    def log(self, step: int, metrics: Mapping[str, Any], *, run_id: str) -> None:
        """Forward one complete step (all its metrics, checked already), then the
        resume's verdict if it is now decided. Trackers not started yet (no restore())
        start first, as a fresh run ``run_id``."""
        if not self._trackers:
            return
        if not self._started:
            self.start(run_id, 0, None)
        self._last = step
        self._each("log", step, {k: as_float(k, v) for k, v in metrics.items()})
        self._verdict()

    def close(self) -> None:
        """Forward a verdict decided at the end, then close every started tracker."""
        self._verdict()
        self._close_all()

    def _close_all(self) -> None:
        live, self._live, self._started = self._live, [], False
        for tracker in live:
            _call(tracker, "close")

    def _verdict(self) -> None:
        """Forward the resume's replay verdict, once, when it is decided."""
        if self._told or not self._live:
            return
        replay = self._record.replay
        if replay is not None and replay.status != PENDING:
            self._told = True
            self._each("verdict", self._last, replay)

    def _each(self, method: str, *args: Any) -> None:
        self._live = [t for t in self._live if _call(t, method, *args)]


def _call(tracker: Tracker, method: str, *args: Any) -> bool:
    """``tracker.method(*args)``; False (and a warning) if it raised."""
    try:
        getattr(tracker, method)(*args)
        return True
    except Exception as exc:
        logger.warning(
            "tracker %s failed in %s() (%s: %s); it gets nothing more from this "
            "Checkpointer (training and checkpoints go on)",
            type(tracker).__name__,
            method,
            type(exc).__name__,
            exc,
        )
        return False


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def tracked_upto(root: Location, resume_step: int) -> int:
    """The last step the run recorded in ``root``'s metrics record as complete (at
    least ``resume_step``): the steps an earlier process of the run forwarded. A step is
    forwarded once complete (another step tracked after it, or a ``complete`` line: a
    save, the end), so a process killed while tracking a step had not forwarded it.

    Steps of a run that this one replaced (``overwrite=True``) and steps a Checkpointer
    withdrew (it lost the folder to another run) do not count. An unreadable record
    counts as none: the trackers then take every recomputed step.
    """
    try:
        records = parsed(record_lines(root) or [])
    except (OSError, ValueError, CheckpointError) as exc:
        logger.warning(
            "cannot read the metrics record of %s (%s): trackers get every recomputed step",
            root,
            exc,
        )
        return resume_step
    withdrawn = retractions(records)
    last = resume_step
    marking: set[str] = set()  # segments that mark a step complete (not older versions)
    open_step: dict[str, int] = {}  # segment -> its step tracked last, maybe incomplete
    for line in records:
        segment = line.get("segment")
        if segment in withdrawn and is_withdrawn(line, withdrawn[segment]):
            continue
        if line.get("replaces") is True:
            last = resume_step  # the series begins anew: the run replaced was another
            open_step.clear()
        if "resumed_from" in line and line.get("marks_complete") is True:
            marking.add(segment)
        done, step = line.get("complete"), line.get("step")
        if _is_int(done):  # a save or the end completed the step: it was forwarded
            kept = withdrawn.get(segment, done) if segment in withdrawn else done
            last = max(last, done) if kept is not None and done <= kept else last
            open_step.pop(segment, None)
        elif _is_int(step) and "metrics" in line:
            if segment not in marking:  # an older version forwarded each call at once
                last = max(last, step)
                continue
            held = open_step.get(segment)
            if held is not None and held != step:  # another step completed it
                last = max(last, held)
            open_step[segment] = step
    return last
