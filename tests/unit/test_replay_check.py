"""Replay check: steps a resumed run recomputes are compared bit for bit with the ones the
earlier run recorded (run/replay_check.py)."""

from __future__ import annotations

import json
import logging

import torch

from conftest import Problem


def _train(ckpt, p, start, upto, *, save_at=(), nan_at=None):
    for step in range(start, upto):
        loss = p.step()
        if step + 1 == nan_at:
            loss = float("nan")
        ckpt.track(step + 1, loss=loss, weight_norm=p.model.inp.weight.norm())
        if step + 1 in save_at:
            ckpt.save(step + 1)


def _crashed_run(ckpt_dir, *, upto=8, save_at=(5,), nan_at=None):
    """Tracks every step up to ``upto``, saves at ``save_at``, then "crashes": the objects
    are dropped without save() or close()."""
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir, keep_last=None)
    ckpt.restore()
    _train(ckpt, p, 0, upto, save_at=save_at, nan_at=nan_at)
    del ckpt


def _resume(ckpt_dir, **restore_kwargs):
    q = Problem(seed=1)
    ckpt = q.checkpointer(ckpt_dir, keep_last=None)
    start = ckpt.restore(**restore_kwargs).step
    return q, ckpt, start


def test_crash_after_the_last_save_replays_identically(ckpt_dir, caplog):
    """Crash after the last save: the resumed run recomputes steps 6..8, which match the
    recorded ones bit for bit; the verdict is logged, kept in metrics.jsonl and in the
    next manifest's lineage."""
    _crashed_run(ckpt_dir)
    q, ckpt, start = _resume(ckpt_dir)
    assert start == 5 and ckpt.replay.status == "pending" and ckpt.replay.recorded_steps == 3
    with caplog.at_level(logging.INFO, logger="unbroken"):
        _train(ckpt, q, start, 8)
    verdict = ckpt.replay
    assert verdict.identical is True and verdict.status == "identical"
    assert (verdict.compared_steps, verdict.first_difference, verdict.step) == (3, None, None)
    assert any("identical" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
    assert ckpt.warnings == []
    ckpt.save(8)
    ckpt.close()
    event = json.loads((ckpt_dir / "step_00000008" / "manifest.json").read_text())["lineage"][-1]
    assert event["event"] == "resume" and event["replay"]["status"] == "identical"
    lines = [json.loads(x) for x in (ckpt_dir / "metrics.jsonl").read_text().splitlines()]
    (recorded,) = [x["replay"] for x in lines if "replay" in x]
    assert recorded["status"] == "identical" and recorded["compared_steps"] == 3


def test_reset_optimizer_is_caught_at_the_first_replayed_step(ckpt_dir, caplog):
    """A deliberately wrong resume (a fresh optimizer): the first differing step and metric
    are named, loudly (a warning and ckpt.warnings)."""
    _crashed_run(ckpt_dir)
    q, ckpt, start = _resume(ckpt_dir, reset={"optimizer"})
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        _train(ckpt, q, start, 8)
    verdict = ckpt.replay
    assert verdict.identical is False and verdict.status == "different"
    # The loss of step 6 is computed before the first optimizer step: still identical.
    assert (verdict.step, verdict.metric) == (6, "weight_norm")
    assert verdict.compared_steps == 1
    (warned,) = [r.getMessage() for r in caplog.records if "replay check" in r.getMessage()]
    assert "DIFFERENT at step 6, metric 'weight_norm'" in warned
    assert "started optimizer fresh (reset)" in warned  # says why it is expected
    assert any("DIFFERENT at step 6" in w for w in ckpt.warnings)
    ckpt.close()


def test_a_perturbed_weight_is_caught(ckpt_dir):
    """A weight perturbed during the replay (by 1e-5 of itself, after the first step
    after the restore) changes the very next replayed loss. (Perturbed before that first
    step, the step itself refuses it: tests/unit/test_first_step.py.)"""
    _crashed_run(ckpt_dir)
    q, ckpt, start = _resume(ckpt_dir)
    _train(ckpt, q, start, start + 1)
    with torch.no_grad():
        q.model.out.weight[0, 0] *= 1 + 1e-5
    _train(ckpt, q, start + 1, 8)
    assert (ckpt.replay.status, ckpt.replay.step, ckpt.replay.metric) == ("different", 7, "loss")
    assert "recorded" in ckpt.replay.first_difference
    ckpt.close()


def test_nan_equals_nan(ckpt_dir):
    """A NaN recorded and a NaN replayed at the same step are the same value."""
    _crashed_run(ckpt_dir, nan_at=7)
    q, ckpt, start = _resume(ckpt_dir)
    _train(ckpt, q, start, 8, nan_at=7)
    assert ckpt.replay.identical is True and ckpt.replay.compared_steps == 3
    ckpt.close()


def test_rollback_compares_against_the_abandoned_branch_and_close_decides(ckpt_dir):
    """restore(step=3) with steps 4..8 recorded: the replayed steps are compared as they
    come; a run that closes halfway through the range gets its verdict at close()."""
    _crashed_run(ckpt_dir, save_at=(3, 5))
    q, ckpt, start = _resume(ckpt_dir, step=3)
    assert ckpt.replay.recorded_steps == 5
    _train(ckpt, q, start, 6)
    assert ckpt.replay.status == "pending" and ckpt.replay.compared_steps == 3
    ckpt.close()
    assert ckpt.replay.status == "identical" and ckpt.replay.compared_steps == 3


def test_nothing_recorded_after_the_checkpoint(ckpt_dir):
    """A run that stopped right at its save leaves nothing to replay: status "none"."""
    _crashed_run(ckpt_dir, upto=5)
    q, ckpt, start = _resume(ckpt_dir)
    _train(ckpt, q, start, 7)
    assert ckpt.replay.status == "none" and ckpt.replay.identical is None
    ckpt.close()


def _replays_identically_from_4(ckpt_dir, recorded: int, upto: int) -> None:
    """Restored at step 4, with ``recorded`` later steps to compare, and trained to
    ``upto``: every recorded step compared, all identical."""
    q, ckpt, start = _resume(ckpt_dir, step=4)
    assert ckpt.replay.recorded_steps == recorded
    _train(ckpt, q, start, upto)
    assert ckpt.replay.status == "identical" and ckpt.replay.compared_steps == recorded
    ckpt.close()


def test_reference_only_from_runs_continuing_from_the_restored_checkpoint(ckpt_dir):
    """Run A saves 2 and 4 and tracks to 8; run B resumes from 2, trains differently and
    dies unsaved. Restoring 4 compares against A's steps 5..8 (which continued from 4),
    never B's (which forked at 2), although B's are the newest lines in metrics.jsonl."""
    _crashed_run(ckpt_dir, save_at=(2, 4))
    q, ckpt, start = _resume(ckpt_dir, step=2)
    torch.manual_seed(99)  # other data
    _train(ckpt, q, start, 5)
    del ckpt
    _replays_identically_from_4(ckpt_dir, recorded=4, upto=8)


def test_reference_follows_later_resumes_of_the_same_line(ckpt_dir):
    """Run A saves 4 and 6 and stops at 6; run B resumes from 6 and tracks 7..9 before it
    dies. Restoring 4 compares 5..6 (A's) and 7..9 (B's, which continued A's line)."""
    _crashed_run(ckpt_dir, upto=6, save_at=(4, 6))
    q, ckpt, start = _resume(ckpt_dir)
    assert start == 6 and ckpt.replay.status == "none"
    _train(ckpt, q, start, 9)
    del ckpt
    _replays_identically_from_4(ckpt_dir, recorded=5, upto=9)


def test_a_damaged_metrics_file_never_fails_the_restore(ckpt_dir):
    """A metrics.jsonl edited by hand (a value that is not a number) makes the check skip,
    naming the file; the restore itself succeeds."""
    _crashed_run(ckpt_dir)
    lines = (ckpt_dir / "metrics.jsonl").read_text().splitlines()
    lines[-1] = lines[-1].replace('"loss": ', '"loss": "low", "was": ')
    (ckpt_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    _, ckpt, start = _resume(ckpt_dir)
    assert start == 5 and ckpt.replay.status == "skipped"
    assert "metrics.jsonl is unreadable" in ckpt.replay.reason
    ckpt.close()


def test_steps_a_run_withdrew_are_no_reference(ckpt_dir):
    """A segment that lost the folder to another run (its save refused) withdrew its steps
    after its last commit (a ``retracted`` line): they are not the reference the next
    resume compares with, whatever they hold. The steps it kept still are."""
    _crashed_run(ckpt_dir, upto=8, save_at=(5,))
    lines = [json.loads(x) for x in (ckpt_dir / "metrics.jsonl").read_text().splitlines()]
    segment = lines[0]["segment"]
    with open(ckpt_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
        metrics = {"loss": 123.0, "weight_norm": 1.0}
        f.write(json.dumps({"segment": segment, "step": 7, "metrics": metrics}) + "\n")
        withdrawn = {"retracted": True, "kept_upto": 6, "reason": "another run committed"}
        f.write(json.dumps({"segment": segment, **withdrawn}) + "\n")
    q, ckpt, start = _resume(ckpt_dir)
    assert start == 5 and ckpt.replay.recorded_steps == 1  # step 6 only: 7 and 8 withdrawn
    _train(ckpt, q, start, 8)
    assert ckpt.replay.identical is True and ckpt.replay.compared_steps == 1


# A step tracked in two calls (issue 36, item 3) -------------------------------------------

EVAL_X = torch.ones(2, 4)  # a fixed evaluation batch: evaluating draws no random numbers


def _train_with_eval(ckpt, p, start, upto, *, save_at=(), shift=0.0, evaluate=True, cut=None):
    """Tracks the loss, then on even steps ``eval_loss`` in a second call for the same
    step (as docs/integrations/accelerate.md does); ``cut``: return right after the
    first call of that step (a crash between the two calls)."""
    for step in range(start + 1, upto + 1):
        ckpt.track(step, loss=p.step())
        if step == cut:
            return
        if evaluate and step % 2 == 0:
            with torch.no_grad():
                eval_loss = p.model(EVAL_X).pow(2).mean().item() + shift
            ckpt.track(step, eval_loss=eval_loss)
        if step in save_at:
            ckpt.save(step)


def _crashed_run_with_eval(ckpt_dir, **kwargs):
    """Saves step 5, tracks to 8 (loss, and eval_loss on even steps in a second call),
    then is dropped without close()."""
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir, keep_last=None)
    ckpt.restore()
    _train_with_eval(ckpt, p, 0, 8, save_at=(5,), **kwargs)
    del ckpt


def test_a_step_tracked_in_two_calls_replays_identically(ckpt_dir):
    """Issue 36, item 3: steps 6 and 8 tracked as ``track(s, loss=)`` then
    ``track(s, eval_loss=)``; after the crash an exact recompute is identical (it was
    DIFFERENT, "eval_loss: recorded, but not tracked in the replay", compared at the first
    call), with nothing in the warnings, the record's verdict or the next lineage."""
    _crashed_run_with_eval(ckpt_dir)
    q, ckpt, start = _resume(ckpt_dir)
    assert start == 5 and ckpt.replay.recorded_steps == 3
    _train_with_eval(ckpt, q, start, 8)
    ckpt.save(8)
    ckpt.close()
    assert (ckpt.replay.status, ckpt.replay.compared_steps) == ("identical", 3)
    assert ckpt.warnings == []
    event = json.loads((ckpt_dir / "step_00000008" / "manifest.json").read_text())["lineage"][-1]
    assert event["replay"]["status"] == "identical"
    lines = [json.loads(x) for x in (ckpt_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["replay"]["status"] for x in lines if "replay" in x] == ["identical"]


def test_a_crash_between_the_two_calls_of_a_step_replays_identically(ckpt_dir):
    """Killed after ``track(8, loss=)`` and before ``track(8, eval_loss=)``: the record
    holds step 8's loss only, which the recompute (tracking both) matches."""
    _crashed_run_with_eval(ckpt_dir, cut=8)
    q, ckpt, start = _resume(ckpt_dir)
    _train_with_eval(ckpt, q, start, 9)
    assert (ckpt.replay.status, ckpt.replay.compared_steps) == ("identical", 3)
    ckpt.close()


def test_a_different_second_call_is_caught(ckpt_dir):
    """The replayed ``eval_loss`` of step 6 off by 1e-6: DIFFERENT at step 6, metric
    ``eval_loss``, at once (its loss, tracked first, was equal)."""
    _crashed_run_with_eval(ckpt_dir)
    q, ckpt, start = _resume(ckpt_dir)
    _train_with_eval(ckpt, q, start, 6, shift=1e-6)
    verdict = ckpt.replay
    assert (verdict.status, verdict.step, verdict.metric) == ("different", 6, "eval_loss")
    assert any("DIFFERENT at step 6, metric 'eval_loss'" in w for w in ckpt.warnings)
    ckpt.close()


def test_a_second_call_left_out_of_the_replay_is_caught_once_the_step_is_complete(ckpt_dir):
    """A replay that never tracks ``eval_loss``: step 6 is DIFFERENT ("recorded, but not
    tracked in the replay") once step 7 completes it, not at its first call."""
    _crashed_run_with_eval(ckpt_dir)
    q, ckpt, start = _resume(ckpt_dir)
    _train_with_eval(ckpt, q, start, 6, evaluate=False)
    assert ckpt.replay.status == "pending"  # the evaluation of step 6 may still come
    _train_with_eval(ckpt, q, 6, 7, evaluate=False)
    verdict = ckpt.replay
    assert (verdict.status, verdict.step, verdict.metric) == ("different", 6, "eval_loss")
    assert verdict.first_difference == "recorded, but not tracked in the replay"
    ckpt.close()
