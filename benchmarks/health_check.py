"""The post-resume health check's false-alarm and detection rates, measured.

    python benchmarks/health_check.py                  # measure and print the tables
    python benchmarks/health_check.py --write-docs     # also regenerate docs/health-check.md
    python benchmarks/health_check.py --quick          # a smoke test (few steps, few cuts)
    python benchmarks/health_check.py --save-series runs/health.json   # keep the series
    python benchmarks/health_check.py --from-series runs/health.json   # judge them again

Three small training scripts (``health_scripts.py``) train straight; exact resumes are
judged offline at every cut point (an exact resume replays the straight series), buggy
ones by really training on from the cut with the bug, at evenly spaced cut points, which
also go through a real ``Checkpointer`` (docs/health-check.md, "Method", says how). Every
run is seeded: the measurement is deterministic. Never asserts: it prints tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

import health_report
import unbroken as ub
from health_scripts import BUGS, SCRIPTS, Progress, Script
from report import HEALTH, add_options, publish
from unbroken.run import health_check as monitor
from unbroken.run.health_check import HORIZON, JUDGED, HealthCheck
from unbroken.run.record import METRICS_WINDOW

FIRST_CUT = 10  # the first cut point measured: below it a window hardly exists
# Seeds measured: the monitor's constants were chosen on seeds 0, 2 and 3, never on these.
REPORT_SEEDS = (1, 4, 5)  # straight runs per script (false alarms); bugs: the first seed
CUTS = 30  # cut points per script and bug
MONITOR_CONSTANTS = ("HORIZON", "MIN_BEFORE", "LEVEL", "NOISE", "JUDGED", "FLOOR", "MARGIN")


@dataclasses.dataclass
class Recording:
    """One script and seed: its straight series and the resumes from its cut points."""

    script: str
    seed: int
    loss: list[float]  # loss[i] is step i + 1
    grad_norm: list[float]
    # bug -> cut point K -> (loss, grad norm) of steps K+1 .. K+HORIZON
    buggy: dict[str, dict[int, tuple[list[float], list[float]]]]
    # "exact" or "reset optimizer" -> K -> [first warning or None, tracked steps to it],
    # from resumes through a real Checkpointer (save at K, restore, train, track)
    checkpointer: dict[str, dict[int, list]] = dataclasses.field(default_factory=dict)
    replayed_exactly: bool = True  # every exact Checkpointer resume matched the series


def cut_points(steps: int, count: int) -> list[int]:
    """``count`` evenly spaced cut points in [FIRST_CUT, steps - HORIZON]."""
    last = steps - HORIZON
    if count <= 1:
        return [FIRST_CUT]
    return sorted({round(FIRST_CUT + i * (last - FIRST_CUT) / (count - 1)) for i in range(count)})


def record(cls: type[Script], seed: int, *, cuts: int, steps: int | None = None) -> Recording:
    """Train ``cls`` straight, snapshotting at the cut points; then resume from each."""
    script = cls(seed)
    steps = steps or cls.steps
    wanted = set(cut_points(steps, cuts)) if cuts else set()
    snaps, loss, gn = {}, [], []
    for k in range(steps):
        if k in wanted:
            snaps[k] = script.snapshot()
        value, norm = script.train_step()
        loss.append(value)
        gn.append(norm)
    rec = Recording(cls.name, seed, loss, gn, {})
    if not snaps:
        return rec
    with tempfile.TemporaryDirectory(prefix="health-check-") as tmp:
        for k, snap in sorted(snaps.items()):
            after, found = _through_checkpointer(script, snap, rec, Path(tmp) / str(k), None)
            rec.replayed_exactly &= after == (
                loss[k : k + len(after[0])],
                gn[k : k + len(after[1])],
            )
            rec.checkpointer.setdefault("exact", {})[k] = found
        for bug in BUGS:
            for k, snap in sorted(snaps.items()):
                if bug == "reset optimizer":
                    # The classic form of the bug: a fresh AdamW built after restore().
                    where = Path(tmp) / f"{k}-reset"
                    after, found = _through_checkpointer(script, snap, rec, where, bug)
                    rec.checkpointer.setdefault(bug, {})[k] = found
                else:
                    script.resume(snap, bug)
                    after = _train(script, HORIZON)
                rec.buggy.setdefault(bug, {})[k] = after
    return rec


def _train(script: Script, n: int, ckpt: ub.Checkpointer | None = None, found=None):
    """``n`` steps; tracked through ``ckpt`` if given (its first warning kept in ``found``)."""
    out: tuple[list[float], list[float]] = ([], [])
    for i in range(n):
        value, norm = script.train_step()
        out[0].append(value)
        out[1].append(norm)
        if ckpt is not None:
            ckpt.track(script.step_no, loss=value, grad_norm=norm)
            if ckpt.warnings and found[0] is None:
                found[:] = [ckpt.warnings[0], i + 1]
    return out


def _through_checkpointer(script: Script, snap, rec: Recording, where: Path, bug: str | None):
    """Save the state of ``snap`` with a Checkpointer (its window tracked), restore it into
    the live objects, apply ``bug`` and train: the exact case 4 steps (enough for the
    check), a bug ``HORIZON`` steps. Returns the series after K and [warning, steps]."""
    script.resume(snap)
    k = snap["step"]

    def checkpointer() -> ub.Checkpointer:
        return ub.Checkpointer(
            where, model=script.model, optimizer=script.opt, dataloader=script.stream,
            extra={"progress": Progress(script)}, keep_last=1,
        )  # fmt: skip

    ckpt = checkpointer()
    for s in range(max(1, k - METRICS_WINDOW + 1), k + 1):
        ckpt.track(s, loss=rec.loss[s - 1], grad_norm=rec.grad_norm[s - 1])
    ckpt.save(k)
    ckpt.close()
    ckpt = checkpointer()
    ckpt.restore()
    if bug == "reset optimizer":
        script.opt = script.build_optimizer()
    elif bug is not None:
        raise ValueError(f"only the optimizer reset goes through a Checkpointer, not {bug!r}")
    found: list = [None, None]
    after = _train(script, HORIZON if bug else JUDGED, ckpt, found)
    ckpt.close()
    return after, found


def judge(loss: list[float], gn: list[float], k: int, after: tuple[list[float], list[float]]):
    """What the metric check says about a resume at ``k``: [warning or None, steps to it].

    ``loss``/``gn`` hold the steps up to k (at least); ``after`` the steps after it. The
    check is fed as ``Checkpointer.track`` feeds it, with no optimizer to watch.
    """
    first = max(1, k - METRICS_WINDOW + 1)
    window = {s: {"loss": loss[s - 1], "grad_norm": gn[s - 1]} for s in range(first, k + 1)}
    check = HealthCheck(window, k)
    for i, (value, norm) in enumerate(zip(*after, strict=True)):
        found = check.observe(k + 1 + i, {"loss": value, "grad_norm": norm})
        if found:
            return [found[0], i + 1]
        if check.done:
            break
    return [None, None]


@dataclasses.dataclass
class Rate:
    """How often one check spoke on a set of resumes of one script."""

    script: str
    case: str  # "exact" or one of BUGS
    check: str  # "metrics": the metric check alone; "full": through a Checkpointer
    seeds: list[int]
    cuts: int = 0
    alarms: int = 0
    steps_to_alarm: list[int] = dataclasses.field(default_factory=list)
    examples: list[str] = dataclasses.field(default_factory=list)
    alarm_cuts: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (seed, K)

    @property
    def rate(self) -> float:
        return self.alarms / self.cuts if self.cuts else 0.0

    def count(self, k: int, found: list, seed: int, where: str = "") -> None:
        """One resume at ``k``: ``found`` is [warning or None, tracked steps to it]."""
        self.cuts += 1
        if found[0] is None:
            return
        self.alarms += 1
        self.alarm_cuts.append((seed, k))
        self.steps_to_alarm.append(found[1])
        if len(self.examples) < 3:
            self.examples.append(f"{where}K={k}, after {found[1]} steps: {found[0]}")


def measure(recordings: list[Recording]) -> list[Rate]:
    """Every rate the report shows, script by script."""
    rates = []
    for name in SCRIPTS:
        recs = [r for r in recordings if r.script == name]
        if not recs:
            continue
        exact = Rate(name, "exact", "metrics", [r.seed for r in recs])
        for r in recs:  # every cut point of every straight run
            for k in range(FIRST_CUT, len(r.loss)):
                after = (r.loss[k : k + HORIZON], r.grad_norm[k : k + HORIZON])
                exact.count(k, judge(r.loss, r.grad_norm, k, after), r.seed, f"seed {r.seed}, ")
        rates.append(exact)
        first = recs[0]
        for case in ("exact", *BUGS):
            if case in first.checkpointer:
                full = Rate(name, case, "full", [first.seed])
                for k, found in sorted(first.checkpointer[case].items()):
                    full.count(k, found, first.seed)
                rates.append(full)
            if case in first.buggy:
                alone = Rate(name, case, "metrics", [first.seed])
                for k, after in sorted(first.buggy[case].items()):
                    alone.count(k, judge(first.loss, first.grad_norm, k, after), first.seed)
                rates.append(alone)
    return rates


def _save(recordings: list[Recording], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([dataclasses.asdict(r) for r in recordings]))


def _load(path: Path) -> list[Recording]:
    out = []
    for d in json.loads(path.read_text()):
        d["buggy"] = {b: {int(k): tuple(v) for k, v in ks.items()} for b, ks in d["buggy"].items()}
        d["checkpointer"] = {
            c: {int(k): v for k, v in ks.items()} for c, ks in d["checkpointer"].items()
        }
        out.append(Recording(**d))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps and cuts: a smoke test")
    parser.add_argument("--scripts", nargs="*", default=list(SCRIPTS), choices=list(SCRIPTS))
    parser.add_argument("--seeds", type=int, nargs="*", default=list(REPORT_SEEDS))
    parser.add_argument("--cuts", type=int, default=CUTS, help="cut points per script and bug")
    parser.add_argument("--save-series", type=Path, help="write the recorded series here")
    parser.add_argument("--from-series", type=Path, help="judge series saved earlier")
    add_options(parser, HEALTH)
    args = parser.parse_args()
    if args.write_docs and (args.quick or args.from_series):
        parser.error("--write-docs needs a full measurement (not --quick or --from-series)")
    torch.set_num_threads(1)
    logging.getLogger("unbroken").setLevel(logging.ERROR)  # the warnings are counted instead
    started = time.perf_counter()
    if args.from_series:
        recordings = _load(args.from_series)
    else:
        recordings = []
        for name in args.scripts:
            cls = SCRIPTS[name]
            steps = HORIZON + 2 * FIRST_CUT + 10 if args.quick else None
            for i, seed in enumerate(args.seeds[:1] if args.quick else args.seeds):
                cuts = (3 if args.quick else args.cuts) if i == 0 else 0
                t = time.perf_counter()
                recordings.append(record(cls, seed, cuts=cuts, steps=steps))
                print(f"recorded {name} seed {seed}: {time.perf_counter() - t:.0f} s", flush=True)
    if args.save_series:
        _save(recordings, args.save_series)
    rates = measure(recordings)
    constants = {name: getattr(monitor, name) for name in MONITOR_CONSTANTS}
    constants.update(first_cut=FIRST_CUT, cuts=args.cuts, window=METRICS_WINDOW)
    seconds = time.perf_counter() - started
    publish(
        health_report.tables(rates, recordings, BUGS),
        lambda: health_report.page(rates, recordings, seconds, constants, BUGS),
        HEALTH,
        show=args.markdown,
        page=Path(args.write_docs) if args.write_docs else None,
    )
    print(f"({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
