"""The report of ``health_check.py``: its tables, and the page docs/health-check.md (the
prose that no measurement changes is written by hand in the page: :data:`PROSE`)."""

from __future__ import annotations

import itertools
import statistics
from typing import Any

from common import ROOT, git_revision, machine_info
from report import HEALTH, kept, table

TARGET_CAUGHT = 0.90  # at least, of optimizer resets, within HORIZON steps
# The page's hand-written blocks, kept as they are when it is written again.
PROSE = ("intro", "proof", "watch", "metric_names", "method", "reproduce")


def _pct(n: int, of: int) -> str:
    if not of:
        return "-"
    share = n / of
    return f"{n}/{of} ({share:.2%})" if 0 < share < 0.01 else f"{n}/{of} ({share:.1%})"


def from_watch(warning: str | None) -> bool:
    """The optimizer watch's warnings name the optimizer "this Checkpointer" restored."""
    return warning is not None and "this Checkpointer" in warning


def _steps(xs: list[int]) -> str:
    return f"{statistics.median(xs):g}" if xs else "-"


def _find(rates, script: str, case: str, check: str):
    for r in rates:
        if (r.script, r.case, r.check) == (script, case, check):
            return r
    return None


def _scripts(rates) -> list[str]:
    return list(dict.fromkeys(r.script for r in rates))


def false_alarm_table(rates, recordings) -> str:
    """Exact resumes: the metric check at every cut point; the optimizer watch on the
    resumes made through a real Checkpointer."""
    rows, total = [], [0, 0, 0, 0]
    for name in _scripts(rates):
        alone = _find(rates, name, "exact", "metrics")
        rec = next(r for r in recordings if r.script == name)
        found = list(rec.checkpointer.get("exact", {}).values())
        watch = sum(from_watch(w) for w, _ in found)
        total = [total[0] + alone.alarms, total[1] + alone.cuts, total[2] + watch,
                 total[3] + len(found)]  # fmt: skip
        rows.append([name, ", ".join(str(s) for s in alone.seeds),
                     _pct(alone.alarms, alone.cuts), _pct(watch, len(found)),
                     "yes" if rec.replayed_exactly else "NO"])  # fmt: skip
    rows.append(["all", "", _pct(total[0], total[1]), _pct(total[2], total[3]), ""])
    return table(
        ["script", "seeds", "metric check: alarms / cut points",
         "optimizer watch: alarms / resumes via Checkpointer", "replayed bit for bit"],
        rows,
    )  # fmt: skip


def effect_table(recordings, bug: str = "reset optimizer") -> str:
    """How much a reset moves the metrics, against their noise (medians over cut points)."""
    rows = []
    for rec in recordings:
        cuts = rec.buggy.get(bug)
        if not cuts:
            continue
        excess, noise, ratio = [], [], []
        for k, (loss, gn) in cuts.items():
            excess.append(statistics.mean(loss[1:21]) - statistics.mean(rec.loss[k + 1 : k + 21]))
            before = rec.loss[max(0, k - 50) : k]
            diffs = [b - a for a, b in itertools.pairwise(before)]
            noise.append(statistics.pstdev(diffs) / 2**0.5)
            ratio.append(statistics.mean(gn[1:4]) / statistics.mean(rec.grad_norm[k + 1 : k + 4]))
        rows.append([rec.script, f"{statistics.median(excess):+.3f}",
                     f"{statistics.median(noise):.3f}", f"{statistics.median(ratio):.2f}x"])  # fmt: skip
    return table(
        ["script", "loss: reset minus straight, mean of steps 2-21 after K",
         "loss noise per step", "gradient norm: reset / straight, steps 2-4"],
        rows,
    )  # fmt: skip


def bug_table(rates, bugs: tuple[str, ...]) -> str:
    """Buggy resumes: how many the metric check alone and the full check caught. A catch
    at a cut point where the exact resume alarms too is a false alarm, not a detection:
    counted in its own column."""
    rows = []
    for bug in bugs:
        sums = {"metrics": [0, 0, 0], "full": [0, 0]}
        for name in _scripts(rates):
            alone, full = _find(rates, name, bug, "metrics"), _find(rates, name, bug, "full")
            if alone is None:
                continue
            exact = set(_find(rates, name, "exact", "metrics").alarm_cuts)
            also = sum(cut in exact for cut in alone.alarm_cuts)
            cells = [name, bug, _pct(alone.alarms, alone.cuts), str(also),
                     _steps(alone.steps_to_alarm)]  # fmt: skip
            sums["metrics"] = [
                a + b
                for a, b in zip(sums["metrics"], (alone.alarms, alone.cuts, also), strict=True)
            ]
            if full is not None:
                cells += [_pct(full.alarms, full.cuts), _steps(full.steps_to_alarm)]
                sums["full"] = [sums["full"][0] + full.alarms, sums["full"][1] + full.cuts]
            else:
                cells += ["(as metric check)", ""]
            rows.append(cells)
        full_cell = _pct(*sums["full"]) if sums["full"][1] else "(as metric check)"
        rows.append(["all", bug, _pct(*sums["metrics"][:2]), str(sums["metrics"][2]), "",
                     full_cell, ""])  # fmt: skip
    return table(
        ["script", "bug", "metric check alone: caught", "of which the exact resume alarms too",
         "median steps", "full check via Checkpointer: caught", "median steps"],
        rows,
    )  # fmt: skip


def tables(rates, recordings, bugs: tuple[str, ...]) -> str:
    parts = [
        "== exact resumes (false alarms; target <= 1%)",
        false_alarm_table(rates, recordings),
        f"\n== buggy resumes (caught within the horizon; target for optimizer resets "
        f">= {TARGET_CAUGHT:.0%})",
        bug_table(rates, bugs),
        "\n== how much an optimizer reset moves the metrics (medians over cut points)",
        effect_table(recordings),
        "\n== examples",
    ]
    for r in rates:
        parts += [f"  {r.script} / {r.case} / {r.check}: {e}" for e in r.examples[:1]]
    return "\n".join(parts)


def _totals(rates, case: str, check: str) -> tuple[int, int]:
    picked = [r for r in rates if r.case == case and r.check == check]
    return sum(r.alarms for r in picked), sum(r.cuts for r in picked)


def page(rates, recordings, seconds: float, constants: dict[str, Any], bugs) -> str:
    """docs/health-check.md, from this measurement."""
    fa, fa_of = _totals(rates, "exact", "metrics")
    exact_full = [w for r in recordings for w, _ in r.checkpointer.get("exact", {}).values()]
    full_fa, full_fa_of = sum(map(from_watch, exact_full)), len(exact_full)
    reset_alone, reset_of = _totals(rates, "reset optimizer", "metrics")
    reset_full, reset_full_of = _totals(rates, "reset optimizer", "full")
    full_steps = [
        n
        for r in rates
        if (r.case, r.check) == ("reset optimizer", "full")
        for n in r.steps_to_alarm
    ]
    per_script = {
        name: _find(rates, name, "reset optimizer", "metrics") for name in _scripts(rates)
    }
    visible = ", ".join(
        f"{name} {r.alarms}/{r.cuts}" for name, r in per_script.items() if r is not None
    )
    replayed = all(r.replayed_exactly for r in recordings if r.checkpointer)
    info = machine_info("/tmp")
    return TEMPLATE.format(
        seconds=seconds / 60,
        revision=git_revision(str(ROOT)),
        machine=f"{info['cpu']}, torch {info['torch']}, {info['date']}",
        fa=_pct(fa, fa_of),
        full_fa=_pct(full_fa, full_fa_of),
        reset_alone=_pct(reset_alone, reset_of),
        reset_full=_pct(reset_full, reset_full_of),
        full_steps=f"{max(full_steps)}" if full_steps else "-",
        visible=visible,
        replayed="yes" if replayed else "NO (the offline method is not valid: investigate)",
        false_alarm_table=false_alarm_table(rates, recordings),
        bug_table=bug_table(rates, bugs),
        effect_table=effect_table(recordings),
        false_alarms="\n".join(
            f"- {r.script}: {e}"
            for r in rates
            if (r.case, r.check) == ("exact", "metrics")
            for e in r.examples
        )
        or "- none",
        **constants,
        **{name: kept(name, HEALTH.path) for name in PROSE},
    )


TEMPLATE = """\
# The post-resume health check, measured

Generated by `python benchmarks/health_check.py --write-docs` (`make health-check`) in
{seconds:.1f} minutes; edit by hand only its hand-written blocks. Revision {revision};
{machine}.

{intro}

**In short:**

- false alarms: the metric check fired on {fa} of exact resumes (every cut point of
  three training scripts, three seeds each), the optimizer watch on {full_fa};
- optimizer resets of the classic kind (a fresh optimizer built after `restore()`):
  {reset_full} caught, each within {full_steps} tracked steps, by the optimizer watch;
- the same resets judged from the loss and gradient norm alone (what remains when the
  watch cannot see the optimizer): {reset_alone};
- a lost RNG or data position rarely shows in those metrics: the check does not claim
  to see it.

{proof}

{watch}
2. **The metric check.** For the loss and for the logarithm of the gradient norm (it
   jumps by factors), at a point t of the series:
   - level = median of the {LEVEL} steps before t;
   - noise = 1.4826 x MAD of the step-to-step differences over the {NOISE} steps before
     t, divided by sqrt(2) (a steady trend is not noise), and at least 1% of the loss
     level or 5% of the gradient norm;
   - jump(t) = (largest of the {JUDGED} steps from t on - level) / noise.

   The jump at the resume K is compared with the jump at every earlier point of the
   window the checkpoint kept (the last {window} tracked steps): the check warns when
   `jump(K) > max({FLOOR:g}, {MARGIN:g} x the largest earlier jump)`, for either metric. Each
   run is its own reference, so a noisy loss, a spiky warm-up or a rising gradient norm
   raise the bar for themselves. It looks once, after {JUDGED} steps, and needs
   {MIN_BEFORE} steps of window before the resume (earlier resumes are not judged). When
   the watch saw the restored optimizer step, a warning blames the jump on something
   else (e.g. the learning-rate schedule).

{metric_names}

{method}
| char-gru | character-level GRU (96 units, dropout 0.1) on Python's own `argparse.py` | AdamW lr 5e-3, betas 0.9/0.99, cosine to 10% without warm-up; clipping at 1 | 400 | 32 |

- **Exact resumes.** An exact resume at step K produces exactly the straight run's
  series, so the metric check is measured offline at *every* cut point K >= {first_cut}
  of each straight run: it is fed the window a checkpoint keeps (the last {window} steps up to
  K), then the straight run's steps after K, one at a time, as `track()` feeds it. That
  premise is checked: at the sampled cut points below, the state is saved by a real
  `Checkpointer`, restored, and trained on with the full check on; the first steps after
  K matched the straight series bit for bit: **{replayed}**.
- **Buggy resumes.** At {cuts} evenly spaced cut points K in [{first_cut}, steps - {HORIZON}] per
  script, training continues from the state at K for {HORIZON} steps with one bug:
  - *reset optimizer*: the state is saved and restored by a real `Checkpointer`, then a
    fresh AdamW with the same hyperparameters is built (LR schedule position kept), as
    in `examples/gpt/train_buggy.py`. The full check is what that run's `Checkpointer`
    said; *metric check alone* is the same series fed without the optimizer watch: what
    you get when the watch cannot see the reset (an optimizer never passed to the
    `Checkpointer`, or a reset inside your own optimizer class);
  - *lost RNG*: the global generators start again from the script's seed (dropout masks
    replay from the start);
  - *lost data position*: the data stream starts again from its first batch.
  For these two the optimizer watch sees the restored optimizer step, so the full check
  says what the metric check says.
- The constants above were chosen on seeds 0, 2 and 3 of these scripts; the rates below
  are measured on other seeds (listed), which the design never saw. Every run is
  seeded: the measurement is deterministic on a given machine and torch build.

## Results

Exact resumes (target: false alarms <= 1%). The metric check is judged at every cut
point of every seed; the optimizer watch on the {cuts} resumes per script made through a
real `Checkpointer` (first seed), whose first steps replayed the straight run bit for
bit:

{false_alarm_table}

The metric check's false alarms:

{false_alarms}

Buggy resumes, caught within {HORIZON} steps (target for optimizer resets: >= 90%):

{bug_table}

Why the metrics alone miss most resets: how much a reset moved them, against their own
noise (medians over the cut points; loss noise = standard deviation of the step-to-step
differences over the 50 steps before K, divided by sqrt(2)):

{effect_table}

## What it can and cannot detect

- **A fresh optimizer after `restore()`** (the classic silent reset): caught by the
  optimizer watch within {full_steps} tracked steps, {reset_full} here; the watch
  fired on {full_fa} of the exact resumes through a `Checkpointer`. The same holds for an
  optimizer whose state is emptied after the restore (caught at the first tracked step;
  see `tests/unit/test_health_check.py`).
- **Optimizer resets the watch cannot see** (the optimizer is not passed to the
  `Checkpointer`, so its state is never saved; or your optimizer keeps its moments
  outside `optimizer.state`): only the metric check remains, and it catches a reset
  only when the fresh optimizer's full-size first steps visibly disturb training,
  mostly at a high learning rate ({visible} here). Where a reset moves the loss by a
  small fraction of its step-to-step noise and leaves the gradient norm as it was (the
  MLP and the GRU above), no check of these two series can see it, and this one does
  not try.
- **A lost RNG or data position** changes which dropout masks or batches come next,
  not how training behaves on average: the series after the resume look like
  continuations. The rates above are what the metric check caught; treat the check as
  blind to these bugs. `unbroken resume-test` catches them: it compares with a straight
  run bit for bit.
- **False alarms**: {fa} of exact resumes, every cut point of every straight run;
  the riskiest resumes are early ones, where the window is short and training still
  changes fast. A resume with fewer than {MIN_BEFORE} tracked steps before it is not
  judged by the metric check at all.
- **What to do with a warning**: run `unbroken resume-test` on your training command;
  if the optimizer watch named an optimizer, pass the one you step to
  `Checkpointer(optimizer=...)` and build it before `restore()`.

{reproduce}
"""
