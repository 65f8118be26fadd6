"""Replay check: steps a resumed run recomputes are compared with the ones recorded before.

A run that crashed after its last save (or was rolled back to an older step) had already
tracked some steps after the checkpoint it resumes from. Those records are the reference:
as the resumed run tracks the same steps again, each metric must come out bit for bit the
same (``format.bitwise.same_float``: NaN equals NaN; -0.0 differs from 0.0), which
proves the resume exact over real training steps at no extra cost. The reference is
taken only from runs that continued from the very checkpoint restored (its lineage,
followed through the metrics record's segment headers) and trained with the same world
size; anything else is skipped, saying why.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

from ..errors import CheckpointError
from ..format import bitwise
from ..format.series import is_withdrawn, parsed, record_lines, record_name, retractions
from ..storage.interface import Location

logger = logging.getLogger(__name__)

PENDING, IDENTICAL, DIFFERENT, SKIPPED, NONE = (
    "pending",
    "identical",
    "different",
    "skipped",
    "none",
)


@dataclasses.dataclass
class ReplayVerdict:
    """What the replay check found (``Checkpointer.replay``).

    ``status``: ``"pending"`` (replayed steps still to come), ``"identical"``,
    ``"different"``, ``"skipped"`` (``reason`` says why, e.g. another world size) or
    ``"none"`` (nothing was recorded after the checkpoint, or nothing tracked again).
    """

    status: str
    from_step: int
    recorded_steps: int = 0  # steps after from_step that the earlier run recorded
    compared_steps: int = 0  # of those, tracked again and compared so far
    step: int | None = None  # the first differing step
    metric: str | None = None  # and metric
    first_difference: str | None = None
    reason: str | None = None
    reset: list[str] = dataclasses.field(default_factory=list)  # components reset on purpose

    @property
    def identical(self) -> bool | None:
        """True or False once decided; None while pending, skipped or with nothing to compare."""
        return {IDENTICAL: True, DIFFERENT: False}.get(self.status)

    def record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        head = f"replay check after the resume from step {self.from_step}"
        if self.status == IDENTICAL:
            return (
                f"{head}: identical ({self.compared_steps} of {self.recorded_steps} recorded "
                "step(s) recomputed, every tracked metric equal bit for bit)"
            )
        if self.status == DIFFERENT:
            why = (
                f"expected, since the resume started {', '.join(self.reset)} fresh (reset)"
                if self.reset
                else "something was not restored exactly, or the training is not deterministic"
            )
            return (
                f"{head}: DIFFERENT at step {self.step}, metric {self.metric!r}: "
                f"{self.first_difference}. The resumed run does not retrace the run that "
                f"recorded these steps (same world size): {why}"
            )
        if self.status == PENDING:
            return (
                f"{head}: pending ({self.compared_steps} of {self.recorded_steps} recorded "
                "step(s) compared so far, all identical)"
            )
        return f"{head}: {self.status} ({self.reason})"


class ReplayCheck:
    """Compares the steps tracked after a resume with the reference, as they arrive."""

    def __init__(self, verdict: ReplayVerdict, reference: dict[int, dict[str, float]]) -> None:
        self.verdict = verdict
        self._reference = reference
        self._last = max(reference, default=verdict.from_step)
        self._seen: set[int] = set()

    @classmethod
    def from_file(
        cls,
        root: Location,
        from_step: int,
        saved_by: str | None,
        world_size: int,
        reset: list[str] | None = None,
    ) -> ReplayCheck:
        """The check of a resume from ``from_step``, whose checkpoint was saved by the
        metrics segment ``saved_by`` (None: an older checkpoint that records none), with
        ``reset`` components started fresh on purpose."""
        try:
            lines = record_lines(root) or []
            reference, reason = _reference(lines, from_step, saved_by, world_size)
        except (OSError, ValueError, TypeError, CheckpointError) as exc:  # never fail a restore
            reference, reason = {}, f"{record_name(root)} is unreadable: {exc}"
        if reason is not None:
            verdict = ReplayVerdict(SKIPPED, from_step, reason=reason)
        elif not reference:
            reason = f"no step after {from_step} was recorded by a run continuing from it"
            verdict = ReplayVerdict(NONE, from_step, reason=reason)
        else:
            verdict = ReplayVerdict(PENDING, from_step, recorded_steps=len(reference))
        verdict.reset = sorted(reset or [])
        return cls(verdict, reference)

    @classmethod
    def passive(cls, verdict: ReplayVerdict) -> ReplayCheck:
        """A check that compares nothing (ranks other than 0): it shows rank 0's verdict."""
        return cls(verdict, {})

    def observe(
        self, step: int, values: dict[str, float], *, complete: bool = True
    ) -> ReplayVerdict | None:
        """Compare one tracked step, ``values`` being every metric tracked for it so far;
        returns the verdict when it becomes final.

        A step may be tracked in several calls (the loss, then an evaluation):
        ``complete`` is False while more calls may come (the next step, a save or the
        end completes it). A value that differs is a difference at once; a recorded
        metric not tracked again is one only once the step is complete; a step that
        holds every recorded metric is compared (and counted) at once.
        """
        v = self.verdict
        if v.status != PENDING or not self._reference or step in self._seen:
            return None
        expected = self._reference.get(step)
        if expected is not None:
            found = _difference(expected, values, complete=complete)
            if found is not None:
                self._seen.add(step)
                v.compared_steps = len(self._seen)
                v.status, v.step = DIFFERENT, step
                v.metric, v.first_difference = found
                logger.warning("%s", v)
                return v
            if not complete and not expected.keys() <= values.keys():
                return None  # the step's other metrics may still come
            self._seen.add(step)
            v.compared_steps = len(self._seen)
        return self.finish() if step >= self._last else None

    def finish(self) -> ReplayVerdict | None:
        """Decide a pending check (the replayed range is passed, or the run closes)."""
        v = self.verdict
        if v.status != PENDING or not self._reference:
            return None
        if v.compared_steps:
            v.status = IDENTICAL
        else:
            v.status, v.reason = NONE, "none of the recorded steps was tracked again"
        logger.info("%s", v)
        return v


def _difference(
    expected: dict[str, float], got: dict[str, float], *, complete: bool
) -> tuple[str, str] | None:
    """The first metric (by name) whose replayed value differs, or that the complete
    step lacks; None if none."""
    for name in sorted(expected):
        if name not in got:
            if complete:
                return name, "recorded, but not tracked in the replay"
        elif not bitwise.same_float(expected[name], got[name]):
            return name, f"recorded {expected[name]!r}, replayed {got[name]!r}"
    return None


def _reference(
    lines: Iterable[str], from_step: int, saved_by: str | None, world_size: int
) -> tuple[dict[int, dict[str, float]], str | None]:
    """Recorded steps after ``from_step`` of the segments continuing from its checkpoint,
    with the same world size; or a reason why there is no usable reference."""
    headers: dict[str, dict[str, Any]] = {}
    later: list[tuple[str, int, dict[str, Any]]] = []
    records = parsed(lines)
    withdrawn = retractions(records)  # a run that lost the folder: not a reference
    for line in records:
        if not isinstance(line.get("segment"), str):
            continue
        if line["segment"] in withdrawn and is_withdrawn(line, withdrawn[line["segment"]]):
            continue
        step = line.get("step")
        if isinstance(step, int) and isinstance(line.get("metrics"), dict):
            if step > from_step:
                later.append((line["segment"], step, line["metrics"]))
        elif "resumed_from" in line:
            headers[line["segment"]] = line
    if not later:
        return {}, None
    if saved_by is None:
        return {}, (
            f"the checkpoint of step {from_step} names no metrics segment (written by an "
            "older version), so the recorded steps cannot be tied to it"
        )
    cont = _Continuation(headers, from_step, saved_by)
    ours = [(seg, step, m) for seg, step, m in later if cont.continues(seg)]
    if not ours:
        return {}, None
    reference: dict[int, dict[str, float]] = {}
    owner: dict[int, str] = {}  # step -> the segment whose lines it holds
    for seg, step, m in ours:
        if headers.get(seg, {}).get("world_size") != world_size:
            continue
        if owner.get(step) != seg:  # a later segment recomputed the step: its lines
            reference[step], owner[step] = {}, seg
        reference[step].update({k: float(v) for k, v in m.items()})  # one step, many calls
    if not reference:
        recorded = sorted({str(headers.get(seg, {}).get("world_size", "?")) for seg, _, _ in ours})
        return {}, (
            f"the steps after {from_step} were recorded with world size {', '.join(recorded)} "
            f"and this run has {world_size}: training differs across world sizes, so the "
            "replay is not compared"
        )
    return reference, None


class _Continuation:
    """Which metrics segments continued from the checkpoint of ``from_step``: the one that
    saved it, and those that resumed from it or from a later checkpoint of one of these."""

    def __init__(self, headers: dict[str, dict[str, Any]], from_step: int, saved_by: str):
        self._headers, self._from, self._root = headers, from_step, saved_by
        self._known: dict[str, bool] = {}

    def continues(self, segment: str) -> bool:
        chain, seg, answer = [], segment, False
        while seg is not None and seg not in self._known and seg not in chain:
            if seg == self._root:
                answer = True
                break
            chain.append(seg)
            header = self._headers.get(seg, {})
            resumed = header.get("resumed_from")
            if not isinstance(resumed, int) or resumed < self._from:
                break
            seg = header.get("parent")
        else:
            answer = self._known.get(seg, False) if seg is not None else False
        for s in chain:
            self._known[s] = answer
        return answer
