"""One run per folder: a save never mixes two live runs' checkpoints, nor their records.

A run is named by its lineage's first event (``run``, kept across its resumes); one
Checkpointer's part of it by the ``segment`` of its own start or resume event, the last
event of every checkpoint it commits. A :class:`FolderClaim` is what a Checkpointer
knows of its folder (rank 0 acts, the collectives around it agree):

- its *baseline*: the committed steps, each with its mark (``CheckpointDir.step_marks``:
  it changes when a step is committed again), listed when ``restore()`` returned (after
  its clean-up, which may put back a step whose re-save crashed; a fresh start finds
  none), or when it was made with ``overwrite=True`` (the run it replaces); without
  either, none: every step belongs to another run;
- :meth:`FolderClaim.check`, before a save writes anything (holding the save lock): the
  folder is listed once; a step that is not in the baseline with the same mark is read
  (its manifest, nothing else) and, unless this Checkpointer committed it, refuses the
  save with :class:`OtherRunError` naming both runs, the step and what to do. So the
  cost is one listing per save; manifests are read only of steps someone else wrote;
- :meth:`FolderClaim.committed`, after each commit: the step joins the baseline, so a
  Checkpointer never reads back its own steps.

Its record (``metrics.jsonl``) follows the same rule (:meth:`FolderClaim.may_record`):
a Checkpointer writes its tracked steps as it tracks them once it holds the folder's run
lock (local folders: ``CheckpointDir.run_lock``, held until ``close()``) and no other
run has committed since its baseline, or once one of its saves committed; until then
they wait in memory. A Checkpointer whose save was refused has lost the folder: its
record takes no more steps (see ``run/metrics.py``).

Limits: an object store has no locks, so there a Checkpointer that has not committed
yet writes its record whenever no other run has committed since its baseline (asked at
each upload), and a second job that never saves leaves its steps there, marked with its
segment. Two saves of one step racing on a store (both passed :meth:`FolderClaim.check`)
are decided at the commit (``CheckpointDir.commit``): the manifest is written
create-only, and a step found committed is replaced only if :func:`other_writer` finds
its lineage's last event in the saving run's lineage; else the save fails naming the
step, and nothing of the other's is moved or deleted. Of two different steps both may
commit, and each run's next save is then refused.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from ..errors import CheckpointError
from ..format import manifest
from ..storage.interface import CheckpointDir

logger = logging.getLogger(__name__)
_SHOWN = 5


class OtherRunError(CheckpointError):
    """A save refused: the folder holds steps of another run, committed since this one
    started or restored (or before, and this one neither restored nor overwrote)."""


class FolderClaim:
    """What one Checkpointer knows of its folder: the steps it may keep beside its own.

    Rank 0's methods only, except that every rank may construct one. Thread-safe: a
    background save checks and commits while the training thread records.

    Args:
        ckdir: the run folder.
        overwrite: the Checkpointer replaces the run whose checkpoints are there now.
    """

    def __init__(self, ckdir: CheckpointDir, *, overwrite: bool = False) -> None:
        self._dir = ckdir
        self._overwrite = overwrite
        # step -> mark: ours, or the run we continue (None: taken at the next check)
        self._known: dict[int, str] | None = {}
        self._began: str | None = None  # "fresh" or "restored": what restore() did
        self._restored: int | None = None
        self._committed: int | None = None  # the last step this Checkpointer committed
        self._lost: str | None = None  # why this Checkpointer lost the folder
        self._unchallenged: bool | None = None  # asked once the run lock is held
        self._run_lock = ckdir.run_lock()
        self._released = False  # close(): the lock is never taken again
        self._mutex = threading.Lock()

    # -- the baseline ------------------------------------------------------------------

    def replaces(self) -> None:
        """``overwrite=True``: the steps committed now belong to the run being replaced
        (its first save retires them)."""
        marks = self._marks()
        with self._mutex:
            self._known = marks

    def restored(self, step: int | None) -> None:
        """``restore()`` finished (``step``: the step restored, None for a fresh start):
        the steps committed now are the baseline."""
        marks = self._marks()
        with self._mutex:
            self._known = marks
            self._began = "fresh" if step is None else "restored"
            self._restored = step
            self._unchallenged = None
            self._lost = None

    # -- saves -------------------------------------------------------------------------

    def check(self, step: int, lineage: list[dict[str, Any]]) -> None:
        """Before a save of ``step`` writes anything (holding the save lock): refuse it
        if a step of another run was committed since the baseline.

        Raises:
            OtherRunError: naming both runs, the step found and what to do; this
                Checkpointer has then lost the folder (its record takes no more steps).
        """
        ours = lineage[-1].get("segment") if lineage else None
        now = self._dir.step_marks()
        with self._mutex:
            if self._known is None:  # its listing failed: the steps now are the baseline
                self._known = dict(now)
            self._known = {s: m for s, m in self._known.items() if s in now}
            new = [s for s in sorted(now, reverse=True) if self._known.get(s) != now[s]]
        for s in new:
            theirs = _lineage_of(self._dir, s)
            if ours is not None and theirs and theirs[-1].get("segment") == ours:
                with self._mutex:
                    self._known[s] = now[s]  # committed by us (an earlier save's answer lost)
                continue
            message = self._refusal(step, s, sorted(new), lineage, theirs)
            with self._mutex:
                self._lost = message
            raise OtherRunError(message)

    def committed(self, step: int) -> None:
        """A save of ``step`` committed: it is ours. Never raises (the save is done)."""
        try:
            mark = self._dir.step_mark(step)
        except (OSError, CheckpointError):  # the next check reads it back: ours
            mark = None
        with self._mutex:
            if mark is not None and self._known is not None:
                self._known[step] = mark
            self._committed = step

    # -- the record --------------------------------------------------------------------

    def may_record(self, *, can_list: bool) -> bool | None:
        """Whether this Checkpointer may write its tracked steps to the folder's record
        now: True; None (keep them in memory: it has not shown that the folder is its
        own); False (it lost the folder: see :attr:`lost`).

        ``can_list``: a listing is affordable now (an upload to a store); otherwise only
        the run lock is asked (one system call), and the folder listed once, when the
        lock is first taken.
        """
        if self._lost is not None:
            return False
        # Taken also once it committed, so that a later job sees it held.
        held = not self._released and self._run_lock.hold()
        if self._committed is not None:
            return True
        if held:
            if self._unchallenged is None:
                self._unchallenged = self._no_new_steps()
            return True if self._unchallenged else None
        if can_list and not self._dir.has_locks:
            return True if self._no_new_steps() else None
        return None

    @property
    def lost(self) -> str | None:
        """Why this Checkpointer lost the folder (a save was refused), or None."""
        return self._lost

    @property
    def committed_step(self) -> int | None:
        """The last step this Checkpointer committed (None: none yet)."""
        return self._committed

    def holder(self) -> str:
        """Who holds the folder's run lock, for messages."""
        return self._run_lock.holder()

    def release(self) -> None:
        """Let go of the run lock (``close()``) for good."""
        self._released = True
        self._run_lock.release()

    # -- helpers -----------------------------------------------------------------------

    def _marks(self) -> dict[int, str] | None:
        """The committed steps and their marks now; None (logged) if they cannot be
        listed (the next save's check takes them instead)."""
        try:
            return self._dir.step_marks()
        except (OSError, CheckpointError) as exc:
            logger.warning("cannot list %s (%s)", self._dir.root, exc)
            return None

    def _no_new_steps(self) -> bool:
        try:
            now = self._dir.step_marks()
        except (OSError, CheckpointError):
            return False
        with self._mutex:
            known = self._known or {}
            return all(known.get(s) == m for s, m in now.items())

    def _refusal(
        self,
        step: int,
        found: int,
        new: list[int],
        lineage: list[dict[str, Any]],
        theirs: list[dict[str, Any]] | None,
    ) -> str:
        root = self._dir.root
        ours_run = _run(lineage)
        their_run = _run(theirs) if theirs else "unknown (its manifest cannot be read)"
        shown = ", ".join(map(str, new[:_SHOWN])) + (", ..." if len(new) > _SHOWN else "")
        if self._began is None and not self._overwrite:
            return (
                f"{root} already holds committed checkpoints of another run (run "
                f"{their_run}: steps {shown}) and this Checkpointer (run {ours_run}) did "
                "not restore from them: saving step "
                f"{step} here would mix two runs (retention would delete steps of both, "
                "and restore() could pick either). Nothing was written. Call "
                "ckpt.restore() first to continue that run, use a new folder, or pass "
                "Checkpointer(..., overwrite=True) to replace that run (its checkpoints "
                "are kept aside as .retired-step_*, not deleted)"
            )
        since = {
            "fresh": "started fresh",
            "restored": f"restored step {self._restored}",
            None: "was made",
        }[self._began]
        same = their_run == ours_run
        who = (
            f"another job continuing the same run {their_run} ({_event(theirs)})"
            if same
            else f"another run (run {their_run}, {_event(theirs)})"
        )
        return (
            f"step {found} in {root} was committed by {who} after this Checkpointer (run "
            f"{ours_run}, segment {_segment(lineage)}) {since}: two live jobs are saving "
            f"into one folder. This save of step {step} was refused and nothing was "
            f"written; the other run's checkpoints (step(s) {shown}) are untouched. Stop "
            "one of the jobs (then restore() in the one that goes on), or give each its "
            "own folder (two models of one job, an actor and a critic: one Checkpointer "
            "with model={'actor': ..., 'critic': ...}, or one folder each)"
        )


def other_writer(committed: bytes, lineage: list[dict[str, Any]]) -> str | None:
    """Who committed the manifest ``committed`` (its bytes), found at the step that a save
    with ``lineage`` commits, if not that save's own run; None if the save may replace it.

    It may if the old copy's last lineage event (a segment: one Checkpointer's start or
    resume) is one of ``lineage``'s: its own earlier save, or the step it resumed from
    (lineages older than segments: the old lineage is a prefix of the new one). An
    unreadable manifest is no run's: a damaged step, replaced as before.

    Example::

        folder.commit(partial, 5, manifest=data,
                      other_writer=lambda old: other_writer(old, lineage))
    """
    theirs = _lineage_in(committed)
    ours = lineage if lineage and all(isinstance(e, dict) for e in lineage) else None
    if theirs is None or ours is None:
        return None
    last = theirs[-1]
    if last.get("segment") is not None:
        if last["segment"] in {e.get("segment") for e in ours}:
            return None
    elif ours[: len(theirs)] == theirs:
        return None
    run = (theirs[0] or {}).get("run", "unknown")
    return f"run {run}, segment {last.get('segment', 'unknown')}"


def _lineage_in(data: bytes) -> list[dict[str, Any]] | None:
    """The lineage in a manifest's bytes (None: unreadable, or none)."""
    try:
        lineage = json.loads(data).get("lineage")
    except (ValueError, AttributeError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(lineage, list) or not lineage:
        return None
    if not all(isinstance(e, dict) for e in lineage):
        return None
    return lineage


def _lineage_of(ckdir: CheckpointDir, step: int) -> list[dict[str, Any]] | None:
    """The lineage of committed ``step`` (its manifest read and checked), or None."""
    try:
        lineage = manifest.read(ckdir.copy_path(step)).get("lineage")
    except (OSError, CheckpointError):
        return None
    return lineage if isinstance(lineage, list) and lineage else None


def _run(lineage: list[dict[str, Any]] | None) -> str:
    return str((lineage or [{}])[0].get("run") or "unknown (an older checkpoint)")


def _segment(lineage: list[dict[str, Any]] | None) -> str:
    return str((lineage or [{}])[-1].get("segment") or "unknown")


def _event(lineage: list[dict[str, Any]] | None) -> str:
    last = (lineage or [{}])[-1]
    how = (
        f"resumed from step {last.get('from_step')}"
        if last.get("event") == "resume"
        else "started fresh"
    )
    return f"{how}, segment {_segment(lineage)}"
