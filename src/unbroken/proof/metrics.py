"""Tracked metrics: kept in memory, written with each save, readable as one series.

Rank 0 appends to ``DIR/metrics.jsonl`` at every save and at ``close()``: a segment
header when a Checkpointer starts (with the step it resumed from), then one line per
tracked step. Reading replays the file in order: a segment that resumed from step R
drops every later step of the timelines before it, and a replayed step replaces the old
value, so the series has no duplicates and follows the timeline that survived.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

FILE = "metrics.jsonl"


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


class MetricLog:
    """The tracked metrics of one Checkpointer (one segment of a run)."""

    def __init__(self) -> None:
        self.values: dict[int, dict[str, float]] = {}
        self.segment = uuid.uuid4().hex[:12]
        self.resumed_from: int | None = None
        self._flushed: set[int] = set()
        self._header_written = False
        self._notes: list[dict[str, Any]] = []
        # track() runs in the training loop while a background save may flush.
        self._lock = threading.Lock()

    def note(self, step: int, warning: str) -> None:
        """Keep a health-check warning with the series (written at the next flush)."""
        self._notes.append({"segment": self.segment, "step": step, "warning": warning})

    def track(self, step: int, metrics: dict[str, float | torch.Tensor]) -> None:
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"step must be an int, got {step!r}")
        values = {k: as_float(k, v) for k, v in metrics.items()}
        with self._lock:
            self.values[step] = values
            self._flushed.discard(step)

    def window(self, upto: int, size: int) -> list[dict[str, Any]]:
        with self._lock:
            steps = sorted(s for s in self.values if s <= upto)[-size:]
        return [
            {"step": s, **{k: _json_value(v) for k, v in self.values[s].items()}} for s in steps
        ]

    def load_window(self, records: list[dict[str, Any]], resumed_from: int) -> None:
        self.values = {
            r["step"]: {k: _from_json(v) for k, v in r.items() if k != "step"} for r in records
        }
        self._flushed = set(self.values)  # already in the file, from the earlier segment
        self.resumed_from = resumed_from

    def flush(self, root: Path) -> None:
        """Append unwritten steps to ``root/metrics.jsonl`` (rank 0 only)."""
        with self._lock:
            pending = sorted(s for s in self.values if s not in self._flushed)
            records = {s: dict(self.values[s]) for s in pending}
            notes, self._notes = self._notes, []
        if not pending and not notes:
            return
        lines = []
        if not self._header_written:
            header = {
                "segment": self.segment,
                "resumed_from": self.resumed_from,
                "time": time.time(),
            }
            lines.append(header)
        for s in pending:
            values = {k: _json_value(v) for k, v in records[s].items()}
            lines.append({"segment": self.segment, "step": s, "metrics": values})
        lines.extend(notes)
        root.mkdir(parents=True, exist_ok=True)
        with open(root / FILE, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(line, allow_nan=False) + "\n" for line in lines))
            f.flush()
            os.fsync(f.fileno())
        self._header_written = True
        with self._lock:
            self._flushed.update(pending)


@dataclasses.dataclass
class Series:
    """A run's tracked metrics: ``values[name]`` is a list of (step, value), ascending."""

    values: dict[str, list[tuple[int, float]]]
    resumes: list[int]  # steps at which a resumed segment took over
    warnings: list[tuple[int, str]]  # health-check warnings: (step, text)

    def steps(self, name: str) -> list[int]:
        return [s for s, _ in self.values.get(name, [])]


def read_series(root: str | os.PathLike) -> Series:
    """The surviving timeline of every tracked metric in a checkpoint folder."""
    path = Path(root) / FILE
    by_step: dict[int, dict[str, float]] = {}
    resumes: list[int] = []
    warnings: list[tuple[int, str]] = []
    if path.is_file():
        for raw in path.read_text(encoding="utf-8").splitlines():
            try:
                line = json.loads(raw)
            except ValueError:
                continue  # a torn last line from a crash mid-append
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
