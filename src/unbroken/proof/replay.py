"""Compare a straight run with a stopped-and-resumed one: that the resumed run restored
each stop step (its lineage), the metrics after the first stop bit for bit, and the
whole final state (format/state_compare.py). The verdict behind ``unbroken.testing``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..format import bitwise, manifest
from ..format.series import Series, read_series, record_lines
from ..format.state_compare import compare_state
from ..storage.interface import Location
from ..storage.locate import checkpoint_dir
from . import resume_lineage
from .divergence import evidence, likely_cause, rng_notes
from .generators import differing, label


@dataclasses.dataclass
class ResumeTestResult:
    """Outcome of :func:`resume_test`. ``passed`` is the verdict; ``verdict`` says it in a
    word: IDENTICAL, CLOSE (within the tolerance, another resume command), DIFFERENT, or
    NOT RESUMED (the resumed run did not restore each stop step: ``not_resumed`` says
    what it did instead; nothing else can make it pass).

    ``state_differences`` lists where the final checkpoints' saved state differs
    (tensors by fingerprint, non-tensor values by bits; the RNG aside, in
    ``rng_differences`` and the notes); they fail the test only when ``exact`` (the same
    command resumed: bit-identity required). With another resume command (another world
    size) they are reported, and the metrics after the stop must agree within
    ``tolerance`` (relative to the straight run's value).
    """

    passed: bool
    exact: bool  # same command: bit-identical was required
    stop_at: int  # the (first) stop step
    compared_steps: int
    metrics: list[str]
    first_difference: str | None
    state_differences: list[str]
    max_deviation: dict[str, float]
    warnings: list[str]  # the health check's, from the resumed run
    straight_dir: str
    resumed_dir: str
    report_path: str = ""
    plot_path: str = ""
    first_difference_step: int | None = None
    notes: list[str] = dataclasses.field(default_factory=list)  # remarks, not failures
    tolerance: float | None = None  # None: bit for bit
    state_compared: int = 0  # final tensors compared (per-rank ones left out across sizes)
    rng_differences: list[str] = dataclasses.field(default_factory=list)  # generators
    stops: list[int] = dataclasses.field(default_factory=list)  # every stop step, in order
    verdict: str = ""  # IDENTICAL, CLOSE, DIFFERENT or NOT RESUMED
    resumed: bool = True  # the resumed run restored each stop step in turn (its lineage)
    not_resumed: str | None = None  # what the resumed run did instead
    resumed_from: list[Any] = dataclasses.field(default_factory=list)  # its lineage's resumes
    first_difference_resume: int | None = None  # after which resume (1-based) it appeared
    cause: str | None = None  # what differs first, from evidence (or that there is none)
    state_left_out: list[str] = dataclasses.field(default_factory=list)  # per-rank, sizes

    def __post_init__(self) -> None:
        if not self.stops:
            self.stops = [self.stop_at]
        if not self.verdict:
            self.verdict = (
                "NOT RESUMED"
                if not self.resumed
                else "IDENTICAL"
                if self.passed and self.exact
                else "CLOSE"
                if self.passed
                else "DIFFERENT"
            )

    def __str__(self) -> str:
        how = "" if self.exact else "resumed with another command; "
        where = (
            f"stopped at step {self.stop_at}"
            if len(self.stops) == 1
            else f"stopped and resumed at steps {', '.join(map(str, self.stops))}"
        )
        lines = [
            f"resume test: {self.verdict} ({where}, {how}compared {self.compared_steps} "
            f"steps after {'it' if len(self.stops) == 1 else 'the first'}, metrics: "
            f"{', '.join(self.metrics) or 'none'})"
        ]
        if self.not_resumed:
            lines.append(f"  not resumed: {self.not_resumed}")
        if self.tolerance is not None:
            lines.append(f"  tolerance: {tolerance_text(self.tolerance)}")
        if self.first_difference:
            after = ""
            if self.first_difference_resume and len(self.stops) > 1:
                after = f" ({self.after_resume(self.first_difference_resume)})"
            lines.append(f"  first difference: {self.first_difference}{after}")
        lines += self._state_lines()
        if self.cause:
            lines.append(f"  cause: {self.cause}")
        for name, dev in self.max_deviation.items():
            lines.append(f"  max |straight - resumed| of {name} after the stop: {dev:.3g}")
        lines += [f"  health check: {w}" for w in self.warnings]
        lines += [f"  note: {n}" for n in self.notes]
        if self.report_path:
            lines.append(f"  report: {self.report_path}")
        if self.plot_path:
            lines.append(f"  plot: {self.plot_path}")
        return "\n".join(lines)

    def after_resume(self, i: int) -> str:
        """``after the 2nd resume, from step 20``."""
        return f"after the {resume_lineage.ordinal(i)} resume, from step {self.stops[i - 1]}"

    def _state_lines(self, shown: int = 10) -> list[str]:
        diffs = self.state_differences
        left = ", ".join(self.state_left_out)
        scope = f" (per-rank state of {left} not compared across world sizes)" if left else ""
        if not diffs:
            rng = ", ".join(self.rng_differences)
            but = f", except the RNG state of {rng} (see the note)" if rng else ""
            return [
                f"  final state: every non-tensor value and every tensor's fingerprint "
                f"identical{but}{scope}"
            ]
        lines = []
        if not self.exact:
            lines.append(
                f"  final state: {len(diffs)} difference(s) in {self.state_compared} "
                f"tensor(s) and the non-tensor state{scope}; tensor values may differ "
                "after training on another layout, anything else (a non-tensor value, a "
                "dtype, a shape) fails the test"
            )
        lines += [f"  final state: {d}" for d in diffs[:shown]]
        if len(diffs) > shown:
            lines.append(f"  final state: ... and {len(diffs) - shown} more differences")
        return lines


def tolerance_text(tolerance: float) -> str:
    """How metrics are compared across world sizes, for the report."""
    return (
        f"each metric after the stop may differ from the straight run's by up to "
        f"{tolerance:g} x |straight value| (--tolerance, relative). Another world size adds "
        "gradients up in another order and, with per-rank RNG and data position started "
        "fresh, may see other samples, so bit-identity is not expected; the restore itself "
        "was verified bit for bit in the resumed run"
    )


def stop_steps(stop_at: int | Sequence[int]) -> list[int]:
    """The stop steps as a list: one int, or increasing ints, each >= 1.

    Raises:
        ValueError: none, one below 1, not increasing, or not an int.
    """
    stops = [stop_at] if isinstance(stop_at, int) else list(stop_at)
    if not stops or any(isinstance(k, bool) or not isinstance(k, int) for k in stops):
        raise ValueError(f"stop_at must be a step or a list of steps, got {stop_at!r}")
    if stops[0] < 1:
        raise ValueError(f"stop_at must be >= 1, got {stops[0]}")
    if any(b <= a for a, b in itertools.pairwise(stops)):
        raise ValueError(f"stop_at steps must increase, got {stops}")
    return stops


def compare(
    straight: Location | Path,
    resumed: Location | Path,
    *,
    stop_at: int | Sequence[int],
    exact: bool = True,
    tolerance: float = 0.05,
    checkpoints: Mapping[int, dict[str, Any]] | None = None,
    tier: str = "persistent",
) -> ResumeTestResult:
    """Compare two finished runs: the resumed run's lineage (it restored each step of
    ``stop_at`` in turn), the metrics after the first stop, the whole final state.

    ``checkpoints``: manifests of the resumed folder's checkpoints seen between its runs
    (step -> manifest; the harness passes them), so a checkpoint that a later run pruned
    still shows what each resume restored and what the runs held at each stop.
    ``tier="local"``: each resume must have restored its stop from the local tier.
    """
    stops = stop_steps(stop_at)
    a, b = read_series(straight), read_series(resumed)
    kept_a, now_b = _manifests(straight), _manifests(resumed)
    final_a, final_b = (kept[max(kept)] if kept else None for kept in (kept_a, now_b))
    kept_b = {**now_b, **(checkpoints or {})}  # as each run left them, where seen
    not_resumed, note = _not_resumed(stops, kept_b, final_b, record_lines(resumed))
    if tier == "local" and not_resumed is None and final_b is not None:
        not_resumed = resume_lineage.tier_problem(stops, final_b.get("lineage", []))
    docs, problem = _final_pair(final_a, final_b, straight, resumed)
    changed = None if docs is None else layout_change(*docs)
    layout_note = None
    if not exact and docs is not None:  # another command: a tolerance only for another layout
        exact = changed is None
        layout_note = (
            "resumed with another command on the same layout: bit-identity required"
            if exact
            else f"resumed on another layout ({changed}): values compared within the tolerance"
        )
    first_step, first, compared, deviation = _compare_series(a, b, stops[0], exact, tolerance)
    ev = evidence(kept_a, kept_b, stops) if exact else None
    state, notes, count, rng, left_out = [], [], 0, [], []
    beyond_values = False
    if docs is not None:
        found = compare_state(*docs, exclude={"rng"}, names=("straight", "resumed"))
        state, count, left_out = found.lines, found.compared_tensors, found.left_out
        beyond_values = found.beyond_values  # never expected, whatever the layout
        if exact and docs[0]["world_size"] == docs[1]["world_size"]:
            ws = docs[1]["world_size"]
            rng = [label(r, g, ws) for (r, g), d in differing(*docs).items() if d]
            notes = rng_notes(*docs, metrics_identical=first is None, ev=ev)
    notes += [n for n in (layout_note, note) if n]
    passed = (
        not_resumed is None
        and first is None
        and problem is None
        and not (state and (exact or beyond_values))
    )
    result = ResumeTestResult(
        passed=passed,
        exact=exact,
        stop_at=stops[0],
        compared_steps=compared,
        metrics=sorted(set(a.values) | set(b.values)),
        first_difference=first,
        first_difference_step=first_step,
        state_differences=[problem] if problem else state,
        max_deviation=deviation,
        warnings=[f"step {s}: {w}" for s, w in b.warnings],
        notes=notes,
        straight_dir=str(straight),
        resumed_dir=str(resumed),
        tolerance=None if exact else tolerance,
        state_compared=count,
        rng_differences=rng,
        stops=stops,
        resumed=not_resumed is None,
        not_resumed=not_resumed,
        resumed_from=resume_lineage.resumes(final_b["lineage"]) if final_b else [],
        state_left_out=left_out,
    )
    if first_step is not None:
        result.first_difference_resume = sum(1 for k in stops if k < first_step)
    if ev is not None and not passed and not_resumed is None:
        cause = likely_cause(ev, a, b, first_step)
        result.cause = cause.text
        if result.first_difference_resume is None and cause.resume:
            result.first_difference_resume = cause.resume
    return result


def _compare_series(a: Series, b: Series, stop_at: int, exact: bool, tolerance: float):
    """(first differing step, its description; steps compared; max deviation per metric)."""
    problems: list[tuple[int, str]] = []
    compared = 0
    deviation: dict[str, float] = {}
    for name in sorted(set(a.values) | set(b.values)):
        xs = {s: v for s, v in a.values.get(name, []) if s > stop_at}
        ys = {s: v for s, v in b.values.get(name, []) if s > stop_at}
        for s in sorted(xs.keys() ^ ys.keys())[:1]:
            problems.append((s, f"step {s}, metric {name!r}: tracked in only one run"))
        common = sorted(xs.keys() & ys.keys())
        compared = max(compared, len(common))
        deviation[name] = max((abs(xs[s] - ys[s]) for s in common), default=0.0)
        for s in common:
            x, y = xs[s], ys[s]
            # The same value (bitwise.py: -0.0 is not 0.0, any NaN is any NaN) always
            # agrees; across world sizes a value within the tolerance does too.
            ok = bitwise.same_float(x, y) or (
                not exact and abs(x - y) <= tolerance * max(abs(x), 1e-12)
            )
            if not ok:
                beyond = "" if exact else f" (beyond the tolerance of {tolerance:g})"
                problems.append(
                    (s, f"step {s}, metric {name!r}: straight {x!r}, resumed {y!r}{beyond}")
                )
                break
    if compared == 0:
        problems.append((stop_at, f"no tracked metric after step {stop_at}: nothing compared"))
    step, first = min(problems) if problems else (None, None)
    return step, first, compared, deviation


def _manifests(folder: Location | Path) -> dict[int, dict[str, Any]]:
    """Every committed checkpoint's manifest in a run folder, by step."""
    ckdir = checkpoint_dir(folder)
    return {step: manifest.read(ckdir.step_path(step)) for step in ckdir.steps()}


def _not_resumed(
    stops: list[int],
    kept: Mapping[int, dict[str, Any]],
    final: dict[str, Any] | None,
    record: list[str] | None,
) -> tuple[str | None, str | None]:
    """(what the resumed runs did instead of restoring each stop in turn, or None; a
    note when the last resume's restore is read from the metrics record)."""
    if final is None:
        return (
            f"the resumed run committed no checkpoint: nothing shows that it restored "
            f"step {stops[0]}"
        ), None
    # The checkpoint each resume but the last committed at the next stop (seen by the
    # harness before the next run), then the final one.
    checks = [(i, stops[i], kept[stops[i]]) for i in range(1, len(stops)) if stops[i] in kept]
    last = resume_lineage.resumes(final.get("lineage", []))
    recorded = resume_lineage.recorded_resume(record)
    if final["step"] <= stops[-1] and last == stops[:-1] and recorded == (True, stops[-1]):
        # The last resume saved nothing after its restore: its metrics record tells.
        found = _first_problem(stops, checks)
        note = (
            f"the last resume committed no checkpoint after step {stops[-1]}: its restore "
            f"of step {stops[-1]} is read from its metrics record, and the final state "
            f"compared is step {final['step']}'s, saved before it"
        )
        return found, None if found else note
    checks.append((len(stops), final["step"], final))
    return _first_problem(stops, checks, recorded), None


def _first_problem(
    stops: list[int],
    checks: list[tuple[int, int, dict[str, Any]]],
    recorded: tuple[bool, Any] = (False, None),
) -> str | None:
    for i, step, doc in checks:
        said = recorded if i == len(stops) else (False, None)  # the record is the last run's
        found = resume_lineage.problem(stops, i, step, doc.get("lineage", []), said)
        if found:
            return found
    return None


def layout_change(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """How the second manifest's layout differs from the first's (the world size, or how
    a tensor is cut into chunks), or None: the same layout."""
    if a["world_size"] != b["world_size"]:
        return f"world size {a['world_size']} -> {b['world_size']}"
    for key, entry in a["tensors"].items():
        other = b["tensors"].get(key)
        if other is not None and _cuts(entry) != _cuts(other):
            return f"{key} is cut into other chunks"
    return None


def _cuts(entry: dict[str, Any]) -> list[tuple[list[int], list[int]]]:
    return sorted((c["offsets"], c["sizes"]) for c in entry.get("chunks", []))


def _final_pair(a: dict[str, Any] | None, b: dict[str, Any] | None, straight, resumed):
    """(the two final manifests, None), or (None, why they cannot be compared)."""
    for doc, folder in ((a, straight), (b, resumed)):
        if doc is None:
            return None, f"{folder} has no committed checkpoint to compare"
    if a["step"] != b["step"]:
        return None, f"final checkpoints are of different steps: {a['step']} vs {b['step']}"
    algorithms = [manifest.fingerprint_algorithm(doc) for doc in (a, b)]
    if algorithms[0] != algorithms[1]:  # saved by different versions of unbroken
        return None, (
            f"final checkpoints are fingerprinted differently ({algorithms[0]} vs "
            f"{algorithms[1]}); compare them with `unbroken diff`"
        )
    return (a, b), None
