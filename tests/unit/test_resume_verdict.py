"""The resume test's verdict (proof/replay.py) on runs made in this process: it requires
that the resumed run restored each stop step, compares the whole saved state by bits,
names the resume after which a difference appeared, and names a cause only from
evidence (issue 26, items 1-5)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

import unbroken as ub
from conftest import Problem
from unbroken.format import manifest
from unbroken.testing import compare


class Progress:
    """An extra with a counter and a float that the training never reads."""

    def __init__(self) -> None:
        self.n, self.f = 0, 0.0

    def state_dict(self) -> dict:
        return {"n": self.n, "f": self.f}

    def load_state_dict(self, state: dict) -> None:
        self.n, self.f = state["n"], state["f"]


def _train(folder: Path, *, stops=(), steps: int = 6, seed: int = 0, on_resume=None,
           overwrite_on: int | None = None) -> dict[int, dict]:  # fmt: skip
    """Train to ``steps``, relaunched (a new Checkpointer) after each stop; a checkpoint
    every 2 steps and at each stop, all kept (an odd ``steps`` ends unsaved). ``on_resume(i, problem, progress)`` runs
    after the i-th restore; launch ``overwrite_on`` has ``overwrite=True``. Returns the
    manifests seen after each launch (as the harness passes them to compare)."""
    seen: dict[int, dict] = {}
    bounds = [0, *stops, steps]
    for launch, end in enumerate(bounds[1:]):
        p, progress = Problem(seed=seed), Progress()
        ckpt = p.checkpointer(folder, extra={"progress": progress}, keep_last=None,
                              overwrite=launch == overwrite_on)  # fmt: skip
        start = ckpt.restore().step
        if launch and on_resume is not None:
            on_resume(launch, p, progress)
        for step in range(start + 1, end + 1):
            progress.n += 1
            ckpt.track(step, loss=p.step())
            if step % 2 == 0 or step in stops:
                ckpt.save(step)
        ckpt.close()
        for step in ckpt.steps():
            seen.setdefault(step, manifest.read(folder / f"step_{step:08d}"))
    return seen


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("straight") / "run"
    _train(folder)
    return folder


# 1. The resumed run must have restored each stop step ----------------------------------


def test_a_run_that_started_fresh_is_not_resumed(straight, tmp_path):
    """Its metrics are the straight run's (a deterministic fresh start), so the old
    verdict was IDENTICAL: now NOT RESUMED, saying what it did instead."""
    _train(tmp_path / "r", stops=[4], overwrite_on=1)
    result = compare(straight, tmp_path / "r", stop_at=4)
    assert result.first_difference is None  # the metrics alone cannot tell
    assert not result.passed and not result.resumed and result.verdict == "NOT RESUMED"
    assert result.not_resumed.startswith("the resumed run (meant to continue from step 4) "
                                         "started fresh")  # fmt: skip
    assert str(result).startswith("resume test: NOT RESUMED")
    assert f"not resumed: {result.not_resumed}" in str(result)


def test_a_run_that_restored_another_step_is_not_resumed(straight, tmp_path):
    folder = tmp_path / "r"
    _train(folder, stops=[4], steps=4)
    p = Problem()
    ckpt = p.checkpointer(folder, extra={"progress": Progress()}, keep_last=None)
    ckpt.restore(step=2)  # the script restores a fixed step, not the latest
    for step in range(3, 7):
        ckpt.track(step, loss=p.step())
        if step % 2 == 0:
            ckpt.save(step)
    ckpt.close()
    result = compare(straight, folder, stop_at=4)
    assert result.verdict == "NOT RESUMED" and result.resumed_from == [2]
    assert "restored step 2 instead of step 4" in result.not_resumed


def test_the_resume_that_did_not_restore_is_named(straight, tmp_path):
    """Two stops; the 1st resume started fresh and the 2nd restored its stop. Once
    retention removed step 4, the final lineage shows only the 2nd; what the harness saw
    between the runs still names the 1st."""
    seen = _train(tmp_path / "r", stops=[2, 4], overwrite_on=1)
    shutil.rmtree(tmp_path / "r" / "step_00000004")  # as keep_last would
    alone = compare(straight, tmp_path / "r", stop_at=[2, 4])
    assert alone.verdict == "NOT RESUMED" and alone.resumed_from == [4]
    assert "an earlier resume did not restore its stop" in alone.not_resumed
    seen_too = compare(straight, tmp_path / "r", stop_at=[2, 4], checkpoints=seen)
    assert seen_too.not_resumed.startswith(
        "the 1st resume (meant to continue from step 2) started fresh"
    ), seen_too.not_resumed


def test_every_stop_restored_is_identical(straight, tmp_path):
    seen = _train(tmp_path / "r", stops=[2, 4])
    result = compare(straight, tmp_path / "r", stop_at=[2, 4], checkpoints=seen)
    assert result.passed and result.verdict == "IDENTICAL", str(result)
    assert result.stops == [2, 4] and result.stop_at == 2 and result.resumed_from == [2, 4]


def test_a_last_resume_that_saves_nothing_is_read_from_the_metrics_record(tmp_path):
    """The last run ends between two saves (as the GPT demo does): no checkpoint shows its
    restore, but its metrics record does. A run that started fresh there is refused."""
    _train(tmp_path / "straight", steps=5)
    _train(tmp_path / "resumed", stops=[4], steps=5)
    result = compare(tmp_path / "straight", tmp_path / "resumed", stop_at=4)
    assert result.passed and result.verdict == "IDENTICAL", str(result)
    assert any("its restore of step 4 is read from its metrics record" in n
               for n in result.notes)  # fmt: skip
    _train(tmp_path / "fresh", stops=[4], steps=5, overwrite_on=1)
    fresh = compare(tmp_path / "straight", tmp_path / "fresh", stop_at=4)
    assert fresh.verdict == "NOT RESUMED"
    assert fresh.not_resumed == (
        "the resumed run (meant to continue from step 4) started fresh (its metrics record "
        "shows no restore), and committed no checkpoint after step 4"
    )


@pytest.mark.parametrize("stop_at", [[4, 2], [2, 2], [0], [], True, [2.0]])
def test_bad_stop_steps_are_refused(straight, stop_at):
    with pytest.raises(ValueError, match="stop_at"):
        compare(straight, straight, stop_at=stop_at)


# 2. The whole saved state, by bits -------------------------------------------------------


def _lose_counter(launch, p, progress):
    progress.n = 0  # an extra's counter not restored


def _bump_step_count(launch, p, progress):
    p.sched._step_count += 5  # a scheduler counter the learning rate does not read


def _negate_zero(launch, p, progress):
    progress.f = -0.0  # the same number, other bits


@pytest.mark.parametrize(
    ("bug", "path"),
    [(_lose_counter, "progress/n: 6 vs 2"), (_bump_step_count, "scheduler/_step_count: 7 vs 12"),
     (_negate_zero, "progress/f: 0.0 vs -0.0")],
    ids=["extra-counter", "scheduler-counter", "negative-zero"],
)  # fmt: skip
def test_non_tensor_state_that_differs_fails(straight, tmp_path, bug, path):
    """The metrics and every tensor are identical; only non-tensor state differs. It was
    IDENTICAL (tensors' fingerprints only); now DIFFERENT, naming the value."""
    _train(tmp_path / "r", stops=[4], on_resume=bug)
    result = compare(straight, tmp_path / "r", stop_at=4)
    assert result.first_difference is None
    assert not result.passed and result.verdict == "DIFFERENT"
    assert path in result.state_differences, result.state_differences
    assert f"final state: {path}" in str(result)


def test_diff_uses_the_same_rule_for_non_tensor_state(straight, tmp_path):
    """`unbroken diff` and the resume test share one comparison: -0.0 is not 0.0."""
    _train(tmp_path / "r", stops=[4], on_resume=_negate_zero)
    report = ub.diff_checkpoints(straight, tmp_path / "r")
    progress = next(c for c in report.components if c.name == "progress")
    assert progress.status == "different" and progress.state_differences == [
        "progress/f: 0.0 vs -0.0"
    ]
    assert not report.identical


def test_skeleton_leaves_compare_by_bits_and_json_type():
    from unbroken.format.state_compare import same_leaf, skeleton_differences

    nan = {"__ub__": "float", "repr": "nan"}
    assert same_leaf(nan, {"__ub__": "float", "repr": "nan"}) and same_leaf(math.nan, nan)
    assert not same_leaf(0.0, -0.0) and not same_leaf(1, 1.0) and not same_leaf(True, 1)
    assert not same_leaf({"__ub__": "float", "repr": "inf"}, {"__ub__": "float", "repr": "-inf"})
    ref = {"__ub__": "tensor", "key": "x/w"}
    tables = ({"x/w": {"dtype": "float32", "shape": [2], "fingerprint": "aa"}},
              {"x/w": {"dtype": "float32", "shape": [2], "fingerprint": "bb"}})  # fmt: skip
    assert skeleton_differences([ref], [ref], "x") == []  # values not compared: no tables
    assert skeleton_differences([ref], [ref], "x", tables=tables) == [
        "x: differs (fingerprint aa vs bb)"
    ]
    grad = {**ref, "requires_grad": True}
    assert skeleton_differences([{"w": ref}], [{"w": grad}], "x") == [
        "x/w: requires_grad None vs True"
    ]


# 3. Several stops: the resume after which a difference appeared -----------------------


def _reseed_on_second(launch, p, progress):
    if launch == 2:
        torch.manual_seed(123)  # the restored RNG state lost, on the 2nd resume only


def test_a_bug_of_the_second_resume_is_named(straight, tmp_path):
    one = tmp_path / "one"
    _train(one, stops=[2], on_resume=_reseed_on_second)
    assert compare(straight, one, stop_at=2).passed  # one stop cannot see it
    seen = _train(tmp_path / "two", stops=[2, 4], on_resume=_reseed_on_second)
    result = compare(straight, tmp_path / "two", stop_at=[2, 4], checkpoints=seen)
    assert not result.passed and result.first_difference_step == 5
    assert result.first_difference_resume == 2
    assert "(after the 2nd resume, from step 4)" in str(result)
    assert "stopped and resumed at steps 2, 4" in str(result)


def test_the_cause_names_the_second_resume_and_repeats_its_saved_warning(straight, tmp_path):
    """Issue 36, item 10: with several stops, the cause line names the resume after which
    the first difference came (the 2nd, from step 4) and repeats the warning the
    checkpoint it restored was saved with (its manifest's ``save_warnings``), not the
    1st resume's. Before, the cause said neither the warning nor, read alone, why."""
    seen = _train(tmp_path / "two", stops=[2, 4], on_resume=_reseed_on_second)
    seen[2] = {**seen[2], "save_warnings": ["warned at step 2"]}
    seen[4] = {**seen[4], "save_warnings": ["3 parameters hold gradients", "and more"]}
    result = compare(straight, tmp_path / "two", stop_at=[2, 4], checkpoints=seen)
    assert result.first_difference_resume == 2
    assert "after the 2nd resume, from step 4" in result.cause, result.cause
    assert result.cause.endswith(
        "The checkpoint of step 4 that this resume restored was saved with warnings: "
        '"3 parameters hold gradients"; "and more"'
    ), result.cause
    assert "warned at step 2" not in result.cause


def test_a_cause_without_saved_evidence_still_names_the_resume(straight, tmp_path):
    """Issue 36, item 10: state the checkpoints do not hold goes wrong after the 2nd
    resume only. "No evidence in the saved state" now also names the resume after which
    the first difference came, and the warning its checkpoint was saved with."""
    outside = {"value": 0.0}

    def lose_outside(launch, p, progress):
        if launch == 2:
            outside["value"] = 1.0  # state the Checkpointer is not given, changed

    bounds = {"a": (), "b": (2, 4)}
    seen: dict[int, dict] = {}
    for name, stops in bounds.items():
        outside["value"] = 0.0
        folder = tmp_path / name
        for launch, (start, end) in enumerate(zip([0, *stops], [*stops, 6], strict=True)):
            p = Problem()
            ckpt = p.checkpointer(folder, keep_last=None)
            assert ckpt.restore().step == start
            if launch:
                lose_outside(launch, p, None)
            for step in range(start + 1, end + 1):
                ckpt.track(step, loss=p.step(), outside=outside["value"])
                if step % 2 == 0:
                    ckpt.save(step)
            ckpt.close()
    for step in (2, 4, 6):
        seen[step] = manifest.read(tmp_path / "b" / f"step_{step:08d}")
    seen[4] = {**seen[4], "save_warnings": ["the save knew"]}
    result = compare(tmp_path / "a", tmp_path / "b", stop_at=[2, 4], checkpoints=seen)
    assert result.first_difference_step == 5 and not result.state_differences
    assert result.cause.startswith("no evidence in the saved state"), result.cause
    assert result.cause.endswith(
        "; the first difference came at step 5, after the 2nd resume, from step 4. The "
        'checkpoint of step 4 that this resume restored was saved with a warning: "the '
        'save knew"'
    ), result.cause


# 4. A cause only from evidence ----------------------------------------------------------


def test_the_cause_is_the_first_state_that_differs_after_the_resume(straight, tmp_path):
    """Identical at the stop (both runs kept step 4), different after the resume: the
    resume lost something, first seen in the RNG (torch CPU)."""
    _train(tmp_path / "r", stops=[4], on_resume=lambda i, p, pr: torch.manual_seed(123))
    result = compare(straight, tmp_path / "r", stop_at=4)
    assert result.cause.startswith(
        "the checkpoints are identical at step 4, where the run stopped, and differ at "
        "step 6, after the 1st resume, from step 4: the resume lost or changed something"
    ), result.cause
    assert "rng (torch CPU)" in result.cause and f"cause: {result.cause}" in str(result)
    assert not any("likely cause" in n for n in result.notes), result.notes


def test_training_that_differs_before_the_stop_is_not_blamed_on_the_rng(straight, tmp_path):
    """Another seed (as an unseeded script gets): the runs differ from step 1. The old
    report called the final RNG difference "a likely cause"; the evidence says the
    training is not deterministic, before any resume."""
    _train(tmp_path / "r", stops=[4], seed=1)
    result = compare(straight, tmp_path / "r", stop_at=4)
    assert not result.passed and result.resumed
    assert result.cause.startswith(
        "the runs differ already at step 1 (metric 'loss'), before any resume"
    )
    assert not any("likely cause" in n for n in result.notes), result.notes


def test_an_unseeded_run_is_told_to_seed_the_script(straight, tmp_path):
    """Issue 36, item 10: runs whose generators differ already in the checkpoints saved
    before any resume (as an unseeded script's do under torch 2.13, which starts torch's
    generator from OS entropy in every process) are told to seed the script, with each
    framework's call; the final RNG note no longer says torch starts from a fixed seed."""
    _train(tmp_path / "r", stops=[4], seed=1)
    result = compare(straight, tmp_path / "r", stop_at=4)
    assert result.cause.startswith(
        "the runs differ already at step 1 (metric 'loss'), before any resume: the script "
        "is not seeded (or seeded differently in each run): the random generators (torch "
        "CPU) differ already in the checkpoints of step 2, saved before any resume"
    ), result.cause
    for call in ("torch.manual_seed(0)", "lightning.seed_everything(0)",
                 "transformers.set_seed(0)", "accelerate.utils.set_seed(0)"):  # fmt: skip
        assert call in result.cause, call
    assert not any("fixed seed" in n for n in result.notes), result.notes


def test_seeded_runs_that_differ_before_the_stop_are_not_told_to_seed(straight, tmp_path):
    """Every generator the same before the resume, a metric not: not the seeding, the
    training is not deterministic (issue 36, item 10: the seed advice only on evidence)."""
    for folder, noise in ((tmp_path / "a", 0.0), (tmp_path / "b", 1.0)):
        for start, end in ((0, 4), (4, 6)) if noise else ((0, 6),):
            p = Problem()
            ckpt = p.checkpointer(folder, keep_last=None)
            ckpt.restore()
            for step in range(start + 1, end + 1):
                ckpt.track(step, loss=p.step(), timing=noise)  # a value outside the state
                if step % 2 == 0:
                    ckpt.save(step)
            ckpt.close()
    result = compare(tmp_path / "a", tmp_path / "b", stop_at=4)
    assert result.cause.startswith(
        "the runs differ already at step 1 (metric 'timing'), before any resume, though "
        "every random generator was the same in both runs at step 2: the training itself "
        "is not deterministic"
    ), result.cause
    assert "seed the script" not in result.cause


def test_no_evidence_is_said_rather_than_guessed(straight, tmp_path):
    """A metric from state the Checkpointer is not given: every checkpoint is identical,
    the metrics differ, and the report says the saved state holds no evidence."""
    for folder, stops in ((tmp_path / "a", ()), (tmp_path / "b", (4,))):
        outside = 0  # not saved: starts again at every launch
        for start, end in zip([0, *stops], [*stops, 6], strict=True):
            p = Problem()
            ckpt = p.checkpointer(folder, keep_last=None)
            assert ckpt.restore().step == start
            for step in range(start + 1, end + 1):
                outside = outside + 1 if start == 0 else 0
                ckpt.track(step, loss=p.step(), outside=float(outside))
                if step % 2 == 0:
                    ckpt.save(step)
            ckpt.close()
    result = compare(tmp_path / "a", tmp_path / "b", stop_at=4)
    assert result.first_difference_step == 5 and not result.state_differences
    assert result.cause.startswith(
        "no evidence in the saved state: every checkpoint both runs kept (step(s) 2, 4, 6)"
    ), result.cause


# 5. One "same value" rule ---------------------------------------------------------------


def _record(folder: Path, values: dict[int, dict[str, float]]) -> None:
    folder.mkdir()
    lines = [{"segment": "s", "resumed_from": None, "parent": None, "world_size": 1, "time": 0}]
    lines += [{"segment": "s", "step": s, "metrics": {k: v if math.isfinite(v) else repr(v)
                                                       for k, v in m.items()}}
              for s, m in values.items()]  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_the_same_value_agrees_within_any_tolerance(tmp_path):
    """Across world sizes the metrics may differ within a tolerance; a NaN in both runs
    is the same value there too (it was a difference: NaN - NaN is not within any)."""
    values = {s: {"loss": 1.0 / s, "nan": math.nan} for s in range(1, 5)}
    _record(tmp_path / "a", values)
    _record(tmp_path / "b", values)
    result = compare(tmp_path / "a", tmp_path / "b", stop_at=1, exact=False, tolerance=0.1)
    assert result.first_difference is None, result.first_difference


def test_the_plot_does_not_call_negative_zero_identical(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    from unbroken.format.series import Series
    from unbroken.proof.plotting import plot_resume_test

    a = Series({"loss": [(s, 0.0) for s in range(1, 6)]}, resumes=[], warnings=[])
    b = Series({"loss": [(s, 0.0 if s < 4 else -0.0) for s in range(1, 6)]}, resumes=[2],
               warnings=[])  # fmt: skip
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        same = Path(plot_resume_test(a, a, tmp_path / "same.svg", stop_at=[2, 3])).read_text()
        other = Path(plot_resume_test(a, b, tmp_path / "other.svg", stop_at=2)).read_text()
    assert "every value identical" in same and "stop (3)" in same
    assert "every value identical" not in other
