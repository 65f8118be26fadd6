"""A run's metrics record read back as one series of each tracked metric.

The lines (:func:`record_lines`: the run folder's journal ``metrics``, which is
``metrics.jsonl`` in a local folder and the objects under ``metrics/`` on a store;
written by :mod:`.metrics`) are replayed in order: a segment that
resumed from step R drops every later step of the timelines before it, and a replayed
step replaces the old value, so the series has no duplicates and follows the timeline
that survived. A segment's lines of one step (a step tracked in several calls: the
loss, then an evaluation) are one step holding all their metrics. Lines of another run never count: a ``retracted`` line withdraws its
segment's steps after the step it kept, step lines a segment wrote after a later
segment's header are skipped, and a header that ``replaces`` (``overwrite=True``)
begins the series anew.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from typing import Any

from ..storage.interface import Location
from ..storage.locate import location

RECORD = "metrics"  # the run folder's journal of tracked metrics
FILE = "metrics.jsonl"  # what that journal is in a local folder


def from_json(x: float | str) -> float:
    """A recorded value (non-finite ones are recorded as strings) as a float."""
    return float(x)


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
    return location(root).journal(RECORD).lines()


def record_name(root: str | os.PathLike | Location) -> str:
    """Where a run's metrics record is, for messages."""
    return str(location(root).journal(RECORD))


def read_series(root: str | os.PathLike | Location) -> Series:
    """The surviving timeline of every tracked metric of a run (a local checkpoint
    folder, or a store's URL)."""
    return series_from_lines(record_lines(root) or [])


def series_from_lines(lines: list[str]) -> Series:
    """The surviving timeline of a metrics record's lines (:func:`record_lines`)."""
    records = parsed(lines)
    withdrawn = retractions(records)  # segment -> steps kept (None: none)
    by_step: dict[int, dict[str, float]] = {}
    owner: dict[int, str | None] = {}  # step -> the segment whose lines it holds
    resumes: list[int] = []
    warnings: list[tuple[int, str]] = []
    current = None  # the segment whose header came last
    for line in records:
        segment = line.get("segment")
        if segment in withdrawn and is_withdrawn(line, withdrawn[segment]):
            continue
        if "step" not in line:
            if "resumed_from" not in line:
                continue  # a replay verdict, a retraction, a step marked complete
            current = segment
            if line.get("replaces"):
                by_step, resumes, warnings = {}, [], []
            start = line.get("resumed_from")
            if start is not None:
                by_step = {s: m for s, m in by_step.items() if s <= start}
                resumes = [r for r in resumes if r < start] + [start]
            continue
        if current is not None and segment is not None and segment != current:
            continue  # written after another run's segment began: not this timeline
        if "warning" in line:
            warnings.append((line["step"], line["warning"]))
            continue
        step = line["step"]
        if step not in by_step or owner[step] != segment:  # a recomputed step replaces
            by_step[step], owner[step] = {}, segment
        by_step[step].update({k: from_json(v) for k, v in line["metrics"].items()})
    values: dict[str, list[tuple[int, float]]] = {}
    for s in sorted(by_step):
        for k, v in by_step[s].items():
            values.setdefault(k, []).append((s, v))
    return Series(values=values, resumes=resumes, warnings=warnings)


def parsed(lines: Iterable[str]) -> list[dict[str, Any]]:
    """A record's lines as JSON objects, in order; a torn line (a crash mid-append) and
    anything that is not an object are left out."""
    records = []
    for raw in lines:
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict):
            records.append(line)
    return records


def retractions(records: Iterable[dict[str, Any]]) -> dict[str, int | None]:
    """Segment -> the last step it kept (None: none), for every segment a ``retracted``
    line withdrew (a Checkpointer that lost the folder to another run)."""
    found: dict[str, int | None] = {}
    for line in records:
        if line.get("retracted") is True and isinstance(line.get("segment"), str):
            kept = line.get("kept_upto")
            found[line["segment"]] = kept if isinstance(kept, int) else None
    return found


def is_withdrawn(line: dict[str, Any], kept: int | None) -> bool:
    """Whether a withdrawn segment's ``line`` is out: its steps after ``kept``, and its
    header too if it kept none."""
    step = line.get("step")
    if isinstance(step, int):
        return kept is None or step > kept
    return kept is None and "resumed_from" in line
