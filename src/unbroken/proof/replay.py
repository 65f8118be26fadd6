"""Compare a straight run with a stopped-and-resumed one: metrics after the stop, bit for
bit, and the final checkpoints' fingerprints. The verdict behind ``unbroken.testing``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..format import bitwise, manifest
from ..storage.interface import Location
from ..storage.locate import checkpoint_dir
from .generators import differing, label
from .metrics import Series, read_series


@dataclasses.dataclass
class ResumeTestResult:
    """Outcome of :func:`resume_test`. ``passed`` is the verdict.

    ``state_differences`` lists the final tensors that differ; they fail the test only
    when ``exact`` (the same command resumed: bit-identity required). With another
    resume command (another world size) they are reported, and the metrics after the stop
    must agree within ``tolerance`` (relative to the straight run's value).
    """

    passed: bool
    exact: bool  # same command: bit-identical was required
    stop_at: int
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

    def __str__(self) -> str:
        verdict = (
            "IDENTICAL" if self.passed and self.exact else ("CLOSE" if self.passed else "DIFFERENT")
        )
        how = "" if self.exact else "resumed with another command; "
        lines = [
            f"resume test: {verdict} (stopped at step {self.stop_at}, {how}compared "
            f"{self.compared_steps} steps after it, metrics: {', '.join(self.metrics) or 'none'})"
        ]
        if self.tolerance is not None:
            lines.append(f"  tolerance: {tolerance_text(self.tolerance)}")
        if self.first_difference:
            lines.append(f"  first difference: {self.first_difference}")
        lines += self._state_lines()
        for name, dev in self.max_deviation.items():
            lines.append(f"  max |straight - resumed| of {name} after the stop: {dev:.3g}")
        lines += [f"  health check: {w}" for w in self.warnings]
        lines += [f"  note: {n}" for n in self.notes]
        if self.report_path:
            lines.append(f"  report: {self.report_path}")
        if self.plot_path:
            lines.append(f"  plot: {self.plot_path}")
        return "\n".join(lines)

    def _state_lines(self, shown: int = 10) -> list[str]:
        diffs = self.state_differences
        scope = "" if self.exact else " (per-rank state not compared across world sizes)"
        if not diffs:
            rng = ", ".join(self.rng_differences)
            but = f", except the RNG state of {rng} (see the note)" if rng else ""
            return [f"  final state: every tensor's fingerprint identical{but}{scope}"]
        lines = []
        if not self.exact:
            lines.append(
                f"  final state: {len(diffs)} of {self.state_compared} tensor(s) differ{scope}; "
                "expected after training on another world size, not part of the verdict"
            )
        lines += [f"  final state: {d}" for d in diffs[:shown]]
        if len(diffs) > shown:
            lines.append(f"  final state: ... and {len(diffs) - shown} more tensors")
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


def compare(straight: Location | Path, resumed: Location | Path, *, stop_at: int,
            exact: bool = True, tolerance: float = 0.05) -> ResumeTestResult:  # fmt: skip
    """Compare two finished runs' metrics after ``stop_at`` and their final checkpoints."""
    a, b = read_series(straight), read_series(resumed)
    first_step, first, compared, deviation = _compare_series(a, b, stop_at, exact, tolerance)
    docs, problem = _final_manifests(straight, resumed)
    state, notes, count, rng = [], [], 0, []
    if docs is not None:
        state, count = _compare_final_state(*docs, exact)
        if exact:  # per-rank state is not comparable across world sizes
            rng = [
                label(r, g, docs[1]["world_size"]) for (r, g), d in differing(*docs).items() if d
            ]
            notes = _rng_notes(*docs, metrics_identical=first is None)
    return ResumeTestResult(
        passed=first is None and problem is None and (not state or not exact),
        exact=exact,
        stop_at=stop_at,
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
    )


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
            # Exact: bit for bit (-0.0 is not 0.0), any NaN equal to any NaN.
            ok = bitwise.same_float(x, y) if exact else abs(x - y) <= tolerance * max(abs(x), 1e-12)
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


def _final_manifests(straight: Location | Path, resumed: Location | Path):
    """(the two final manifests, None), or (None, why they cannot be compared)."""
    docs = []
    for d in (straight, resumed):
        ckdir = checkpoint_dir(d)
        steps = ckdir.steps()
        if not steps:
            return None, f"{d} has no committed checkpoint to compare"
        docs.append(manifest.read(ckdir.step_path(steps[-1])))
    a, b = docs
    if a["step"] != b["step"]:
        return None, f"final checkpoints are of different steps: {a['step']} vs {b['step']}"
    algorithms = [manifest.fingerprint_algorithm(doc) for doc in docs]
    if algorithms[0] != algorithms[1]:  # saved by different versions of unbroken
        return None, (
            f"final checkpoints are fingerprinted differently ({algorithms[0]} vs "
            f"{algorithms[1]}); compare them with `unbroken diff`"
        )
    return (a, b), None


def _compare_final_state(a: dict, b: dict, exact: bool) -> tuple[list[str], int]:
    """(differing tensors, tensors compared). RNG state is left to :func:`_rng_notes`."""
    keys = {k for k in set(a["tensors"]) | set(b["tensors"]) if not k.startswith("rng/")}
    if not exact:  # another world size: per-rank state cannot be compared
        keys = {k for k in keys if "/rank_" not in k}
    out = []
    for key in sorted(keys):
        ta, tb = a["tensors"].get(key), b["tensors"].get(key)
        if ta is None or tb is None:
            out.append(f"{key}: only in the {'resumed' if ta is None else 'straight'} run")
        elif (ta["dtype"], ta["shape"], ta["fingerprint"]) != (
            tb["dtype"],
            tb["shape"],
            tb["fingerprint"],
        ):
            out.append(f"{key}: differs (fingerprint {ta['fingerprint']} vs {tb['fingerprint']})")
    return out, len(keys)


def _rng_notes(a: dict, b: dict, *, metrics_identical: bool) -> list[str]:
    """What a final RNG difference means. Reported, not failed: a lost RNG state that
    matters shows in the metrics; one that does not may be harmless."""
    changed = [(r, g) for (r, g), d in differing(a, b).items() if d]
    if not changed:
        return []
    ws = b["world_size"]
    reset = [e for e in b.get("lineage", []) if e.get("event") == "resume"
             and "rng" in (e.get("reset") or [])]  # fmt: skip
    if reset:
        names = ", ".join(label(r, g, ws) for r, g in changed)
        return [f"final RNG state differs ({names}): the resumed run restored with "
                f"reset={{'rng'}} at step {reset[-1].get('from_step')}, so its generators "
                "started fresh instead of continuing"]  # fmt: skip
    consequence = (
        "harmless only if nothing that matters draws from it later"
        if metrics_identical
        else "a likely cause of the difference above"
    )
    notes = []
    # torch's generators start from a fixed default seed in every process, seeded or not:
    # a difference can only come from what happened after the resume.
    fixed = [label(r, g, ws) for r, g in changed if g in ("torch", "cuda")]
    if fixed:
        notes.append(
            f"final RNG state differs ({', '.join(fixed)}): torch's generators start from a "
            "fixed seed, so after the resume something drew from them a different number "
            "of times than in the straight run (iter(DataLoader) draws a seed from torch's "
            "global generator unless the loader has a generator of its own), or the script "
            f"re-seeded after the restore; {consequence}"
        )
    # Python's and NumPy's global generators are seeded from the OS unless the script
    # seeds them: then they differ between any two runs.
    entropy = [label(r, g, ws) for r, g in changed if g not in ("torch", "cuda")]
    if entropy:
        notes.append(
            f"final RNG state differs ({', '.join(entropy)}): these start from OS entropy "
            "unless the script seeds them (then any two runs differ), or after the resume "
            f"they were drawn from a different number of times; {consequence}"
        )
    return notes
