"""Tracked metrics: kept in memory and appended to the run's record as tracked (read
back as one series by :mod:`.series`).

Rank 0 appends to ``DIR/metrics.jsonl`` as it tracks (fsynced at every save and at
``close()``; on an object store the same lines go into objects under ``PREFIX/metrics/``,
see :mod:`.metric_objects`): a segment header when a Checkpointer starts (with the step
it resumed from, the segment that saved that checkpoint, and the world size), then one
line per tracked step; health-check warnings and the replay check's verdict have lines
of their own.

One run's record never mixes into another's (``run/ownership.py`` decides, through a
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

import contextlib
import json
import logging
import math
import os
import threading
import time
import uuid
from typing import Any, Protocol

import torch

from ..errors import CheckpointError
from ..format.series import FILE, from_json, record_name
from ..storage.interface import Location
from ..storage.posix import free_space, no_link_opener, writing
from .metric_objects import ObjectLog

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
    """Whether a Checkpointer may write to its folder's record (``run/ownership.py``)."""

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

    With a ``root`` (rank 0's log), every tracked step is appended to
    ``root/metrics.jsonl`` as it is tracked: one buffered line and a flush, no fsync, so
    a crash of the process loses nothing tracked (a power loss may lose what the OS had
    not written yet); :meth:`flush`, at each save and at close, fsyncs. Without a root
    (the other ranks) the values stay in memory. A root on an object store keeps the
    lines in memory until :meth:`flush` uploads them (see :mod:`.metric_objects`).
    With a ``gate``, lines reach the record only when it allows (module docstring);
    ``replaces``: the segment replaces the run recorded before (``overwrite=True``).
    Thread-safe: a background save may flush while the training loop tracks.
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
        self._root = root
        self._file: Any = None
        self._unwritten: list[dict[str, Any] | str] = []  # lines a failed write left behind
        self._torn = False  # a failed write may have left half a line in the file
        self._header_queued = False
        self._gate = gate
        self._replaces = replaces
        self._revoked = False  # the folder was lost: nothing more is recorded
        self._emitted = False  # lines of this segment reached the record
        self._objects = None
        if root is not None and root.remote:
            permit = None if gate is None else (lambda: gate.may_record(can_list=True))
            self._objects = ObjectLog(root, self.segment, permit=permit)
        # track() runs in the training loop while a background save may flush.
        self._lock = threading.Lock()

    def note(self, step: int, warning: str) -> None:
        """Keep a health-check warning with the series."""
        self.append({"segment": self.segment, "step": step, "warning": warning})

    def track(self, step: int, metrics: dict[str, float | torch.Tensor]) -> None:
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"step must be an int, got {step!r}")
        values = {k: as_float(k, v) for k, v in metrics.items()}
        self.values[step] = values
        if self._root is not None:
            self.append(_step_line(self.segment, step, values))

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
        """Append one line (a dict, or its JSON) now (rank 0); an I/O error is logged and
        the line written with the next one."""
        if self._root is None:
            return
        with self._lock:
            try:
                self._write(line)
            except OSError as exc:
                if not self._torn:
                    logger.warning("cannot append to %s (%s; %s free there); retried with the "
                                   "next line", self._root / FILE, exc,
                                   free_space(self._root))  # fmt: skip
                self._drop_file()

    def flush(self, *, strict: bool = True) -> None:
        """Write what a failed append left behind and fsync the file (rank 0 only).

        Args:
            strict: raise if that fails. ``save()`` passes False: its checkpoint is
                committed by then, and a save that raised must have committed nothing,
                so a failure is a logged warning instead; the lines stay queued and are
                written by the next append or flush.
        Raises:
            CheckpointError: (strict) naming the file and the free space.
        """
        if self._root is None:
            return
        if self._gate is not None and self._gate.lost is not None:
            with self._lock:
                self._revoke()
        if self._objects is not None:
            try:
                self._objects.upload()
            except CheckpointError as exc:
                if strict:
                    raise
                logger.warning("%s (the checkpoint itself is committed; the tracked steps "
                               "stay queued for the next upload)", exc)  # fmt: skip
            return
        path = self._root / FILE
        try:
            with writing(path, "writing", "free space: the tracked steps not on disk yet stay "
                         "queued and are written by the next append or flush"):  # fmt: skip
                with self._lock:
                    if not self._header_queued:
                        return  # nothing tracked: no file
                    try:
                        if self._unwritten or self._file is None:
                            self._write(None)
                        if self._file is None:
                            return  # held in memory, or revoked: nothing of ours to sync
                        fd = os.dup(self._file.fileno())
                    except OSError:
                        self._drop_file()
                        raise
                try:
                    os.fsync(fd)  # outside the lock: track() need not wait for the disk
                finally:
                    os.close(fd)
        except CheckpointError as exc:
            if strict:
                raise
            logger.warning("%s (the checkpoint itself is committed)", exc)

    def drop_held(self) -> None:
        """At the end (``close()``): lines still waiting for the gate are dropped, with
        a warning naming how many and why (this Checkpointer never showed that the
        folder is its own: another one holds it, or another run committed there)."""
        if self._root is None or self._gate is None:
            return
        with self._lock:
            held = _step_count(self._unwritten)
            self._unwritten = []
        if self._objects is not None:
            held += self._objects.drop_pending()
        if held:
            logger.warning(
                "%d tracked step(s) of this Checkpointer were not recorded in %s: it "
                "committed no checkpoint there, and the folder is not shown to be its own "
                "(its run lock is held by %s, or another run committed there since it "
                "started); two Checkpointers on one folder record one run only",
                held, record_name(self._root), self._gate.holder(),
            )  # fmt: skip

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def _write(self, line: dict[str, Any] | str | None) -> None:
        if self._revoked:
            return
        if not self._header_queued:
            self._header_queued = True
            header = {
                "segment": self.segment,
                "resumed_from": self.resumed_from,
                "parent": self.parent,
                "world_size": self.world_size,
                "time": time.time(),
            }
            if self._replaces:
                header["replaces"] = True
            self._unwritten.append(header)
        if line is not None:
            self._unwritten.append(line)
        allowed = True if self._gate is None else self._gate.may_record(can_list=False)
        if allowed is False:
            self._revoke()
            return
        if self._objects is not None:  # uploads ask the gate again (listing the folder)
            self._objects.write(self._joined(), self.segment)
            self._unwritten = []
            self._emitted = True
            return
        if allowed is None:
            return  # held until the folder is shown to be this run's
        if self._file is None:
            assert self._root is not None
            self._root.mkdir(parents=True, exist_ok=True)
            self._file = self._open()
        # After a failed write, a newline ends any torn line (readers skip the fragment).
        text = ("\n" if self._torn else "") + self._joined()
        self._file.write(text)
        self._file.flush()
        self._unwritten = []
        self._torn = False
        self._emitted = True

    def _revoke(self) -> None:
        """The folder is lost (holding ``_lock``): drop what waits, withdraw what this
        segment wrote after its last committed step, record nothing more."""
        if self._revoked or self._gate is None:
            return
        self._revoked = True
        held = _step_count(self._unwritten)
        self._unwritten = []
        retraction = json.dumps({"segment": self.segment, "retracted": True,
                                 "kept_upto": self._gate.committed_step,
                                 "reason": self._gate.lost})  # fmt: skip
        if self._objects is not None:
            held += self._objects.retract(retraction + "\n")
        elif self._emitted:
            try:
                if self._file is None:
                    self._file = self._open()
                self._file.write(("\n" if self._torn else "") + retraction + "\n")
                self._file.flush()
            except OSError as exc:
                logger.warning("cannot withdraw this run's steps from %s: %s",
                               record_name(self._root), exc)  # fmt: skip
        logger.warning(
            "this Checkpointer lost its folder (%s): its tracked steps are no longer "
            "recorded in %s%s",
            self._gate.lost, record_name(self._root),
            f"; {held} step(s) waiting in memory were dropped" if held else "",
        )  # fmt: skip

    def _joined(self) -> str:
        return "".join(
            (x if isinstance(x, str) else json.dumps(x, allow_nan=False)) + "\n"
            for x in self._unwritten
        )

    def _open(self) -> Any:
        """``metrics.jsonl`` for appending, never through a symbolic link (it would append
        to whatever the link points at): a link raises ``CheckpointError`` naming it."""
        assert self._root is not None
        return open(self._root / FILE, "a", encoding="utf-8", opener=no_link_opener)

    def _drop_file(self) -> None:
        self._torn = True
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


def _step_count(lines: list[dict[str, Any] | str]) -> int:
    """How many of the queued ``lines`` are tracked steps (those are strings)."""
    return sum(isinstance(x, str) for x in lines)
