"""Did the resumed run restore the steps the resume test stopped it at? Its lineage says.

A committed checkpoint's manifest keeps its lineage: a ``start`` event, then one
``resume`` event per restore, naming the step restored (``from_step``). The resume test
stops a run at K1, resumes it (stopped again at K2, ...), and resumes it a last time to
the end. The checkpoint that the i-th resume commits last must show resumes from K1, ...,
Ki in turn; otherwise the run did not continue from where it was stopped: it started
fresh (a Checkpointer with ``overwrite=True``, a script that never calls ``restore()``
or restores from another folder), or it restored another step. Comparing such a run with
the straight one proves nothing about resuming, whatever the metrics say. A last resume
that commits no checkpoint after its restore (the run ends between two saves) is read
from the metrics record instead (:func:`recorded_resume`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any


def ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``4th``, ``11th``, ``21st``."""
    if 10 <= n % 100 <= 20:
        return f"{n}th"
    return str(n) + {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


def resume_name(i: int, stops: Sequence[int]) -> str:
    """``the 2nd resume, from step 20`` (or ``the resume, from step 17`` for one stop)."""
    which = "the resume" if len(stops) == 1 else f"the {ordinal(i)} resume"
    return f"{which}, from step {stops[i - 1]}"


def resumes(lineage: Sequence[Mapping[str, Any]]) -> list[Any]:
    """The step each resume event of a lineage restored, in order."""
    return [e.get("from_step") for e in lineage if e.get("event") == "resume"]


def resets(lineage: Sequence[Mapping[str, Any]]) -> list[tuple[Any, list[str]]]:
    """(step restored, components started fresh) of each resume that reset some."""
    return [
        (e.get("from_step"), list(e.get("reset") or []))
        for e in lineage
        if e.get("event") == "resume" and e.get("reset")
    ]


def problem(
    stops: Sequence[int],
    i: int,
    step: int,
    lineage: Sequence[Mapping[str, Any]],
    recorded: tuple[bool, Any] = (False, None),
) -> str | None:
    """Why the checkpoint that the ``i``-th resume (1-based) committed last, of ``step``,
    does not show it continuing from ``stops[i - 1]``; None when its lineage shows resumes
    from ``stops[:i]`` in turn. ``recorded``: :func:`recorded_resume` of the run's metrics
    record, said when the run committed nothing after its stop.

    Example::

        problem([10, 20], 2, 40, [{"event": "start"}])
        # 'the 2nd resume (meant to continue from step 20) started fresh: ...'
    """
    expected = list(stops[:i])
    found = resumes(lineage)
    if found == expected:
        return None
    stop = stops[i - 1]
    run = "the resumed run" if len(stops) == 1 else f"the {ordinal(i)} resume"
    who = f"{run} (meant to continue from step {stop})"
    shown = _steps_text(found)
    if step <= stop and found == expected[:-1]:
        header, restored = recorded
        if header and restored is None:
            did = "started fresh (its metrics record shows no restore)"
        elif header and restored != stop:
            did = f"restored step {restored} instead of step {stop} (its metrics record says)"
        else:
            did = "left no record of a restore"
        what = f"{did}, and committed no checkpoint after step {stop}"
    elif not found:
        what = (
            f"started fresh: its checkpoint of step {step} has no resume in its lineage, so "
            f"it never restored step {stop} (a Checkpointer with overwrite=True, a script "
            "that does not call ckpt.restore() or restores from another folder)"
        )
    elif found[-1] != stop:
        what = (
            f"restored step {found[-1]} instead of step {stop} (its checkpoint of step "
            f"{step} shows {shown})"
        )
    else:
        what = (
            f"restored step {stop}, but of a run that had not resumed as the test did: its "
            f"checkpoint of step {step} shows {shown}, not {_steps_text(expected)} (an "
            "earlier resume did not restore its stop)"
        )
    return f"{who} {what}"


def tier_problem(stops: Sequence[int], lineage: Sequence[Mapping[str, Any]]) -> str | None:
    """Why the resumes of ``lineage`` did not each restore their stop from the local
    tier (its resume events say ``tier``: ``local`` or ``peer``), or None when they did."""
    for i, event in enumerate(e for e in lineage if e.get("event") == "resume"):
        if i >= len(stops):
            break
        tier = event.get("tier")
        if tier not in ("local", "peer"):
            where = f"the {tier} tier" if tier else "a tier its lineage does not name"
            return (
                f"{resume_name(i + 1, stops)} was restored from {where}, not the local tier "
                "(does the script pass local=ub.LocalTier(...), and did the stop's save "
                "reach it?)"
            )
    return None


def recorded_resume(lines: Sequence[str] | None) -> tuple[bool, Any]:
    """(whether a metrics record has a run's header, the step its last run says it
    resumed from: its segment header's ``resumed_from``, None for a fresh start).

    The evidence of the last resume's restore when it committed no checkpoint after it
    (a run that ends between two saves): the Checkpointer writes the header when its
    first tracked step is recorded, naming the step its restore loaded.
    """
    last = None
    for raw in lines or []:
        try:
            line = json.loads(raw)
        except ValueError:
            continue  # a torn last line
        if isinstance(line, dict) and "segment" in line and "resumed_from" in line:
            last = line
    return (False, None) if last is None else (True, last.get("resumed_from"))


def _steps_text(found: Sequence[Any]) -> str:
    if not found:
        return "no resume"
    return "a resume from step " + ", then from ".join(str(s) for s in found)
