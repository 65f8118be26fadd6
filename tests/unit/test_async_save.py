"""async_save=True: save() returns after staging; the write and commit run behind."""

from __future__ import annotations

import copy
import errno
import threading

import pytest

import tamper
import unbroken as ub
from conftest import Problem, assert_same_training_state, save_steps
from unbroken.format import shard_writer


def test_changes_after_save_returns_do_not_leak_into_the_checkpoint(ckpt_dir, monkeypatch):
    p = Problem()
    for _ in range(3):
        p.step()
    snapshot = copy.deepcopy(p)

    started, release = threading.Event(), threading.Event()
    original = shard_writer.ShardWriter.write_data

    def slow_write(self, plan, planner):
        started.set()
        assert release.wait(30)
        return original(self, plan, planner)

    monkeypatch.setattr(shard_writer.ShardWriter, "write_data", slow_write)
    ckpt = p.checkpointer(ckpt_dir, async_save=True)
    ckpt.save(3)
    assert started.wait(30)  # the write is in flight, held back ...
    assert ckpt.steps() == []  # ... so nothing is committed yet
    for _ in range(2):  # ... while training changes every parameter and moment
        p.step()
    release.set()
    ckpt.close()
    assert ckpt.steps() == [3]

    fresh = Problem(seed=4)
    fresh.checkpointer(ckpt_dir).restore()
    assert_same_training_state(snapshot, fresh)


def test_background_error_surfaces_at_the_next_save_and_at_close(ckpt_dir, monkeypatch):
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir, async_save=True)
    p.step()
    ckpt.save(1)
    ckpt.wait()

    def full_disk(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shard_writer.ShardWriter, "write_data", full_disk)
    ckpt.save(2)  # returns: the failure happens in the background
    with pytest.raises(ub.CheckpointError, match="disk is full"):
        ckpt.save(3)
    ckpt.save(4)
    with pytest.raises(ub.CheckpointError, match="disk is full"):
        ckpt.close()
    assert ckpt.steps() == [1]
    assert [x.name for x in ckpt_dir.iterdir() if x.name.startswith(".partial")] == []


def test_async_and_sync_checkpoints_are_identical(tmp_path):
    def run(path, async_save):
        save_steps(path, async_save=async_save)
        doc = tamper.read(path / "step_00000002")
        return {k: v["fingerprint"] for k, v in doc["tensors"].items()}

    assert run(tmp_path / "a", True) == run(tmp_path / "b", False)
