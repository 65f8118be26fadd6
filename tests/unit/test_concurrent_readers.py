"""Readers never block a save, and a step that a save prunes or replaces while a restore
reads it is listed again, not reported as damage.

Each test stops the reader at a chosen instant (a patched call) and makes the other
side act right there, so the interleaving is the same on every run.
"""

from __future__ import annotations

import os
import shutil
import threading
import uuid

import pytest

import unbroken as ub
from conftest import Problem, assert_same_training_state
from unbroken.format import shard_reader
from unbroken.storage.locate import checkpoint_dir


def _saved(ckpt_dir, steps, seed=0, **kwargs) -> tuple[Problem, ub.Checkpointer]:
    p = Problem(seed=seed)
    ckpt = p.checkpointer(ckpt_dir, **kwargs)
    for s in steps:
        p.step()
        ckpt.save(s)
    return p, ckpt


def test_a_restore_cleaning_leftovers_never_makes_a_save_fail(ckpt_dir, monkeypatch):
    """Case: a restore() in another thread is cleaning a crashed save's leftover folder
    (stopped in the middle of deleting it) when the training job saves: the save
    succeeds, and the restore finishes normally."""
    p, ckpt = _saved(ckpt_dir, [1], keep_last=None)
    leftover = ckpt_dir / f".partial-step_00000009-{uuid.uuid4().hex[:12]}"
    leftover.mkdir()
    (leftover / "rank_00000.bin").write_bytes(b"\0" * 100)
    cleaning, saved = threading.Event(), threading.Event()
    real_rmtree = shutil.rmtree

    def slow_rmtree(path, *args, **kwargs):
        if threading.current_thread().name == "reader":
            cleaning.set()
            saved.wait(60)  # the reader is mid-cleanup while the save runs
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", slow_rmtree)
    result = {}

    def read() -> None:
        try:
            result["step"] = Problem(seed=1).checkpointer(ckpt_dir).restore().step
        except Exception as exc:  # reported below
            result["error"] = exc

    reader = threading.Thread(target=read, name="reader")
    reader.start()
    try:
        assert cleaning.wait(60)
        p.step()
        ckpt.save(2)  # used to fail: "another save into ... is in progress"
    finally:
        saved.set()
        reader.join(60)
    assert ckpt.steps() == [1, 2]
    assert result == {"step": 1} or result == {"step": 2}, result
    ckpt.close()


def _on_first_read(monkeypatch, act) -> None:
    """Run ``act()`` once, when a restore starts reading shard bytes."""
    real = shard_reader.ShardReader.read_data
    done = []

    def read_data(self, plan, planner):
        if not done:
            done.append(True)
            act()
        return real(self, plan, planner)

    monkeypatch.setattr(shard_reader.ShardReader, "read_data", read_data)


def test_a_step_pruned_while_being_restored_is_relisted_not_damage(ckpt_dir, monkeypatch):
    """Case: retention deletes the newest step (a newer one was just committed) while a
    restore reads it: the restore lists the steps again and restores the new newest
    exactly, with no 'damaged' warning (it used to fail with 'no committed checkpoint is
    sound' although a newer one was)."""
    _saved(ckpt_dir, [3], keep_last=1)
    writer = Problem(seed=4)
    training = writer.checkpointer(ckpt_dir, keep_last=1)
    training.restore()  # the training job that owns the folder, continuing from step 3

    def save_4_and_prune_3() -> None:
        writer.step()
        training.save(4)  # commits 4, then prunes 3

    _on_first_read(monkeypatch, save_4_and_prune_3)
    q = Problem(seed=9)
    report = q.checkpointer(ckpt_dir).restore()
    assert (report.step, report.warnings) == (4, [])
    assert_same_training_state(q, writer)


def test_an_older_step_pruned_while_being_restored_is_not_reported_damaged(ckpt_dir, monkeypatch):
    """Case: the step being restored is pruned (unlisted, then deleted, as retention
    does) while it is read, older ones remain: the next one restores, and the report has
    no 'skipped the damaged checkpoint' warning."""
    _saved(ckpt_dir, [1, 2, 3], keep_last=None)
    expected = Problem()
    for _ in range(2):
        expected.step()
    _on_first_read(monkeypatch, lambda: checkpoint_dir(ckpt_dir).remove(3))
    q = Problem(seed=9)
    report = q.checkpointer(ckpt_dir).restore()
    assert (report.step, report.warnings) == (2, [])
    assert_same_training_state(q, expected)


@pytest.mark.parametrize("which", [None, 2], ids=["latest", "step=2"])
def test_a_step_resaved_while_being_restored_loads_the_new_copy(ckpt_dir, monkeypatch, which):
    """Case: the step being restored is re-saved (replaced) by the training job while it
    is read: the restore reads it again and loads the new copy exactly; neither a
    'damaged' warning, a fallback to an older step, nor an error."""
    p, ckpt = _saved(ckpt_dir, [1, 2], keep_last=None)
    p.step()  # different state, saved again as step 2

    _on_first_read(monkeypatch, lambda: ckpt.save(2))
    q = Problem(seed=9)
    report = q.checkpointer(ckpt_dir).restore(step=which)
    assert (report.step, report.warnings) == (2, [])
    assert_same_training_state(q, p)
    assert not [x for x in os.listdir(ckpt_dir) if x.startswith((".replaced", ".partial"))]
