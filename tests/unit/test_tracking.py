"""Tracked metrics survive resumes as one series, and the health check reads them."""

from __future__ import annotations

import json
import math
import os
import signal

import pytest
import torch

from conftest import Problem
from unbroken.errors import CheckpointError
from unbroken.format.series import read_series
from unbroken.run import health_check, metrics


def _run(ckpt_dir, upto, *, save_at=(), seed=0, restore_step=None, close=True):
    p = Problem(seed=seed)
    ckpt = p.checkpointer(ckpt_dir, keep_last=None)
    start = ckpt.restore(step=restore_step).step
    for step in range(start, upto):
        ckpt.track(step + 1, loss=p.step(), grad_norm=torch.tensor(1.0 + step))
        if step + 1 in save_at:
            ckpt.save(step + 1)
    if close:
        ckpt.close()
    return ckpt


def test_series_across_resumes_has_no_duplicates(ckpt_dir):
    _run(ckpt_dir, 6, save_at={3, 6})
    _run(ckpt_dir, 9, save_at={9})  # resumes from 6
    _run(ckpt_dir, 8, restore_step=3, close=True)  # replays 4..8 from step 3
    series = read_series(ckpt_dir)
    assert series.steps("loss") == [1, 2, 3, 4, 5, 6, 7, 8]  # 9 belonged to a dead timeline
    assert series.resumes == [3]
    assert [v for _, v in series.values["grad_norm"]] == [float(s) for s in range(1, 9)]


def test_a_step_tracked_in_two_calls_is_one_step_in_the_series_and_the_manifest(ckpt_dir):
    """Issue 36, item 3: ``track(s, loss=)`` then ``track(s, eval_loss=)``: the series
    (``unbroken plot``, resume-test's comparison) and the manifest's window hold both
    metrics at ``s`` (the second call's line replaced the first's: the loss was lost);
    a resumed segment's recompute of ``s`` still replaces the old values, not merges."""
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir, keep_last=None)
    ckpt.restore()
    for step in range(1, 5):
        ckpt.track(step, loss=float(step))
        ckpt.track(step, eval_loss=10.0 + step)
        if step == 2:
            ckpt.save(2)
    del ckpt  # a crash after step 4
    doc = json.loads((ckpt_dir / "step_00000002" / "manifest.json").read_text())
    assert doc["metrics"] == [
        {"step": 1, "loss": 1.0, "eval_loss": 11.0},
        {"step": 2, "loss": 2.0, "eval_loss": 12.0},
    ]
    series = read_series(ckpt_dir)
    assert series.values["loss"] == [(s, float(s)) for s in range(1, 5)]
    assert series.values["eval_loss"] == [(s, 10.0 + s) for s in range(1, 5)]
    q = Problem(seed=1)
    with q.checkpointer(ckpt_dir, keep_last=None) as ckpt:
        ckpt.restore()
        ckpt.track(3, loss=30.0)  # recomputed without an evaluation
    series = read_series(ckpt_dir)
    assert series.values["loss"] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert series.values["eval_loss"] == [(1, 11.0), (2, 12.0)]


def test_torn_last_line_is_ignored(ckpt_dir):
    _run(ckpt_dir, 3, save_at={3})
    with open(ckpt_dir / "metrics.jsonl", "a") as f:
        f.write('{"segment": "x", "step": 4, "metr')
    assert read_series(ckpt_dir).steps("loss") == [1, 2, 3]


def test_window_goes_into_the_manifest(ckpt_dir):
    _run(ckpt_dir, 4, save_at={4})
    doc = json.loads((ckpt_dir / "step_00000004" / "manifest.json").read_text())
    assert [m["step"] for m in doc["metrics"]] == [1, 2, 3, 4]
    assert doc["metrics"][0]["grad_norm"] == 1.0


def test_tracked_steps_are_on_disk_before_any_save_or_close(ckpt_dir):
    """Durability: every tracked step is appended as it is tracked (flushed, not fsynced),
    so the steps after the last save survive a crash of the process (it never saves
    again nor closes)."""
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir)
    for step in range(1, 9):
        ckpt.track(step, loss=p.step(), grad_norm=torch.tensor(float(step)))
        if step == 3:
            assert read_series(ckpt_dir).steps("loss") == [1, 2, 3]  # before any save
        if step == 5:
            ckpt.save(step)
    series = read_series(ckpt_dir)  # nothing closed, nothing saved after step 5
    assert series.steps("loss") == series.steps("grad_norm") == list(range(1, 9))
    assert [v for _, v in series.values["grad_norm"]] == [float(s) for s in range(1, 9)]


def test_a_failed_append_is_retried_and_never_tears_the_series(ckpt_dir, monkeypatch):
    """An append that fails (a full disk) is logged, not raised in the training loop; the
    lines are written by the next append, after a newline that ends any torn line."""
    ckpt = Problem().checkpointer(ckpt_dir)
    ckpt.track(1, loss=1.0)
    real = ckpt._run.record._log._journal._file.write
    calls = []

    def full_disk(text):
        calls.append(text)
        real(text[:7])  # half a line reached the file
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt._run.record._log._journal._file, "write", full_disk)
    ckpt.track(2, loss=2.0)  # no error here
    assert calls
    ckpt.track(3, loss=3.0)  # a fresh file handle: written
    assert read_series(ckpt_dir).steps("loss") == [1, 2, 3]
    ckpt.close()


def test_step_lines_are_the_json_of_the_record():
    """The per-step line track() writes (formatted by hand for speed) is exactly
    json.dumps of the record: non-finite values as strings, odd names escaped, -0.0 kept."""
    values = {"loss": 0.1, "tiny": 1e-300, "zero": -0.0, "nan": math.nan, "inf": -math.inf,
              'we"ird\\ name': 3.0, "\u00e9": 5e20}  # fmt: skip
    record = {"segment": "abc", "step": 7, "metrics": {k: metrics._json_value(v)
                                                        for k, v in values.items()}}  # fmt: skip
    assert metrics._step_line("abc", 7, values) == json.dumps(record, allow_nan=False)


def test_track_refuses_non_scalars(ckpt_dir):
    ckpt = Problem().checkpointer(ckpt_dir)
    with pytest.raises(ValueError, match="'loss' must be a scalar"):
        ckpt.track(1, loss=torch.ones(2))
    with pytest.raises(TypeError, match="'loss'"):
        ckpt.track(1, loss="low")


def test_non_finite_metrics_round_trip(ckpt_dir):
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir)
    ckpt.track(1, loss=float("nan"))
    ckpt.save(1)
    assert math.isnan(read_series(ckpt_dir).values["loss"][0][1])


# Health check ---------------------------------------------------------------------------


def _curve(n, start, rate, noise=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        start * math.exp(-rate * i) + noise * float(torch.randn(1, generator=g)) for i in range(n)
    ]


def test_health_check_quiet_on_a_continuing_curve():
    loss = _curve(60, 3.0, 0.03, noise=0.02)
    gn = _curve(60, 2.0, 0.01, noise=0.05, seed=1)
    assert health_check.diagnose(loss[:30], loss[30:], gn[:30], gn[30:]) == []


def test_health_check_names_the_lost_optimizer_signature():
    """F3: loss up while grad norm down right after the resume."""
    loss = _curve(30, 3.0, 0.03, noise=0.02)
    gn = _curve(30, 2.0, 0.01, noise=0.05, seed=1)
    after_loss = [loss[-1] * 1.6 + 0.01 * i for i in range(10)]
    after_gn = [gn[-1] * 0.4] * 10
    (warning,) = health_check.diagnose(loss, after_loss, gn, after_gn)
    assert "lost optimizer state" in warning


def test_health_check_flags_a_spike():
    loss = _curve(30, 3.0, 0.03, noise=0.02)
    after = [loss[-1] * 2.5, *loss[-1:] * 9]
    (warning,) = health_check.diagnose(loss, after)
    assert "loss spike" in warning


def test_health_check_through_the_checkpointer(ckpt_dir):
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir)
    for step in range(1, 21):
        ckpt.track(step, loss=1.0 - 0.01 * step, grad_norm=1.0)
    ckpt.save(20)
    q = Problem()
    resumed = q.checkpointer(ckpt_dir)
    resumed.restore()
    for step in range(21, 30):
        resumed.track(step, loss=3.0, grad_norm=0.2)
    assert len(resumed.warnings) == 1 and "lost optimizer state" in resumed.warnings[0]


# Stopping -------------------------------------------------------------------------------


def test_stop_at_environment_variable(ckpt_dir, monkeypatch):
    monkeypatch.setenv("UNBROKEN_STOP_AT", "3")
    ckpt = Problem().checkpointer(ckpt_dir)
    assert [ckpt.should_stop(s) for s in (1, 2, 3, 3, 4)] == [False, False, True, True, False]
    monkeypatch.setenv("UNBROKEN_STOP_AT", "soon")
    with pytest.raises(ValueError, match="UNBROKEN_STOP_AT"):
        ckpt.should_stop(5)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_requests_a_stop_and_handlers_are_restored(ckpt_dir, sig):
    calls = []
    previous = signal.signal(sig, lambda *a: calls.append(a))
    try:
        ckpt = Problem().checkpointer(ckpt_dir)
        assert not ckpt.should_stop(1)
        os.kill(os.getpid(), sig)
        assert ckpt.should_stop(2)
        ckpt.close()
        assert calls == []  # ours caught it, not the previous handler
        os.kill(os.getpid(), sig)
        assert len(calls) == 1  # restored on close
    finally:
        signal.signal(sig, previous)


def _recorded(name):
    from pathlib import Path

    return json.loads(
        (Path(__file__).parents[1] / "fixtures" / "health" / f"{name}.json").read_text()
    )


@pytest.mark.parametrize(
    ("name", "resume_at"),
    [("example_straight", k) for k in range(8, 36, 3)]
    + [("example_straight_short", k) for k in range(8, 24, 3)],
)
def test_health_check_quiet_on_the_recorded_correct_example(name, resume_at):
    """Series recorded from examples/gpt/train.py: no warning wherever the cut falls."""
    run = _recorded(name)
    loss, gn = run["loss"], run["grad_norm"]
    assert (
        health_check.diagnose(loss[:resume_at], loss[resume_at:], gn[:resume_at], gn[resume_at:])
        == []
    )


# The metric check measured in docs/health-check.md no longer promises these two. Both
# resumes come at step 20, right after warm-up, where the 20-step window's own
# step-to-step noise is huge (the loss falls by up to 0.6 a step, the gradient norm
# swings 3x): the reset's jump is 2.8 noise widths in the loss and 2.3 in the gradient
# norm (at low LR the loss does not rise at all, and the gradient norm jumps 1.3), below
# the floor of 6 that keeps exact resumes quiet. The bug behind them, a fresh AdamW after
# restore, is caught by the optimizer watch instead:
# tests/unit/test_health_check.py::test_fresh_optimizer_after_restore_is_caught.
_NOT_PROMISED = pytest.mark.xfail(
    strict=True,
    reason="the measured metric check does not flag a jump this small against a warm-up "
    "window's noise (docs/health-check.md); the optimizer watch catches this bug",
)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("example_reset_optimizer", marks=_NOT_PROMISED),
        pytest.param("example_reset_optimizer_low_lr", marks=_NOT_PROMISED),
    ],
)
def test_health_check_flags_the_recorded_reset_optimizer_example(name):
    """Series recorded from examples/gpt/train_buggy.py (fresh AdamW after restore); with a
    low LR at the resume only the gradient norm shows it."""
    run = _recorded(name)
    k, loss, gn = run["resumed_at"], run["loss"], run["grad_norm"]
    (warning,) = health_check.diagnose(loss[:k], loss[k:], gn[:k], gn[k:])
    assert warning.startswith("lost optimizer state suspected")


def test_track_before_restore_on_a_folder_with_checkpoints_is_refused(ckpt_dir):
    """Issue 36, item 8: track() before restore() on a folder holding checkpoints started
    the trackers under an invented run id and wrote a fresh-start segment into the run's
    metrics record. It is refused, saying what to do, and nothing is written; after
    restore() the same call is recorded in the resumed run's segment."""
    _run(ckpt_dir, 3, save_at={3}, close=True)
    before = (ckpt_dir / "metrics.jsonl").read_bytes()
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir)
    with pytest.raises(CheckpointError, match=r"track\(4\) before restore\(\).*Call restore"):
        ckpt.track(4, loss=1.0)
    assert (ckpt_dir / "metrics.jsonl").read_bytes() == before
    assert ckpt.restore().step == 3
    ckpt.track(4, loss=1.0)
    ckpt.close()
    series = read_series(ckpt_dir)
    assert series.steps("loss") == [1, 2, 3, 4] and series.resumes == [3]


def test_track_before_restore_is_allowed_on_an_empty_folder_and_with_overwrite(ckpt_dir):
    """A fresh folder has no run to resume: tracking first is a fresh start; overwrite=True
    says the checkpoints there belong to a run this one replaces."""
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir)
    ckpt.track(1, loss=1.0)
    ckpt.save(1)
    ckpt.close()
    again = Problem().checkpointer(ckpt_dir, overwrite=True)
    again.track(1, loss=2.0)
    again.close()
