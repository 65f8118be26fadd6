"""Tracked metrics: kept in memory, appended as tracked, readable as one series.

Rank 0 appends to ``DIR/metrics.jsonl`` as it tracks (fsynced at every save and at
``close()``; on an object store the same lines go into objects under ``PREFIX/metrics/``,
see :mod:`.metric_objects`): a segment header when a Checkpointer starts (with the step
it resumed from, the segment that saved that checkpoint, and the world size), then one
line per tracked step; health-check warnings and the replay check's verdict have lines
of their own. Reading replays the lines in order: a segment that resumed from step R
drops every later step of the timelines before it, and a replayed step replaces the old
value, so the series has no duplicates and follows the timeline that survived.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import threading
import time
import uuid
from typing import Any

import torch

from ..errors import CheckpointError
from ..storage.interface import Location
from ..storage.locate import location
from ..storage.posix import free_space, writing
from .metric_objects import ObjectLog, object_lines

FILE = "metrics.jsonl"
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


def _from_json(x: float | str) -> float:
    return float(x)


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


class MetricLog:
    """The tracked metrics of one Checkpointer (one segment of a run).

    With a ``root`` (rank 0's log), every tracked step is appended to
    ``root/metrics.jsonl`` as it is tracked: one buffered line and a flush, no fsync, so
    a crash of the process loses nothing tracked (a power loss may lose what the OS had
    not written yet); :meth:`flush`, at each save and at close, fsyncs. Without a root
    (the other ranks) the values stay in memory. A root on an object store keeps the
    lines in memory until :meth:`flush` uploads them (see :mod:`.metric_objects`).
    Thread-safe: a background save may flush while the training loop tracks.
    """

    def __init__(self, root: Location | None = None, *, world_size: int = 1) -> None:
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
        self._objects = ObjectLog(root, self.segment) if root is not None and root.remote else None
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
            r["step"]: {k: _from_json(v) for k, v in r.items() if k != "step"} for r in records
        }
        with self._lock:
            if self._header_queued:  # steps were tracked before the restore: a new segment
                self.segment = uuid.uuid4().hex[:12]
                self._header_queued = False
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

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def _write(self, line: dict[str, Any] | str | None) -> None:
        if not self._header_queued:
            self._header_queued = True
            self._unwritten.append(
                {
                    "segment": self.segment,
                    "resumed_from": self.resumed_from,
                    "parent": self.parent,
                    "world_size": self.world_size,
                    "time": time.time(),
                }
            )
        if line is not None:
            self._unwritten.append(line)
        if self._objects is not None:
            self._objects.write(self._joined(), self.segment)
            self._unwritten = []
            return
        if self._file is None:
            assert self._root is not None
            self._root.mkdir(parents=True, exist_ok=True)
            self._file = open(self._root / FILE, "a", encoding="utf-8")  # noqa: SIM115
        # After a failed write, a newline ends any torn line (readers skip the fragment).
        text = ("\n" if self._torn else "") + self._joined()
        self._file.write(text)
        self._file.flush()
        self._unwritten = []
        self._torn = False

    def _joined(self) -> str:
        return "".join(
            (x if isinstance(x, str) else json.dumps(x, allow_nan=False)) + "\n"
            for x in self._unwritten
        )

    def _drop_file(self) -> None:
        self._torn = True
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


@dataclasses.dataclass
class Series:
    """A run's tracked metrics: ``values[name]`` is a list of (step, value), ascending."""

    values: dict[str, list[tuple[int, float]]]
    resumes: list[int]  # steps at which a resumed segment took over
    warnings: list[tuple[int, str]]  # health-check warnings: (step, text)

    def steps(self, name: str) -> list[int]:
        return [s for s, _ in self.values.get(name, [])]


def record_lines(root: str | os.PathLike | Location) -> list[str] | None:
    """The lines of a run's metrics record, in the order tracked: ``metrics.jsonl`` in a
    local folder, the ``metrics/`` objects on a store; None if nothing was recorded."""
    where = location(root)
    if where.remote:
        return object_lines(where)
    path = where / FILE
    if not path.is_file():
        return None
    return path.read_text(encoding="utf-8", errors="replace").splitlines()


def record_name(root: str | os.PathLike | Location) -> str:
    """Where a run's metrics record is, for messages."""
    where = location(root)
    return f"{where}/metrics/" if where.remote else str(where / FILE)


def read_series(root: str | os.PathLike | Location) -> Series:
    """The surviving timeline of every tracked metric of a run (a local checkpoint
    folder, or a store's URL)."""
    return series_from_lines(record_lines(root) or [])


def series_from_lines(lines: list[str]) -> Series:
    """The surviving timeline of a metrics record's lines (:func:`record_lines`)."""
    by_step: dict[int, dict[str, float]] = {}
    resumes: list[int] = []
    warnings: list[tuple[int, str]] = []
    for raw in lines:
        try:
            line = json.loads(raw)
        except ValueError:
            continue  # a torn last line from a crash mid-append
        if not isinstance(line, dict):
            continue
        if "warning" in line:
            warnings.append((line["step"], line["warning"]))
            continue
        if "step" not in line:
            start = line.get("resumed_from")
            if start is not None:
                by_step = {s: m for s, m in by_step.items() if s <= start}
                resumes = [r for r in resumes if r < start] + [start]
            continue
        by_step[line["step"]] = {k: _from_json(v) for k, v in line["metrics"].items()}
    values: dict[str, list[tuple[int, float]]] = {}
    for s in sorted(by_step):
        for k, v in by_step[s].items():
            values.setdefault(k, []).append((s, v))
    return Series(values=values, resumes=resumes, warnings=warnings)
