"""A run's lineage: its identity from the first start through every resume, fork and
reset, as each checkpoint's manifest records it (``lineage``: a list of events).

The first event is the ``start`` that began the run; its ``run`` field is the run's id,
32 hex digits, valid as is as a tracker's run id (W&B) and in paths
(``format.schema.RUN_ID``, which also refuses a hostile one). Each Checkpointer that
continues the run appends one ``resume`` event; its ``segment`` names that
Checkpointer's part of the run (its tracked steps in the metrics record, and the owner
of the steps it commits: ``run/ownership.py``).

Branches: restoring a step S while newer steps are committed (a rollback, or a fallback
past a damaged checkpoint) starts a branch that abandons them. Nothing changes on disk
until the branch's first save: just before it commits, the committed steps newer than S
are retired (kept aside as ``.retired-step_*``) and listed under ``retired`` in the
resume event. So ``restore()``, which takes the newest committed step, always follows
the newest lineage, retention never counts the abandoned steps, and nothing is deleted
silently. A crash after the resume but before that save leaves the abandoned steps the
newest (the branch was never committed), which is what a relaunch should resume.

A checkpoint written before run ids existed gets an id derived from its lineage's first
event, which every later checkpoint of the run copies: the same id at every restore. A
lineage with no event at all (a hand-made manifest) gets a synthetic ``start`` event
holding an id derived from the checkpoint itself, so the next save records it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable
from typing import Any

import xxhash

from ..core import collective
from ..errors import CheckpointError

Event = dict[str, Any]


class Lineage:
    """The events a checkpoint of this run records, and the run's id once decided.

    Immutable: every change returns a new ``Lineage``, so an in-flight asynchronous save
    still writes the events it was given.
    """

    def __init__(self, events: list[Event], run_id: str | None = None) -> None:
        self.events = events
        self.run_id = run_id  # None until agreed by every rank

    @classmethod
    def start(cls, segment: str) -> Lineage:
        """A new run's lineage: its ``start`` event, with this rank's own new id (one
        rank's is made everyone's by :meth:`agree`)."""
        event = {
            "event": "start",
            "run": uuid.uuid4().hex,
            "time": time.time(),
            "world_size": collective.world_size(),
            "segment": segment,  # its tracked steps in the metrics record
        }
        return cls([event])

    @classmethod
    def restored(cls, doc: dict[str, Any]) -> Lineage:
        """The lineage a restore of manifest ``doc`` continues, with the run's id.

        Args:
            doc: a manifest read and checked by ``format.manifest.read`` (a ``run`` in it
                is a valid id).
        """
        events = list(doc["lineage"])
        if not events:  # no start event to keep the id in: one is added, and saved next
            start = {"event": "start", "run": _derived([doc["step"], doc.get("created_unix")])}
            return cls([start], start["run"])
        run = events[0].get("run")
        return cls(events, run if isinstance(run, str) else _derived(events[0]))

    def agree(self) -> Lineage:
        """This lineage whose first event carries rank 0's run id on every rank, that id
        decided. Collective."""
        run = collective.from_rank0(self.events[0]["run"])
        return Lineage([{**self.events[0], "run": run}, *self.events[1:]], run)

    def resumed(
        self,
        from_step: int,
        *,
        segment: str,
        reset: Iterable[str],
        skipped: Iterable[str],
        source: str | None = None,
    ) -> Lineage:
        """This lineage continued by a resume from ``from_step``: ``reset`` components
        started fresh, ``skipped`` ones left out on purpose; ``source``: the tier it was
        restored from (``RestoreReport.source``)."""
        event = {
            "event": "resume",
            "from_step": from_step,
            "time": time.time(),
            "world_size": collective.world_size(),
            "reset": sorted(reset),
            "skipped": sorted(skipped),
            "segment": segment,
        }
        if source is not None:
            event["tier"] = source
        return Lineage([*self.events, event], self.run_id)

    def amended(self, **fields: Any) -> Lineage:
        """This lineage whose last event also carries ``fields`` (the steps a branch
        retired, the replay verdict so far)."""
        if not self.events:
            return self
        return Lineage([*self.events[:-1], {**self.events[-1], **fields}], self.run_id)

    @property
    def segment(self) -> str | None:
        """The segment of the last event: the Checkpointer that saves now."""
        return self.events[-1].get("segment") if self.events else None


def saved_by(doc: dict[str, Any]) -> str | None:
    """The metrics segment that saved the checkpoint ``doc`` (None: an older one)."""
    return doc["lineage"][-1].get("segment") if doc["lineage"] else None


def abandoned_steps(steps: list[int], fork: int) -> list[int]:
    """The committed ``steps`` a branch forked at ``fork`` abandons: those newer."""
    return [s for s in steps if s > fork]


def _derived(seed: Any) -> str:
    """A stable id for a run whose checkpoints record none (written before ids were)."""
    text = json.dumps(seed, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return xxhash.xxh3_128_hexdigest(text.encode())


def unknown_run_id() -> CheckpointError:
    """The error of ``Checkpointer.run_id`` read before the run's id is decided."""
    return CheckpointError(
        "the run id is decided by restore() (the restored checkpoint's, or a new one on "
        "a fresh start) or, without a restore, by the first save(): call restore() "
        "first, on every rank"
    )
