"""Rollback: a save after resuming from an older step retires the abandoned newer steps, so
``restore()`` always follows the newest lineage (docs/format.md, "Branches")."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import Problem, assert_same_training_state


def _run_to_6(ckpt_dir):
    """Saves 4, 5 and 6 (keep_last=3), like the issue's scenario."""
    p = Problem()
    ckpt = p.checkpointer(ckpt_dir, keep_last=3)
    for step in range(1, 7):
        p.step()
        if step >= 4:
            ckpt.save(step)
    ckpt.close()
    return p


def _retired(ckpt_dir):
    return sorted(e.name.split("-")[1] for e in ckpt_dir.iterdir() if e.name.startswith(".retired"))


def _lineage(ckpt_dir, step):
    return json.loads((ckpt_dir / f"step_{step:08d}" / "manifest.json").read_text())["lineage"]


def test_rollback_then_save_retires_the_abandoned_branch(ckpt_dir):
    """The issue's scenario: save 4,5,6; restore(step=4); train differently; save(5'): a
    fresh restore() gives 5' with its state, 5 and 6 are unlisted but kept aside, the fork
    point 4 survives keep_last=2, and the lineage records what was retired. A rollback takes
    effect with its first save: a process that dies before it leaves 6 the newest."""
    _run_to_6(ckpt_dir)
    crashed = Problem(seed=1).checkpointer(ckpt_dir)
    crashed.restore(step=4)
    del crashed  # crash after the resume, before any save: nothing changes
    assert Problem(seed=2).checkpointer(ckpt_dir).restore().step == 6
    q = Problem(seed=1)
    ckpt = q.checkpointer(ckpt_dir, keep_last=2)
    assert ckpt.restore(step=4).step == 4
    torch.manual_seed(123)  # the new branch trains differently (other data)
    q.step()
    ckpt.save(5)
    ckpt.close()

    assert ckpt.steps() == [4, 5]
    assert _retired(ckpt_dir) == ["step_00000005", "step_00000006"]
    last = _lineage(ckpt_dir, 5)[-1]
    assert (last["event"], last["from_step"], last["retired"]) == ("resume", 4, [5, 6])

    fresh = Problem(seed=2)
    report = fresh.checkpointer(ckpt_dir).restore()
    assert report.step == 5
    assert_same_training_state(q, fresh)


def test_retention_after_a_fork_keeps_the_fork_point_until_the_branch_has_its_own(ckpt_dir):
    """keep_last counts only the surviving lineage: the fork point is deleted only once
    keep_last checkpoints of the new branch exist; retired steps are never counted."""
    _run_to_6(ckpt_dir)
    q = Problem(seed=1)
    ckpt = q.checkpointer(ckpt_dir, keep_last=2)
    ckpt.restore(step=4)
    saved = []
    for step in (5, 6, 7):
        q.step()
        ckpt.save(step)
        saved.append(ckpt.steps())
    ckpt.close()
    assert saved == [[4, 5], [5, 6], [6, 7]]
    assert _retired(ckpt_dir) == ["step_00000005", "step_00000006"]
    assert _lineage(ckpt_dir, 7)[-1]["retired"] == [5, 6]  # kept in later manifests too


def test_keep_last_1_at_the_fork_keeps_the_new_branch(ckpt_dir):
    """With keep_last=1 the new branch's first checkpoint replaces the fork point; the
    abandoned steps are kept aside, not deleted with it."""
    _run_to_6(ckpt_dir)
    q = Problem(seed=1)
    ckpt = q.checkpointer(ckpt_dir, keep_last=1)
    ckpt.restore(step=4)
    q.step()
    ckpt.save(5)
    ckpt.close()
    assert ckpt.steps() == [5]
    assert _retired(ckpt_dir) == ["step_00000005", "step_00000006"]
    fresh = Problem(seed=2)
    assert fresh.checkpointer(ckpt_dir).restore().step == 5
    assert_same_training_state(q, fresh)


def test_a_failed_first_save_retires_nothing_and_the_next_one_does(ckpt_dir, monkeypatch):
    """A save after a rollback that fails at its commit puts the retired steps back (the
    listing is as before); the next successful save retires them."""
    _run_to_6(ckpt_dir)
    q = Problem(seed=1)
    ckpt = q.checkpointer(ckpt_dir, keep_last=None)
    ckpt.restore(step=4)
    q.step()
    real = os.rename

    def failing(src, dst):
        if ".partial-" in os.fspath(src):
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError):
        ckpt.save(5)
    monkeypatch.setattr(os, "rename", real)
    assert ckpt.steps() == [4, 5, 6] and _retired(ckpt_dir) == []
    ckpt.save(5)
    assert ckpt.steps() == [4, 5] and _retired(ckpt_dir) == ["step_00000005", "step_00000006"]
    ckpt.close()


def test_resume_from_the_latest_retires_nothing(ckpt_dir):
    """The ordinary resume (from the newest step) is no fork: nothing is retired."""
    _run_to_6(ckpt_dir)
    q = Problem(seed=1)
    ckpt = q.checkpointer(ckpt_dir, keep_last=None)
    assert ckpt.restore().step == 6
    q.step()
    ckpt.save(7)
    ckpt.close()
    assert ckpt.steps() == [4, 5, 6, 7] and _retired(ckpt_dir) == []
    assert _lineage(ckpt_dir, 7)[-1]["retired"] == []


def test_async_save_after_a_rollback_retires_once(ckpt_dir):
    """With async_save the retirement happens at the first background commit; later
    saves retire nothing more."""
    _run_to_6(ckpt_dir)
    q = Problem(seed=1)
    ckpt = q.checkpointer(ckpt_dir, keep_last=None, async_save=True)
    ckpt.restore(step=4)
    for step in (5, 6):
        q.step()
        ckpt.save(step)
    ckpt.close()
    assert ckpt.steps() == [4, 5, 6]
    assert _retired(ckpt_dir) == ["step_00000005", "step_00000006"]
    assert _lineage(ckpt_dir, 6)[-1]["retired"] == [5, 6]
    fresh = Problem(seed=2)
    assert fresh.checkpointer(ckpt_dir).restore().step == 6
    assert_same_training_state(q, fresh)


_CRASH_MIDWAY = """
import os, sys
sys.path.insert(0, sys.argv[2])
from conftest import Problem

real = os.rename

def rename(src, dst):
    if ".retired-step_00000005" in os.fspath(dst):
        os._exit(3)  # killed between the two retirements, before the commit
    return real(src, dst)

os.rename = rename
q = Problem(seed=1)
ckpt = q.checkpointer(sys.argv[1], keep_last=None)
ckpt.restore(step=4)
q.step()
ckpt.save(5)
"""


def test_crash_between_retirements_leaves_a_prefix_of_the_old_branch(ckpt_dir):
    """A process killed after retiring step 6 but before retiring 5 (and before the
    commit): steps are retired newest first, so 4 and 5 stay listed (a consistent prefix
    of the old branch, as if the save had not started) and restore() resumes 5."""
    import subprocess
    import sys
    from pathlib import Path

    _run_to_6(ckpt_dir)
    tests = str(Path(__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _CRASH_MIDWAY, str(ckpt_dir), tests], env=env)
    assert done.returncode == 3
    fresh = Problem(seed=2)
    ckpt = fresh.checkpointer(ckpt_dir)
    assert ckpt.steps() == [4, 5] and _retired(ckpt_dir) == ["step_00000006"]
    assert ckpt.restore().step == 5
    ckpt.close()
