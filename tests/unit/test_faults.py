"""Faults injected for real: a full disk, a rival saver, hostile manifests, interrupted
deletion. The last committed checkpoint always survives and nothing unsafe is read."""

from __future__ import annotations

import errno
import os
import subprocess
import uuid

import pytest
import torch

import tamper
import unbroken as ub
from conftest import Problem
from unbroken.format import shard_writer, shards
from unbroken.storage.locate import checkpoint_dir


def _saved(ckpt_dir, steps=(1,)) -> Problem:
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir, keep_last=None)
    for s in steps:
        p.step()
        ckpt.save(s)
    return p


# Disk full ------------------------------------------------------------------------------


@pytest.fixture
def small_filesystem(tmp_path):
    """A real 400 KiB tmpfs where mounting is permitted (root on Linux), else None."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    yield mount if made.returncode == 0 else None
    if made.returncode == 0:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _big_problem() -> Problem:
    p = Problem()
    p.model.inp = torch.nn.Linear(4, 8)
    p.model.out = torch.nn.Linear(8, 1)
    p.big = torch.nn.Parameter(torch.randn(60_000))  # 240 KiB: one checkpoint fits, two don't
    p.model.register_parameter("big", p.big)
    p.opt = torch.optim.AdamW(p.model.parameters(), lr=1e-3)
    p.sched = torch.optim.lr_scheduler.LambdaLR(p.opt, lambda s: 1.0)
    return p


@pytest.mark.parametrize("how", ["tmpfs", "injected"])
def test_disk_full_keeps_the_last_checkpoint_and_training_goes_on(
    tmp_path, small_filesystem, monkeypatch, how
):
    """A save that runs out of space raises a clear error, removes its partial folder,
    leaves the previous checkpoint untouched, and a later save succeeds."""
    if how == "injected" or small_filesystem is None:
        root = tmp_path / "ckpts"
        original = shard_writer.ShardWriter.write_data
        calls = {"n": 0}

        def fail_part_way(self, plan, planner):
            calls["n"] += 1
            if calls["n"] == 2:  # the second save: write some bytes, then ENOSPC
                with open(os.path.join(self.directory, shards.shard_file_name(0)), "wb") as f:
                    f.write(b"\0" * 1000)
                raise OSError(errno.ENOSPC, "No space left on device")
            return original(self, plan, planner)

        monkeypatch.setattr(shard_writer.ShardWriter, "write_data", fail_part_way)
    else:
        root = small_filesystem / "ckpts"
    p = _big_problem()
    ckpt = p.checkpointer(root, keep_last=None)
    p.step()
    ckpt.save(1)
    before = (root / "step_00000001" / "rank_00000.bin").read_bytes()
    p.step()
    with pytest.raises(ub.CheckpointError, match="disk is full"):
        ckpt.save(2)
    assert ckpt.steps() == [1]
    assert sorted(x.name for x in root.iterdir() if x.is_dir()) == ["step_00000001"]
    assert (root / "step_00000001" / "rank_00000.bin").read_bytes() == before
    # Training continues; once there is room (an old checkpoint removed), saving works.
    monkeypatch.undo()
    p.step()
    shutil_rmtree(root / "step_00000001")
    ckpt.save(3)
    assert ckpt.steps() == [3]
    assert _big_problem().checkpointer(root).restore().step == 3


def shutil_rmtree(path):
    import shutil

    shutil.rmtree(path)


# Two savers -----------------------------------------------------------------------------


def test_a_second_saver_gets_a_clear_error_and_corrupts_nothing(ckpt_dir):
    p = _saved(ckpt_dir)
    rival = p.checkpointer(ckpt_dir)
    rival.restore()  # the same run continues (a new run could not save here)
    busy = pytest.raises(ub.CheckpointError, match=r"another save into .* is in progress")
    with checkpoint_dir(ckpt_dir).save_lock(), busy:  # another job is mid-save
        rival.save(2)
    assert rival.steps() == [1]
    rival.save(2)  # once the other is done, saving works
    assert rival.steps() == [1, 2]


def test_a_restore_does_not_clean_a_partial_save_in_progress(ckpt_dir):
    _saved(ckpt_dir)
    partial = ckpt_dir / f".partial-step_00000002-{uuid.uuid4().hex[:12]}"
    with checkpoint_dir(ckpt_dir).save_lock():
        partial.mkdir()
        assert Problem().checkpointer(ckpt_dir).restore().step == 1
        assert partial.exists()  # the saver still owns it
    Problem().checkpointer(ckpt_dir).restore()
    assert not partial.exists()  # now it is a leftover and goes


# Hostile checkpoints --------------------------------------------------------------------


def _first_tensor(doc):
    return doc["tensors"]["model/inp.weight"]


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: _first_tensor(d).update(shape=[2**40, 2**20]), "chunk"),
        (lambda d: _first_tensor(d)["chunks"][0].update(length=2**45), "chunk length"),
        (lambda d: _first_tensor(d)["chunks"][0].update(file="../../etc/passwd"), "unlisted file"),
        (lambda d: d["files"].update({"../escape.bin": {"size": 1}}), "unsafe file name"),
        (lambda d: _first_tensor(d).update(dtype="object"), "unknown dtype"),
        (lambda d: d.update(format_version=99), "format_version"),
        (lambda d: _first_tensor(d)["chunks"][0].update(offset=10**12), "beyond the end"),
    ],
    ids=[
        "absurd-shape",
        "absurd-length",
        "traversal-in-chunk",
        "traversal-in-files",
        "bad-dtype",
        "future-format",
        "offset-past-end",
    ],
)
def test_hostile_manifest_is_refused(ckpt_dir, edit, match):
    _saved(ckpt_dir)
    tamper.edit(ckpt_dir / "step_00000001", edit)  # re-sealed: a checksum is no defence
    with pytest.raises(ub.CorruptCheckpointError, match=match):
        Problem().checkpointer(ckpt_dir).restore(step=1)


def test_deeply_nested_manifest_is_refused_not_crashing(ckpt_dir):
    _saved(ckpt_dir)
    path = ckpt_dir / "step_00000001" / "manifest.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ub.CorruptCheckpointError):
        Problem().checkpointer(ckpt_dir).restore(step=1)


# Retention ------------------------------------------------------------------------------


def test_interrupted_deletion_leaves_a_usable_state(ckpt_dir):
    """Deletion first renames a checkpoint out of the listing, then deletes its files: a
    crash in between leaves a .trash folder, never a listed half-deleted checkpoint."""
    _saved(ckpt_dir, steps=(1, 2))
    trash = ckpt_dir / ".trash-step_00000001-0123456789ab"
    os.rename(ckpt_dir / "step_00000001", trash)
    (trash / "rank_00000.bin").unlink()  # the crash hit mid-deletion
    ckpt = Problem().checkpointer(ckpt_dir)
    assert ckpt.steps() == [2]
    assert ckpt.restore().step == 2
    assert not trash.exists()


def test_retention_never_removes_the_newest_even_if_steps_go_back(ckpt_dir):
    p = _saved(ckpt_dir, steps=(5, 6, 7))
    ckpt = p.checkpointer(ckpt_dir, keep_last=1)
    ckpt.restore()
    ckpt.save(3)  # a resumed run re-saving an earlier step
    assert ckpt.steps() == [3]
