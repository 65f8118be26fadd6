"""Tracked metrics: kept in memory and appended to the run's record as tracked (read
back as one series by :mod:`.series`).

Rank 0 appends to the run folder's journal (``Location.journal``: ``DIR/metrics.jsonl``
on a disk, objects under ``PREFIX/metrics/`` on a store): a segment header when a
Checkpointer starts (with the step it resumed from, the segment that saved that
checkpoint, and the world size), then one line per ``track()`` call (a step tracked
in two calls, a loss then an evaluation, has two lines, which readers merge); a
``complete`` line marks a step that a save or ``close()`` completed (module
``run/record.py``); health-check warnings and the replay check's verdict have lines of
their own. Where an append is cheap (a
disk) every line is appended as it is tracked and synced (fsync) at every save and at
``close()``; where every append is a request (a store) the lines wait in memory and go
at every save (at its commit, for a background save), at ``close()``, at interpreter
exit, and from a background thread once the journal's write interval has passed since
the last write (``UNBROKEN_STORE_METRICS_S``, default 30 s), so a process killed
outright loses at most that much. A write that fails is retried with everything tracked
since, so nothing is lost or reordered.

One run's record never mixes into another's (``core/ownership.py`` decides, through a
:class:`RecordGate`): a Checkpointer's lines wait in memory until it has shown that the
folder is its own (it holds the run lock and no other run committed since it started
or restored, or one of its saves committed); a save refused because another run
committed there ends its record: the lines still waiting are dropped, and a
``retracted`` line withdraws those it wrote after its last committed step. Readers also
skip step lines that a segment wrote after a later segment's header (a run that was
still tracking when another took the folder), and a header that ``replaces`` (a run
started with ``overwrite=True``) begins the series anew.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import threading
import time
import uuid
import weakref
from typing import Any, Protocol

import torch

from ..errors import CheckpointError
from ..format.series import RECORD, from_json
from ..storage.interface import Location

logger = logging.getLogger(__name__)


def as_float(name: str, value: float | torch.Tensor) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric {name!r} must be a scalar, got shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"metric {name!r} must be a number or 0-d tensor, got {type(value).__name__}"
        )
    return float(value)


def _json_value(x: float) -> float | str:
    return x if math.isfinite(x) else repr(x)


_KEYS: dict[str, str] = {}  # metric name -> its JSON string


def _step_line(segment: str, step: int, values: dict[str, float]) -> str:
    """``json.dumps({"segment", "step", "metrics"})``, byte for byte, at a third of its
    cost (track() writes one per step): floats use the same ``repr`` JSON does."""
    parts = []
    for name, v in values.items():
        key = _KEYS.get(name)
        if key is None:
            key = _KEYS.setdefault(name, json.dumps(name))
        parts.append(f"{key}: {v!r}" if math.isfinite(v) else f'{key}: "{v!r}"')
    return f'{{"segment": "{segment}", "step": {step}, "metrics": {{{", ".join(parts)}}}}}'


class RecordGate(Protocol):
    """Whether a Checkpointer may write to its folder's record (``core/ownership.py``)."""

    def may_record(self, *, can_list: bool) -> bool | None:
        """True: write now; None: keep the lines in memory; False: the folder is lost."""
        ...

    @property
    def lost(self) -> str | None:
        """Why the folder was lost (a save was refused), or None."""
        ...

    @property
    def committed_step(self) -> int | None:
        """The last step this Checkpointer committed (None: none)."""
        ...

    def holder(self) -> str:
        """Who holds the folder's run lock, for messages."""
        ...


class MetricLog:
    """The tracked metrics of one Checkpointer (one segment of a run).

    With a ``root`` (rank 0's log), every tracked step goes to the journal ``metrics`` of
    ``root`` (``Location.journal``): as it is tracked where appending is cheap (one
    buffered line and a flush, no fsync: a crash of the process loses nothing tracked, a
    power loss what the OS had not written yet), else in batches (module docstring);
    :meth:`flush`, at each save and at close, writes what waits and syncs. Without a root
    (the other ranks) the values stay in memory. With a ``gate``, lines reach the record
    only when it allows (module docstring); ``replaces``: the segment replaces the run
    recorded before (``overwrite=True``).

    Thread-safe: a background save may flush while the training loop tracks; the
    training loop never waits for a request to a store or for an fsync.
    """

    def __init__(
        self,
        root: Location | None = None,
        *,
        world_size: int = 1,
        gate: RecordGate | None = None,
        replaces: bool = False,
    ) -> None:
        self.values: dict[int, dict[str, float]] = {}
        self.segment = uuid.uuid4().hex[:12]
        self.resumed_from: int | None = None
        self.parent: str | None = None  # the segment that saved the checkpoint resumed
        self.world_size = world_size
        self._journal = None if root is None else root.journal(RECORD)
        self._queued: list[dict[str, Any] | str] = []  # lines not in the record yet
        self._header_queued = False
        self._gate = gate
        self._replaces = replaces
        self._revoked = False  # the folder was lost: nothing more is recorded
        self._emitted = False  # lines of this segment were (or may have been) written
        self._failing = False  # the last write failed (warned once per failing stretch)
        self._lock = threading.Lock()  # the queue and the state above
        self._write_lock = threading.Lock()  # one write at a time, in order
        self._background: threading.Thread | None = None
        self._last_write = time.monotonic()
        self._warned_background = False
        if self._journal is not None and self._journal.write_interval is not None:
            _register_exit(self)

    def note(self, step: int, warning: str) -> None:
        """Keep a health-check warning with the series."""
        self.append({"segment": self.segment, "step": step, "warning": warning})

    def track(self, step: int, metrics: dict[str, float | torch.Tensor]) -> None:
        """Record one ``track()`` call: its values join those tracked for ``step`` before
        (a step may be tracked in several calls: the loss, then an evaluation), and its
        line goes to the journal now (readers merge a segment's lines of one step)."""
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"step must be an int, got {step!r}")
        values = {k: as_float(k, v) for k, v in metrics.items()}
        self.values.setdefault(step, {}).update(values)
        if self._journal is not None:
            self.append(_step_line(self.segment, step, values))

    def complete(self, step: int) -> None:
        """Mark ``step`` complete in the journal (a save or the end came after it, so it
        was forwarded to the trackers): a step followed by another step's line needs no
        mark (``run/trackers.py``'s ``tracked_upto`` reads both)."""
        if self._journal is not None:
            self.append({"segment": self.segment, "complete": step})

    def window(self, upto: int, size: int) -> list[dict[str, Any]]:
        steps = sorted(s for s in list(self.values) if s <= upto)[-size:]
        return [
            {"step": s, **{k: _json_value(v) for k, v in self.values[s].items()}} for s in steps
        ]

    def load_window(
        self, records: list[dict[str, Any]], resumed_from: int, parent: str | None = None
    ) -> None:
        """Start the segment of a resume: the saved window, and where it resumed from."""
        self.values = {
            r["step"]: {k: from_json(v) for k, v in r.items() if k != "step"} for r in records
        }
        with self._lock:
            if self._header_queued:  # steps were tracked before the restore: a new segment
                self.segment = uuid.uuid4().hex[:12]
                self._header_queued = False
                self._revoked = self._emitted = False
        self.resumed_from = resumed_from
        self.parent = parent

    def append(self, line: dict[str, Any] | str) -> None:
        """Add one line (a dict, or its JSON) to the record (rank 0): now where appending
        is cheap, else with the next batch. A failed write is logged, not raised (the
        training loop calls this), and retried with the next line or flush."""
        if self._journal is None:
            return
        with self._lock:
            if self._revoked:
                return
            if not self._header_queued:
                self._header_queued = True
                self._queued.append(self._header())
            self._queued.append(line)
            if self._journal.write_interval is not None:
                # Batched: only whether the folder is lost is asked here (no listing).
                if self._gate is not None and self._gate.may_record(can_list=False) is False:
                    self._revoke()
                self._start_background_if_due()
                return
        try:
            self._write_queued(can_list=False)
        except OSError as exc:  # a full disk: the lines stay queued
            if not self._failing:
                logger.warning("%s", exc)
            self._failing = True

    def flush(self, *, strict: bool = True) -> str | None:
        """Write what waits, then make the record durable (fsync; rank 0 only). Returns
        what failed (not strict), else None.

        Args:
            strict: raise if that fails. ``save()`` passes False: its checkpoint is
                committed by then, and a save that raised must have committed nothing,
                so a failure is a logged warning instead; the lines stay queued and are
                written by the next append or flush.
        Raises:
            CheckpointError: (strict) naming the record (on a disk, the free space).
        """
        if self._journal is None:
            return None
        if self._gate is not None and self._gate.lost is not None:
            with self._lock:
                self._revoke()
        with self._lock:
            if not self._header_queued:
                return None  # nothing tracked: no record
        try:
            self._write_queued(can_list=True)
            self._journal.sync()
        except CheckpointError as exc:
            if strict:
                raise
            with self._lock:
                waiting = _step_count(self._queued)
            note = (
                f"{waiting} tracked step(s) are not in the metrics record yet ({exc}); the "
                "checkpoint itself is committed, and they stay queued for the next write"
            )
            logger.warning("%s", note)
            return note
        return None

    def drop_held(self) -> None:
        """At the end (``close()``): lines still waiting for the gate are dropped, with
        a warning naming how many and why (this Checkpointer never showed that the
        folder is its own: another one holds it, or another run committed there)."""
        if self._journal is None or self._gate is None:
            return
        with self._lock:
            held = _step_count(self._queued)
            self._queued = []
        if held:
            logger.warning(
                "%d tracked step(s) of this Checkpointer were not recorded in %s: it "
                "committed no checkpoint there, and the folder is not shown to be its own "
                "(its run lock is held by %s, or another run committed there since it "
                "started); two Checkpointers on one folder record one run only",
                held,
                self._journal,
                self._gate.holder(),
            )

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()

    def pending(self) -> bool:
        """Whether lines wait to be written."""
        with self._lock:
            return bool(self._queued)

    def _write_queued(self, *, can_list: bool) -> None:
        """Write what is queued, if the gate allows (``can_list``: a listing is
        affordable now). One writer at a time, in order; a failed write leaves the lines
        queued, ahead of those tracked since. Raises what the journal raises."""
        assert self._journal is not None
        with self._write_lock:
            allowed: bool | None = True
            if self._gate is not None and not self._revoked:
                # Outside _lock: on a store the gate may list the folder (a request).
                allowed = self._gate.may_record(can_list=can_list)
            with self._lock:
                if allowed is False:
                    self._revoke()
                if not self._revoked and allowed is not True:
                    return  # held until the folder is shown to be this run's
                taken, self._queued = self._queued, []
                revoked = self._revoked
                if taken:
                    self._emitted = True
                self._last_write = time.monotonic()
            if not taken:
                return
            try:
                self._journal.append(_joined(taken))
            except BaseException:
                with self._lock:  # lost meanwhile: its retraction, queued, covers them
                    if self._revoked == revoked:
                        self._queued = taken + self._queued
                raise
            self._failing = False

    def _header(self) -> dict[str, Any]:
        header = {
            "segment": self.segment,
            "resumed_from": self.resumed_from,
            "parent": self.parent,
            "world_size": self.world_size,
            "time": time.time(),
            "marks_complete": True,  # its last step counts as forwarded once marked
        }
        if self._replaces:
            header["replaces"] = True
        return header

    def _revoke(self) -> None:
        """The folder is lost (holding ``_lock``): drop what waits, withdraw what this
        segment wrote after its last committed step (a line written with the next write,
        never held by the gate), record nothing more."""
        if self._revoked or self._gate is None:
            return
        self._revoked = True
        held = _step_count(self._queued)
        self._queued = []
        if self._emitted:
            retraction = {
                "segment": self.segment,
                "retracted": True,
                "kept_upto": self._gate.committed_step,
                "reason": self._gate.lost,
            }
            self._queued.append(retraction)
        logger.warning(
            "this Checkpointer lost its folder (%s): its tracked steps are no longer "
            "recorded in %s%s",
            self._gate.lost,
            self._journal,
            f"; {held} step(s) waiting in memory were dropped" if held else "",
        )

    def _start_background_if_due(self) -> None:
        """(Holding ``_lock``, batched journals) start a write in the background once the
        journal's interval has passed since the last write, one at a time."""
        interval = self._journal.write_interval if self._journal is not None else None
        if interval is None or time.monotonic() - self._last_write < interval:
            return
        if self._background is not None and self._background.is_alive():
            return
        self._last_write = time.monotonic()  # one background write per interval
        self._background = threading.Thread(
            target=self._write_quietly, name="unbroken-metrics-upload", daemon=True
        )
        self._background.start()

    def _write_quietly(self) -> None:
        try:
            self._write_queued(can_list=True)
        except (OSError, CheckpointError) as exc:
            if not self._warned_background:
                self._warned_background = True
                logger.warning(
                    "%s (the tracked steps stay queued and are written with the next save)",
                    exc,
                )


def _joined(lines: list[dict[str, Any] | str]) -> str:
    return "".join(
        (x if isinstance(x, str) else json.dumps(x, allow_nan=False)) + "\n" for x in lines
    )


def _step_count(lines: list[dict[str, Any] | str]) -> int:
    """How many of the queued ``lines`` are tracked steps (those are strings)."""
    return sum(isinstance(x, str) for x in lines)


_open_logs: weakref.WeakSet[MetricLog] = weakref.WeakSet()
_exit_lock = threading.Lock()
_exit_registered = False


def _register_exit(log: MetricLog) -> None:
    global _exit_registered
    with _exit_lock:
        _open_logs.add(log)
        if not _exit_registered:
            atexit.register(_write_at_exit)
            _exit_registered = True


def _write_at_exit() -> None:
    """What a Checkpointer never closed still holds is written before the process ends
    (batched journals: elsewhere every line was written as it was tracked)."""
    for log in list(_open_logs):
        if log.pending():
            try:
                log._write_queued(can_list=True)
            except Exception as exc:  # nobody is left to raise it to
                logger.error("tracked steps lost at exit: %s", exc)
