"""Why a resume test's two runs differ, named from evidence only.

When the straight run and the stopped-and-resumed one differ, a cause is named only from
what the runs left behind, never guessed:

1. The tracked metrics *before* the first stop: the stopped run trained those steps as
   the straight one did. Different there means the script is not seeded (torch, like
   Python and NumPy, starts its generators from OS entropy in every process) or the
   training is not deterministic; no resume could be exact against it. The generators
   of the first checkpoints both runs kept before any resume tell which: different
   there, the cause says "seed the script", with each framework's call.
2. The checkpoints both runs kept of the same step, compared whole (tensors by their
   fingerprints, non-tensor state and the RNG by bits; format/state_compare.py): the
   first step whose saved state differs, how many resumes came before it, and whether
   the runs were still identical at the stop before it (the stopped run's checkpoint of
   step K against the straight run's, where the straight run kept one). Identical at K
   and different after the resume from K: the resume lost or changed something.
   Different already at K: the runs diverged before any resume. The report names the
   components that differ (for ``rng``, which generators).
3. Nothing else: without such a pair the report says there is no evidence.

A cause after a resume names that resume and repeats the warnings that the checkpoint it
restored was saved with (the manifest's ``save_warnings``): what the save already knew a
resume could not restore exactly.

The final RNG state is also explained generator by generator (:func:`rng_notes`),
without blaming it for a metric difference it may not have caused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ..format import bitwise, manifest
from ..format.series import Series
from ..format.state_compare import StateComparison, compare_state
from .generators import differing, label
from .lost_gradients import note as lost_gradients
from .resume_lineage import ordinal, resets

_SHOWN = 6  # components named in a cause
_SHOWN_WARNINGS = 2  # save warnings repeated in a cause

# How a script seeds every generator a resume test compares, per framework.
SEED_THE_SCRIPT = (
    "seed the script at its start, in every process, with a fixed value: "
    "torch.manual_seed(0) (and random.seed(0), numpy.random.seed(0) if it draws from "
    "them); Lightning: lightning.seed_everything(0); Hugging Face Trainer: "
    "transformers.set_seed(0) (and TrainingArguments(seed=0)); Accelerate: "
    "accelerate.utils.set_seed(0)"
)


Doc = dict[str, Any]
Generator = tuple[int, str]  # (rank, generator name), as generators.differing keys them


@dataclasses.dataclass
class Cause:
    """What the evidence shows; ``resume``: after which resume (1-based) the saved state
    was first seen to differ (0: before any), or None where no checkpoint tells."""

    text: str
    resume: int | None = None


@dataclasses.dataclass
class Evidence:
    """The two runs' checkpoints of the same steps, side by side.

    ``unseeded``: the generators whose state differs already in the first pair saved
    before any resume, at step ``compared_at`` (two runs start them differently: torch's,
    Python's and NumPy's come from OS entropy unless the script seeds them). They differ
    between any two runs, so a difference in them later says nothing about resuming,
    and they are left out.
    """

    straight: Mapping[int, Doc]
    resumed: Mapping[int, Doc]
    stops: Sequence[int]
    steps: list[int]  # of both, in one fingerprint format, ascending
    unseeded: list[Generator] = dataclasses.field(default_factory=list)
    unseeded_at: int | None = None  # the step of the pair that showed them
    compared_at: int | None = None  # the first pair before any resume (generators compared)

    def save_warnings(self, resume: int) -> list[str]:
        """What the checkpoint restored by the ``resume``-th resume was saved with."""
        doc = self.resumed.get(self.stops[resume - 1]) or {}
        return [str(w) for w in doc.get("save_warnings") or []]

    def differences(self, step: int) -> tuple[StateComparison, list[Generator]]:
        """At ``step``: the components that differ (rng aside), and the generators that
        differ (the unseeded ones aside)."""
        a, b = self.straight[step], self.resumed[step]
        found = compare_state(a, b, exclude={"rng"}, names=("straight", "resumed"))
        gens = [g for g, d in differing(a, b).items() if d and g not in self.unseeded]
        return found, gens


def evidence(
    straight: Mapping[int, Doc], resumed: Mapping[int, Doc], stops: Sequence[int]
) -> Evidence:
    """The checkpoints both runs kept of the same step (``resumed``: the resumed folder's,
    as each run left them), and the generators that differ before any resume."""
    steps = sorted(
        s
        for s in straight.keys() & resumed.keys()
        if manifest.fingerprint_algorithm(straight[s]) == manifest.fingerprint_algorithm(resumed[s])
    )
    found = Evidence(straight, resumed, stops, steps)
    before = [s for s in steps if s <= stops[0]]
    if before:
        gens = [g for g, d in differing(straight[before[0]], resumed[before[0]]).items() if d]
        found.unseeded, found.unseeded_at = gens, before[0] if gens else None
        found.compared_at = before[0]
    return found


def likely_cause(ev: Evidence, a: Series, b: Series, first_step: int | None = None) -> Cause:
    """The likely cause of a difference between the straight run (metrics ``a``) and the
    resumed one (``b``), from the metrics before the first stop and the checkpoints.
    ``first_step``: the first step after the stop whose metrics differ, if any (names
    the resume after which the difference came where no checkpoint does)."""
    cause = _evidence_cause(ev, a, b)
    if cause.resume is None and first_step is not None:
        after = sum(1 for k in ev.stops if k < first_step)
        if after:
            cause.resume = after
            cause.text += (
                f"; the first difference came at step {first_step}, {_after(after, ev.stops)}"
            )
    if cause.resume:
        cause.text += _saved_with(ev, cause.resume)
    return cause


def _evidence_cause(ev: Evidence, a: Series, b: Series) -> Cause:
    stops = ev.stops
    early, compared = _metric_difference(a, b, stops[0])
    if early is not None:
        return _before_resume(
            f"the runs differ already at step {early[0]} (metric {early[1]!r}), before any resume",
            ev,
        )
    last_equal = None
    for step in ev.steps:
        found, gens = ev.differences(step)
        if not found.differences and not gens:
            last_equal = step
            continue
        why = _at(step, last_equal, _components(found, gens, ev), ev)
        if compared and why.resume and last_equal is None:
            why.text += f" (the tracked metrics were identical up to step {stops[0]})"
        return why
    if ev.steps:
        return Cause(
            f"no evidence in the saved state: every checkpoint both runs kept (step(s) "
            f"{', '.join(map(str, ev.steps))}) holds the same state{_left_out(ev)}, so the "
            "difference comes from something the checkpoints do not hold (state the "
            "Checkpointer is not given)" + lost_gradients(stops, ev.resumed, ev.straight)
        )
    return Cause(
        "no evidence: the two runs kept no checkpoint of the same step to compare (save "
        "the straight run at each stop step, or keep more checkpoints)"
    )


def _before_resume(what: str, ev: Evidence) -> Cause:
    """The runs differ before any resume (``what`` says where): an unseeded script, or
    training that is not deterministic; the generators saved before any resume tell."""
    if ev.unseeded:
        ws = next(iter(ev.resumed.values()))["world_size"]
        names = ", ".join(label(r, g, ws) for r, g in ev.unseeded)
        text = (
            f"{what}: the script is not seeded (or seeded differently in each run): the "
            f"random generators ({names}) differ already in the checkpoints of step "
            f"{ev.unseeded_at}, saved before any resume, because torch, like Python and "
            "NumPy, starts them from OS entropy in every process unless the script seeds "
            f"them; two straight runs would differ too. Fix: {SEED_THE_SCRIPT}"
        )
    elif ev.compared_at is not None:
        text = (
            f"{what}, though every random generator was the same in both runs at step "
            f"{ev.compared_at}: the training itself is not deterministic (two straight runs "
            "would differ too), so no resume can be exact against it (a nondeterministic "
            "kernel: torch.use_deterministic_algorithms(True); a thread count or data "
            "order that depends on the machine)"
        )
    else:
        text = (
            f"{what}: the script is not seeded, or the training is not deterministic (two "
            "straight runs would differ too), so no resume can be exact against it; no "
            "checkpoint of both runs before the resume shows which. Fix: "
            f"{SEED_THE_SCRIPT}; if it is seeded, make the training deterministic "
            "(torch.use_deterministic_algorithms(True))"
        )
    return Cause(text, resume=0)


def _after(resume: int, stops: Sequence[int]) -> str:
    """``after the 2nd resume, from step 20``."""
    return f"after the {ordinal(resume)} resume, from step {stops[resume - 1]}"


def _saved_with(ev: Evidence, resume: int) -> str:
    """The save warnings of the checkpoint the ``resume``-th resume restored, repeated."""
    warnings = ev.save_warnings(resume)
    if not warnings:
        return ""
    shown = "; ".join(f'"{w}"' for w in warnings[:_SHOWN_WARNINGS])
    more = len(warnings) - _SHOWN_WARNINGS
    rest = f"; and {more} more (unbroken verify lists them)" if more > 0 else ""
    step = ev.stops[resume - 1]
    return (
        f". The checkpoint of step {step} that this resume restored was saved with "
        f"{'a warning' if len(warnings) == 1 else 'warnings'}: {shown}{rest}"
    )


def _at(step: int, last_equal: int | None, what: str, ev: Evidence) -> Cause:
    """The cause, given the first step whose checkpoints differ."""
    stops = ev.stops
    what = f"the saved state differs in {what}{_left_out(ev)}"
    before = sum(1 for k in stops if k < step)  # resumes before this checkpoint
    if before == 0:
        return _before_resume(
            f"the checkpoints of step {step}, saved before any resume, already differ "
            f"(the runs diverged before the resume; {what})",
            ev,
        )
    stop = stops[before - 1]
    after = _after(before, stops)
    lineage = ev.resumed[step].get("lineage", [])
    reset = [
        f"reset {sorted(r)} at the resume from step {s}"
        for s, r in resets(lineage)
        if s in stops[:before]
    ]
    also = f" (the resumed run restored with {'; '.join(reset)})" if reset else ""
    also += lost_gradients(stops[:before], ev.resumed, ev.straight)
    if last_equal is not None and last_equal == stop:
        return Cause(
            f"the checkpoints are identical at step {stop}, where the run stopped, and "
            f"differ at step {step}, {after}: the resume lost or changed something; "
            f"{what}{also}",
            resume=before,
        )
    if last_equal is not None and last_equal > stop:
        return Cause(
            f"the checkpoints are identical at step {last_equal} and differ at step "
            f"{step}, {after}: the runs diverged between those steps; {what}{also}",
            resume=before,
        )
    return Cause(
        f"the checkpoints of step {step}, {after}, differ; the straight run kept no "
        f"checkpoint of step {stop} to tell whether the runs were identical when it "
        f"stopped; {what}{also}",
        resume=before,
    )


def _components(found: StateComparison, gens: list[Generator], ev: Evidence) -> str:
    ws = next(iter(ev.resumed.values()))["world_size"]
    parts = []
    for name, lines in found.differences.items():
        more = f"; {len(lines) - 1} more" if len(lines) > 1 else ""
        parts.append(f"{name} ({lines[0]}{more})")
    if gens:
        parts.append(f"rng ({', '.join(label(r, g, ws) for r, g in gens)})")
    shown = parts[:_SHOWN]
    rest = f", and {len(parts) - _SHOWN} more component(s)" if len(parts) > _SHOWN else ""
    return ", ".join(shown) + rest


def _left_out(ev: Evidence) -> str:
    if not ev.unseeded:
        return ""
    ws = next(iter(ev.resumed.values()))["world_size"]
    names = ", ".join(label(r, g, ws) for r, g in ev.unseeded)
    return (
        f" (leaving out the RNG state of {names}, which differed already at step "
        f"{ev.unseeded_at}, before any resume)"
    )


def _metric_difference(a: Series, b: Series, stop: int) -> tuple[tuple[int, str] | None, int]:
    """((the first step up to ``stop`` where a metric tracked by both runs differs, the
    metric) or None; how many values were compared)."""
    first, compared = None, 0
    for name in sorted(a.values.keys() & b.values.keys()):
        xs = {s: v for s, v in a.values[name] if s <= stop}
        for s, y in b.values[name]:
            if s not in xs:
                continue
            compared += 1
            if not bitwise.same_float(xs[s], y):
                first = min(first or (s, name), (s, name))
                break
    return first, compared


def rng_notes(a: Doc, b: Doc, *, metrics_identical: bool, ev: Evidence | None = None) -> list[str]:
    """What a final RNG difference between manifests ``a`` (straight) and ``b`` (resumed)
    means. Reported, not failed: a lost RNG state that matters shows in the metrics; one
    that does not may be harmless. It is not blamed for a metric difference: the cause,
    where there is evidence, is :func:`likely_cause`'s. With ``ev``, generators that
    differed already before any resume are said to."""
    changed = [(r, g) for (r, g), d in differing(a, b).items() if d]
    if not changed:
        return []
    ws = b["world_size"]
    unseeded = ev.unseeded if ev is not None else []
    notes = []
    before = [label(r, g, ws) for r, g in changed if (r, g) in unseeded]
    if before:
        notes.append(
            f"final RNG state differs ({', '.join(before)}): it differed already at step "
            f"{ev.unseeded_at if ev else '?'}, before any resume, so it says nothing about "
            "resuming (torch's, Python's and NumPy's generators start from OS entropy in "
            f"every process unless the script seeds them: {SEED_THE_SCRIPT})"
        )
    changed = [(r, g) for r, g in changed if (r, g) not in unseeded]
    if not changed:
        return notes
    names = ", ".join(label(r, g, ws) for r, g in changed)
    reset = [
        e
        for e in b.get("lineage", [])
        if e.get("event") == "resume" and "rng" in (e.get("reset") or [])
    ]
    if reset:
        return [
            *notes,
            f"final RNG state differs ({names}): the resumed run restored "
            f"with reset={{'rng'}} at step {reset[-1].get('from_step')}, so its "
            "generators started fresh instead of continuing",
        ]
    consequence = (
        "harmless only if nothing that matters draws from it later"
        if metrics_identical
        else "whether it caused the difference above, the cause line says from evidence"
    )
    drawn = (
        "after the resume something drew from them a different number of times than in "
        "the straight run (iter(DataLoader) draws a seed from torch's global generator "
        "unless the loader has a generator of its own), or the script re-seeded after the "
        "restore"
    )
    if ev is not None and ev.compared_at is not None:
        # The same in both runs before any resume: the script seeds them alike.
        return [
            *notes,
            f"final RNG state differs ({names}): the same in both runs at step "
            f"{ev.compared_at}, before any resume, so {drawn}; {consequence}",
        ]
    return [
        *notes,
        f"final RNG state differs ({names}): no checkpoint of both runs from before the "
        "resume shows whether they started alike. Either the script does not seed them "
        "(torch's, Python's and NumPy's generators start from OS entropy in every process: "
        f"then any two runs differ; {SEED_THE_SCRIPT}), or {drawn}; {consequence}",
    ]
